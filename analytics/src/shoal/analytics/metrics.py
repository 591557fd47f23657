"""The report's per-generation metrics, as pure functions of one generation and the one before.

Both report engines follow these definitions: the pandas oracle calls them directly, the
Spark job expresses the same arithmetic as DataFrame operations (see ``spark_job``), and the
tests check that the two agree and that :func:`min_moves` agrees with the assignor's own
:func:`shoal.consumer.assignor.min_moves` and with brute force.

Definitions (``previous`` is the previous generation's assignment in the log, ``None`` for a
group's first generation):

* *partitions* ``P``: the partitions of the current assignment.
* *move*: a partition of the current assignment that had an owner in ``previous`` and has a
  different one now. A partition without an owner before is an initial placement, not a move.
* *min_moves*: the fewest moves any balanced assignment of the current members needs from
  ``previous``: partitions whose previous owner is not a current member, plus each current
  member's excess over its quota, quotas being ``P // n`` or ``P // n + 1`` with the ``P % n``
  larger quotas going to the members that held the most (ties: smaller id first). 0 for a
  group's first generation and for a generation without members.
* *churn ratio*: moves / min_moves; 1.0 when both are 0; ``None`` (unbounded) when only
  the minimum is 0.
* owner counts: every member (0 if it owns nothing) and every owner that is not a member.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "CountStats",
    "churn_ratio",
    "count_stats",
    "member_loads",
    "min_moves",
    "moves",
    "owner_counts",
    "percentile",
    "quotas",
]


def quotas(partitions: int, held: Mapping[str, int]) -> dict[str, int]:
    """Target owner count of each member in ``held`` (member -> partitions it holds now).

    ``partitions // n`` each; the ``partitions % n`` larger quotas go to the members holding
    the most, ties broken by the smaller id. An empty ``held`` has no quotas.
    """
    if not held:
        return {}
    base, extra = divmod(partitions, len(held))
    ranked = sorted(held, key=lambda m: (-held[m], m))
    return {m: base + (1 if i < extra else 0) for i, m in enumerate(ranked)}


def min_moves(
    partitions: Iterable[int], members: Iterable[str], previous: Mapping[int, str] | None
) -> int:
    """The fewest moves a balanced assignment of ``members`` over ``partitions`` needs."""
    if previous is None:
        return 0
    current = set(members)
    if not current:
        return 0
    keys = list(partitions)
    held = dict.fromkeys(current, 0)
    orphaned = 0
    for p in keys:
        owner = previous.get(p)
        if owner is None:
            continue
        if owner in held:
            held[owner] += 1
        else:
            orphaned += 1
    quota = quotas(len(keys), held)
    return orphaned + sum(max(0, count - quota[m]) for m, count in held.items())


def moves(previous: Mapping[int, str] | None, current: Mapping[int, str]) -> int:
    """Partitions of ``current`` whose owner in ``previous`` exists and differs."""
    if previous is None:
        return 0
    return sum(1 for p, owner in current.items() if previous.get(p, owner) != owner)


def owner_counts(assignment: Mapping[int, str], members: Iterable[str]) -> dict[str, int]:
    """Partitions per member (0 for a member owning nothing) and per non-member owner."""
    counts = dict.fromkeys(members, 0)
    for owner in assignment.values():
        counts[owner] = counts.get(owner, 0) + 1
    return counts


def member_loads(
    assignment: Mapping[int, str], members: Iterable[str], loads: Mapping[int, float]
) -> dict[str, float]:
    """Summed partition load per member and non-member owner (missing loads count as 0)."""
    totals = dict.fromkeys(members, 0.0)
    for p, owner in assignment.items():
        totals[owner] = totals.get(owner, 0.0) + float(loads.get(p, 0.0))
    return totals


@dataclass(frozen=True)
class CountStats:
    """Min, max, mean, population standard deviation and max/mean of owner counts."""

    min: float | None
    max: float | None
    mean: float | None
    stddev: float | None
    max_over_mean: float | None
    skew: float

    @classmethod
    def of(cls, values: Sequence[float]) -> CountStats:
        if not values:
            return cls(None, None, None, None, None, 0)
        lo, hi = min(values), max(values)
        mean = statistics.fmean(values)
        std = statistics.pstdev(values)
        return cls(lo, hi, mean, std, hi / mean if mean > 0 else None, hi - lo)


def count_stats(counts: Mapping[str, float]) -> CountStats:
    return CountStats.of(list(counts.values()))


def churn_ratio(moved: int, minimum: int) -> float | None:
    """moves / min_moves; 1.0 when both are 0; None when only the minimum is 0."""
    if minimum == 0:
        return 1.0 if moved == 0 else None
    return moved / minimum


def percentile(values: Sequence[float], q: float) -> float | None:
    """Exact percentile with linear interpolation between closest ranks (q in 0..1), as
    numpy's default and Spark's ``percentile``; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
