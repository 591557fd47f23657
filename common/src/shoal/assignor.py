"""Partition assignment: which live member owns which partition.

Pure and deterministic: no I/O, no clock, no randomness. The leader calls :func:`assign`
on every membership change (and when it rebalances load), the CLI's ``plan``/``status``
and the analytics call the helpers below; they must all agree, so everything lives here.

Why minimal movement matters: every partition whose owner changes is a hand-over (see
DESIGN.md, "Hand-over"). The old owner stops fetching, drains and acks what it has in
flight and releases the claim; only then can the new owner bind. That partition pauses
for the length of the drain, so each move is a small outage for the projects hashed to
it. The seed's ``sorted(members)[p % n]`` moves ~75-90% of partitions on every join or
leave; the sticky strategy moves the fewest partitions any balanced assignment can move:
a join moves only the newcomer's share, a leave only the leaver's partitions, and an
unchanged member set nothing at all.

Vocabulary:

* *quota*: how many partitions a member should own. With ``P`` partitions and ``n``
  members the quotas are ``P // n`` or ``P // n + 1`` (``P % n`` members get the +1), so
  owner counts differ by at most 1. With more members than partitions some quotas are 0.
* *move*: a partition that had an owner in ``previous`` and has a different one now.
  A partition that had no (in-range) owner before is an *initial placement*, not a move:
  nobody consumes it, so there is nothing to hand over and no pause to pay for. This is
  also why :func:`min_moves` of an empty ``previous`` is 0.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping

__all__ = [
    "STRATEGIES",
    "assign",
    "default_max_moves",
    "member_loads",
    "min_moves",
    "moved",
    "owner_counts",
    "quotas",
    "relieve_stalls",
    "skew",
]

STRATEGIES = ("sticky", "modulo")


def _check_partitions(partitions: int) -> int:
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise TypeError(f"partitions must be an int, got {partitions!r}")
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    return partitions


def _sorted_members(members: Iterable[str]) -> list[str]:
    """The member set, sorted: the input order must never influence the result."""
    if isinstance(members, str):
        # A lone id would otherwise be iterated character by character.
        raise TypeError(f"members must be an iterable of member ids, not a str ({members!r})")
    unique = set(members)
    for member in unique:
        if not isinstance(member, str) or not member:
            raise ValueError(f"member ids must be non-empty strings, got {member!r}")
    if not unique:
        raise ValueError("cannot assign partitions to an empty member set (no live members)")
    return sorted(unique)


def _holdings(
    partitions: int, members: list[str], previous: Mapping[int, str] | None
) -> tuple[dict[str, list[int]], list[int]]:
    """Split the previous assignment into what each current member holds (ascending)
    and the partitions nobody current holds (owner gone, or never owned).

    Only 0..P-1 is looked at, so out-of-range keys in ``previous`` are ignored.
    """
    held: dict[str, list[int]] = {m: [] for m in members}
    pool: list[int] = []
    prev = previous or {}
    for p in range(partitions):
        owner = prev.get(p)
        bucket = held.get(owner) if owner is not None else None
        if bucket is None:
            pool.append(p)
        else:
            bucket.append(p)
    return held, pool


def _quotas(partitions: int, members: list[str], held: Mapping[str, int]) -> dict[str, int]:
    # The +1 quotas go to the members that already hold the most (ties: smaller id
    # first). Giving the spare capacity to whoever would otherwise have to give a
    # partition away is exactly what makes the total excess, and so the moves, minimal.
    base, extra = divmod(partitions, len(members))
    ranked = sorted(members, key=lambda m: (-held.get(m, 0), m))
    return {m: base + (1 if i < extra else 0) for i, m in enumerate(ranked)}


def quotas(
    partitions: int, members: Iterable[str], previous: Mapping[int, str] | None = None
) -> dict[str, int]:
    """The target owner count of each member for a sticky assignment from ``previous``."""
    partitions = _check_partitions(partitions)
    ordered = _sorted_members(members)
    held, _ = _holdings(partitions, ordered, previous)
    return _quotas(partitions, ordered, {m: len(ps) for m, ps in held.items()})


def _sticky(
    partitions: int, members: list[str], previous: Mapping[int, str] | None
) -> dict[int, str]:
    held, pool = _holdings(partitions, members, previous)
    quota = _quotas(partitions, members, {m: len(ps) for m, ps in held.items()})
    owner = [""] * partitions
    for m in members:
        # A member keeps its lowest-numbered partitions up to its quota; the rest is
        # freed. Which ones it keeps does not affect the number of moves; the rule
        # only has to be deterministic.
        keep = quota[m]
        for p in held[m][:keep]:
            owner[p] = m
        pool.extend(held[m][keep:])
    # Freed, orphaned (owner left) and never-owned partitions go, lowest first, to the
    # members below quota in id order. Together the kept counts equal the sum of
    # quotas minus the pool size, so the pool fills every gap exactly.
    pool.sort()
    i = 0
    for m in members:
        need = quota[m] - min(len(held[m]), quota[m])
        for p in pool[i : i + need]:
            owner[p] = m
        i += need
    # Keyed in partition order, so logs and JSON of an assignment read naturally.
    return dict(enumerate(owner))


def _modulo(partitions: int, members: list[str]) -> dict[int, str]:
    # The seed's naive strategy, kept only as a baseline for tests and benchmarks: it
    # is balanced but reshuffles most partitions whenever n changes.
    n = len(members)
    return {p: members[p % n] for p in range(partitions)}


def default_max_moves(partitions: int, n_members: int) -> int:
    """Extra moves a load rebalance may make on top of the sticky assignment.

    ``max(1, P // (4 * n))``: a quarter of one member's share (8 at P=128, n=4), so a
    load-driven rebalance costs at most a quarter of the hand-overs a join costs, and
    always at least one move so a single hot spot can still be relieved.
    """
    return max(1, partitions // (4 * max(1, n_members)))


def _partition_loads(partitions: int, loads: Mapping[int, float]) -> list[float]:
    out = [0.0] * partitions
    for p, value in loads.items():
        if not 0 <= p < partitions:
            continue
        v = float(value)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"load of partition {p} must be finite and >= 0, got {value!r}")
        out[p] = v
    return out


def _rebalance_load(
    assignment: dict[int, str],
    members: list[str],
    previous: Mapping[int, str] | None,
    load: list[float],
    budget: int,
) -> dict[int, str]:
    """Greedy: move one partition from the most to the least loaded member while that
    strictly lowers the larger of the two loads, at most ``budget`` times.

    Each step lowers the source's load and leaves the destination below the source's
    old load, so the maximum member load never increases. Ties are broken by member id
    and partition number, so the result is deterministic.
    """
    prev = previous or {}
    mine: dict[str, list[int]] = {m: [] for m in members}
    total: dict[str, float] = {m: 0.0 for m in members}
    for p in sorted(assignment):
        m = assignment[p]
        mine[m].append(p)
        total[m] += load[p]
    for _ in range(budget):
        src = min(members, key=lambda m: (-total[m], m))
        dst = min(members, key=lambda m: (total[m], m))
        if src == dst:
            break
        best: tuple[float, int, int] | None = None
        for p in mine[src]:
            lp = load[p]
            if lp <= 0 or total[dst] + lp >= total[src]:
                continue
            # Best pair balance first; then prefer a partition that is moving anyway
            # (its previous owner is not src) so no new hand-over is added; then the
            # lowest partition number.
            key = (max(total[src] - lp, total[dst] + lp), 0 if prev.get(p) != src else 1, p)
            if best is None or key < best:
                best = key
        if best is None:
            break
        p = best[2]
        mine[src].remove(p)
        mine[dst].append(p)
        total[src] -= load[p]
        total[dst] += load[p]
        assignment[p] = dst
    return assignment


def assign(
    partitions: int,
    members: Iterable[str],
    previous: Mapping[int, str] | None = None,
    *,
    loads: Mapping[int, float] | None = None,
    strategy: str = "sticky",
    max_moves: int | None = None,
) -> dict[int, str]:
    """Owner of every partition ``0..partitions-1``, chosen among ``members``.

    ``members`` is a set: order and duplicates do not matter. ``previous`` may name
    owners that are gone, partitions out of range (ignored) or miss partitions (unowned;
    placing them is not a move).

    ``strategy="sticky"`` (default), no ``loads``: owner counts differ by at most 1 and
    the number of moves is :func:`min_moves`, the minimum of any balanced assignment.

    With ``loads`` (partition -> measured load, e.g. messages/s; missing partitions
    count as 0): the sticky assignment, then at most ``max_moves`` greedy moves (default
    :func:`default_max_moves`) from the most to the least loaded member, each strictly
    lowering the larger of the two loads. The maximum member load never increases; owner
    counts may then differ by more than 1, which is the point.

    ``strategy="modulo"``: the seed's ``sorted(members)[p % n]``, a baseline for
    comparison only; it ignores ``previous`` and does not accept ``loads``.
    """
    partitions = _check_partitions(partitions)
    ordered = _sorted_members(members)
    if strategy == "modulo":
        if loads is not None:
            raise ValueError("strategy 'modulo' is a comparison baseline and ignores loads")
        return _modulo(partitions, ordered)
    if strategy != "sticky":
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    result = _sticky(partitions, ordered, previous)
    if loads is None:
        return result
    budget = default_max_moves(partitions, len(ordered)) if max_moves is None else max_moves
    if budget < 0:
        raise ValueError(f"max_moves must be >= 0, got {max_moves}")
    return _rebalance_load(result, ordered, previous, _partition_loads(partitions, loads), budget)


def relieve_stalls(
    assignment: Mapping[int, str],
    stalled: Mapping[str, Iterable[int]],
    members: Iterable[str],
) -> dict[int, str]:
    """``assignment`` with every stalled partition moved away from the member that
    reports it stalled (progress.py), owner counts unchanged.

    ``stalled``: member -> the partitions it reports stalled; only partitions that
    ``assignment`` still gives to their reporter count (a report about a partition moved
    already is old news). Each goes to the eligible member with the fewest partitions
    (by name on ties), which gives back one of its own in exchange: its lowest
    partition that nobody reports stalled. A swap, not a plain move, so that the
    assignment stays as balanced as it was (the sticky assignor runs only when members
    change, and a move would leave a skew of 2 until then); a plain move only when no
    member has a partition to give back. A partition with no other member to go to
    stays where it is.
    """
    result = dict(assignment)
    ordered = _sorted_members(members)
    reported = {p for ps in stalled.values() for p in ps}
    counts = Counter(result.values())

    def swappable(member: str, p: int) -> int | None:
        return min(
            (q for q, owner in result.items() if owner == member and q != p and q not in reported),
            default=None,
        )

    for member in sorted(stalled):
        for p in sorted(set(stalled[member])):
            if result.get(p) != member:
                continue
            others = [m for m in ordered if m != member]
            swaps = [(counts[m], m, q) for m in others if (q := swappable(m, p)) is not None]
            if swaps:
                _, to, q = min(swaps)
                result[p], result[q] = to, member
            elif others:
                # Nobody has a partition to give back: move it all the same (a stalled
                # partition consumed nowhere is worse than a skew).
                to = min(others, key=lambda m: (counts[m], m))
                result[p] = to
                counts[member] -= 1
                counts[to] += 1
    return result


def moved(previous: Mapping[int, str], current: Mapping[int, str]) -> list[tuple[int, str, str]]:
    """``(partition, from, to)`` for every partition owned in ``previous`` whose owner in
    ``current`` differs, by partition. Partitions absent from either side are not moves
    (unowned before: initial placement; absent now: nothing to hand over to)."""
    out: list[tuple[int, str, str]] = []
    for p in sorted(previous):
        before = previous[p]
        after = current.get(p)
        if after is not None and after != before:
            out.append((p, before, after))
    return out


def min_moves(partitions: int, members: Iterable[str], previous: Mapping[int, str]) -> int:
    """The fewest moves any balanced assignment of ``members`` needs from ``previous``.

    Partitions whose previous owner is no longer a member must move; each surviving
    member must give away what it holds beyond its quota, the +1 quotas going to the
    members holding the most. Unowned partitions are not moves, so an empty ``previous``
    needs 0.
    """
    partitions = _check_partitions(partitions)
    ordered = _sorted_members(members)
    held, _ = _holdings(partitions, ordered, previous)
    counts = {m: len(ps) for m, ps in held.items()}
    quota = _quotas(partitions, ordered, counts)
    current = set(ordered)
    orphaned = sum(
        1 for p in range(partitions) if previous.get(p) is not None and previous[p] not in current
    )
    return orphaned + sum(max(0, counts[m] - quota[m]) for m in ordered)


def owner_counts(assignment: Mapping[int, str], members: Iterable[str]) -> dict[str, int]:
    """Partitions per owner: every member (0 if it owns nothing) plus any owner in the
    assignment that is not a member (e.g. one that just left), sorted by id."""
    counts: dict[str, int] = dict.fromkeys(set(members), 0)
    for owner in assignment.values():
        counts[owner] = counts.get(owner, 0) + 1
    return dict(sorted(counts.items()))


def skew(assignment: Mapping[int, str], members: Iterable[str]) -> int:
    """Max minus min of :func:`owner_counts` (0 if there is nobody to count)."""
    values = owner_counts(assignment, members).values()
    return max(values) - min(values) if values else 0


def member_loads(assignment: Mapping[int, str], loads: Mapping[int, float]) -> dict[str, float]:
    """Summed load per owner in the assignment (partitions missing from ``loads``
    count as 0), sorted by id."""
    totals: dict[str, float] = {}
    for p in sorted(assignment):
        owner = assignment[p]
        totals[owner] = totals.get(owner, 0.0) + float(loads.get(p, 0.0))
    return dict(sorted(totals.items()))
