"""Exhaustive tests of the pure assignment logic (no I/O).

The properties are the DESIGN.md contract: complete and valid ownership, owner counts
within 1, the fewest moves any balanced assignment allows, member order irrelevant,
deterministic; plus the load-aware mode and the modulo baseline.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.assignor import (
    assign,
    default_max_moves,
    member_loads,
    min_moves,
    moved,
    owner_counts,
    quotas,
    skew,
)

PARTITION_CHOICES = (1, 2, 7, 64, 128, 256)


def member_id(counter: int) -> str:
    # Ids whose sort order is unrelated to join order, so the id tie-breaks are
    # exercised in every position (unique for counter < 10007).
    return f"m{(counter * 7919) % 10007:05d}"


def check_valid(partitions: int, members: Sequence[str], assignment: Mapping[int, str]) -> None:
    assert list(assignment) == list(range(partitions))  # complete, in partition order
    assert set(assignment.values()) <= set(members)
    counts = owner_counts(assignment, members)
    assert set(counts) == set(members)
    assert sum(counts.values()) == partitions
    assert max(counts.values()) - min(counts.values()) <= 1
    assert skew(assignment, members) <= 1
    base = partitions // len(set(members))
    assert all(c in (base, base + 1) for c in counts.values())


def brute_force_min_moves(
    partitions: int, members: Sequence[str], previous: Mapping[int, str]
) -> int:
    """Independent of min_moves: try every way of handing out the +1 quotas and keep
    the one under which members keep the most of what they held."""
    ms = sorted(set(members))
    base, extra = divmod(partitions, len(ms))
    held = {m: 0 for m in ms}
    owned_before = 0
    for p in range(partitions):
        owner = previous.get(p)
        if owner is not None:
            owned_before += 1
            if owner in held:
                held[owner] += 1
    best_kept = max(
        sum(min(held[m], base + (1 if m in plus else 0)) for m in ms)
        for plus in map(set, itertools.combinations(ms, extra))
    )
    return owned_before - best_kept


def brute_force_full(partitions: int, members: Sequence[str], previous: Mapping[int, str]) -> int:
    """Fully independent: enumerate every balanced assignment (tiny sizes only)."""
    ms = sorted(set(members))
    best = partitions + 1
    for owners in itertools.product(ms, repeat=partitions):
        counts = [owners.count(m) for m in ms]
        if max(counts) - min(counts) > 1:
            continue
        moves = sum(
            1 for p in range(partitions) if previous.get(p) is not None and previous[p] != owners[p]
        )
        best = min(best, moves)
    return best


# --------------------------------------------------------------------------- histories


@st.composite
def histories(draw: st.DrawFn) -> tuple[int, list[str], list[tuple[str, list[str]]], int]:
    """P, the initial members, a list of (step kind, members after the step), a seed."""
    partitions = draw(st.sampled_from(PARTITION_CHOICES))
    counter = itertools.count()
    members = [member_id(next(counter)) for _ in range(draw(st.integers(1, 40)))]
    initial = list(members)
    steps: list[tuple[str, list[str]]] = []
    for kind, index in draw(
        st.lists(
            st.tuples(st.sampled_from(["join", "leave", "replace", "same"]), st.integers(0, 99)),
            max_size=12,
        )
    ):
        if kind in ("leave", "replace") and len(members) == 1:
            kind = "replace" if kind == "replace" else "join"
        if kind == "join" and len(members) >= 40:
            kind = "leave"
        if kind == "join":
            members = [*members, member_id(next(counter))]
        elif kind == "leave":
            members = [m for i, m in enumerate(members) if i != index % len(members)]
        elif kind == "replace":
            gone = index % len(members)
            members = [m for i, m in enumerate(members) if i != gone]
            members.append(member_id(next(counter)))
        steps.append((kind, list(members)))
    return partitions, initial, steps, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories())
def test_membership_histories(
    history: tuple[int, list[str], list[tuple[str, list[str]]], int],
) -> None:
    partitions, initial, steps, seed = history
    rng = random.Random(seed)
    current = assign(partitions, initial)
    check_valid(partitions, initial, current)
    before = list(initial)
    for kind, members in steps:
        shuffled = list(members)
        rng.shuffle(shuffled)
        nxt = assign(partitions, shuffled, current)
        check_valid(partitions, members, nxt)
        # Member order and duplicates are irrelevant; same input, same output.
        assert assign(partitions, sorted(members), current) == nxt
        assert assign(partitions, [*shuffled, *shuffled[:3]], current) == nxt
        assert assign(partitions, members, dict(current)) == nxt
        moves = moved(current, nxt)
        assert len(moves) == min_moves(partitions, members, current)
        n = len(members)
        if kind == "join":
            newcomer = (set(members) - set(before)).pop()
            got = owner_counts(nxt, members)[newcomer]
            # A join moves exactly the newcomer's share, which is P // n.
            assert got == partitions // n
            assert len(moves) == got
            assert {to for _, _, to in moves} <= {newcomer}
        elif kind == "leave":
            leaver = (set(before) - set(members)).pop()
            had = owner_counts(current, before)[leaver]
            assert len(moves) == had
            assert {frm for _, frm, _ in moves} <= {leaver}
        elif kind == "same":
            assert moves == []
            assert nxt == current
        current, before = nxt, members


@settings(max_examples=200, deadline=None)
@given(
    partitions=st.sampled_from(PARTITION_CHOICES),
    n=st.integers(1, 40),
    data=st.data(),
)
def test_arbitrary_previous(partitions: int, n: int, data: st.DataObject) -> None:
    """Previous assignments that no history produces: unbalanced, stale owners,
    out-of-range and missing partitions."""
    members = [member_id(i) for i in range(n)]
    owners = [*members[: data.draw(st.integers(1, n))], "gone-1", "gone-2"]
    previous = data.draw(
        st.dictionaries(
            st.integers(-3, partitions + 3), st.sampled_from(owners), max_size=partitions + 6
        )
    )
    result = assign(partitions, members, previous)
    check_valid(partitions, members, result)
    moves = moved(previous, result)
    assert len(moves) == min_moves(partitions, members, previous)
    if math.comb(n, partitions % n) <= 2000:
        assert len(moves) == brute_force_min_moves(partitions, members, previous)
    # Only partitions that had an in-range owner can move.
    assert all(0 <= p < partitions and p in previous for p, _, _ in moves)
    # Idempotent: a balanced result is its own fixed point.
    assert assign(partitions, list(reversed(members)), result) == result


# --------------------------------------------------------------------------- exhaustive


@pytest.mark.parametrize("partitions", range(1, 13))
def test_exhaustive_small_transitions(partitions: int) -> None:
    for n in range(1, 7):
        members = [member_id(i) for i in range(n)]
        start = assign(partitions, members)
        check_valid(partitions, members, start)
        assert min_moves(partitions, members, start) == 0
        assert assign(partitions, members, start) == start
        # Every join (the newcomer can sort anywhere) ...
        for newcomer in ("a", "m", "z"):
            after = [*members, newcomer]
            nxt = assign(partitions, after, start)
            check_valid(partitions, after, nxt)
            moves = moved(start, nxt)
            assert len(moves) == owner_counts(nxt, after)[newcomer] == partitions // (n + 1)
            assert len(moves) == min_moves(partitions, after, start)
        # ... every leave ...
        for leaver in members if n > 1 else []:
            after = [m for m in members if m != leaver]
            nxt = assign(partitions, after, start)
            check_valid(partitions, after, nxt)
            moves = moved(start, nxt)
            assert len(moves) == owner_counts(start, members)[leaver]
            assert len(moves) == min_moves(partitions, after, start)
            # ... and every replacement.
            replaced = [*after, "new"]
            nxt = assign(partitions, replaced, start)
            check_valid(partitions, replaced, nxt)
            assert len(moved(start, nxt)) == min_moves(partitions, replaced, start)


def test_min_moves_matches_full_enumeration() -> None:
    """Against every balanced assignment there is, for tiny P and n."""
    rng = random.Random(1234)
    for partitions in range(1, 6):
        for n in range(1, 4):
            members = [member_id(i) for i in range(n)]
            owners = [*members, "gone", None]
            for _ in range(12):
                previous = {
                    p: o for p in range(partitions) if (o := rng.choice(owners)) is not None
                }
                expected = brute_force_full(partitions, members, previous)
                assert min_moves(partitions, members, previous) == expected
                assert len(moved(previous, assign(partitions, members, previous))) == expected


# --------------------------------------------------------------------------- specifics


def test_join_and_leave_at_128() -> None:
    three = ["a", "b", "c"]
    start = assign(128, three)
    assert owner_counts(start, three) == {"a": 43, "b": 43, "c": 42}
    joined = assign(128, [*three, "d"], start)
    assert len(moved(start, joined)) == 32
    assert owner_counts(joined, [*three, "d"]) == {"a": 32, "b": 32, "c": 32, "d": 32}
    left = assign(128, ["a", "c", "d"], joined)
    assert len(moved(joined, left)) == 32
    assert all(frm == "b" for _, frm, _ in moved(joined, left))


def test_more_members_than_partitions() -> None:
    members = [member_id(i) for i in range(10)]
    result = assign(7, members)
    counts = owner_counts(result, members)
    assert sorted(counts.values()) == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    # An idle member joining or leaving moves nothing.
    idle = next(m for m, c in counts.items() if c == 0)
    assert moved(result, assign(7, [m for m in members if m != idle], result)) == []
    assert moved(result, assign(7, [*members, "zz"], result)) == []


def test_initial_placement_is_not_a_move() -> None:
    # Partitions 3..7 were never owned: placing them costs no hand-over.
    previous = {0: "a", 1: "a", 2: "b"}
    result = assign(8, ["a", "b"], previous)
    check_valid(8, ["a", "b"], result)
    assert moved(previous, result) == []
    assert min_moves(8, ["a", "b"], {}) == 0
    assert min_moves(8, ["a", "b"], previous) == 0


def test_keeps_lowest_and_plus_one_goes_to_largest_holder() -> None:
    previous = {p: "b" for p in range(5)} | {5: "a"}
    # P=6, 2 members: quotas 3/3; b keeps 0,1,2 and frees 3,4 to a.
    result = assign(6, ["b", "a"], previous)
    assert result == {0: "b", 1: "b", 2: "b", 3: "a", 4: "a", 5: "a"}
    assert moved(previous, result) == [(3, "b", "a"), (4, "b", "a")]
    # P=7 with a holding 1 and b holding 5: the +1 goes to b (holds most), not to "a".
    previous7 = {p: "b" for p in range(5)} | {5: "a"}
    assert quotas(7, ["a", "b"], previous7) == {"a": 3, "b": 4}
    assert min_moves(7, ["a", "b"], previous7) == 1


def test_stale_owners_and_out_of_range_are_ignored() -> None:
    previous = {0: "gone", 1: "a", 2: "b", 99: "a", -1: "b"}
    result = assign(3, ["a", "b"], previous)
    check_valid(3, ["a", "b"], result)
    assert result[1] == "a" and result[2] == "b"
    assert moved(previous, result) == [(0, "gone", result[0])]
    assert min_moves(3, ["a", "b"], previous) == 1


def test_helpers() -> None:
    a = {0: "x", 1: "x", 2: "y"}
    b = {0: "x", 1: "y", 2: "z", 3: "x"}
    assert moved(a, b) == [(1, "x", "y"), (2, "y", "z")]
    assert moved({}, b) == []
    assert moved(a, {}) == []
    assert owner_counts(a, ["x", "y", "w"]) == {"w": 0, "x": 2, "y": 1}
    # An owner that is no longer a member is still counted.
    assert owner_counts(a, ["y"]) == {"x": 2, "y": 1}
    assert skew(a, ["x", "y", "w"]) == 2
    assert skew({}, []) == 0
    assert member_loads(a, {0: 1.5, 2: 4.0, 7: 100.0}) == {"x": 1.5, "y": 4.0}
    assert default_max_moves(128, 4) == 8
    assert default_max_moves(128, 64) == 1


def test_errors() -> None:
    with pytest.raises(ValueError, match="empty member set"):
        assign(128, [])
    with pytest.raises(ValueError, match="empty member set"):
        min_moves(128, [], {})
    with pytest.raises(ValueError, match="partitions must be >= 1"):
        assign(0, ["a"])
    with pytest.raises(ValueError, match="partitions must be >= 1"):
        assign(-5, ["a"])
    with pytest.raises(ValueError, match="unknown strategy"):
        assign(8, ["a"], strategy="random")
    with pytest.raises(ValueError, match="member ids"):
        assign(8, ["a", ""])
    with pytest.raises(TypeError):
        assign(8, "abc")
    with pytest.raises(ValueError, match="max_moves"):
        assign(8, ["a", "b"], loads={0: 1.0}, max_moves=-1)
    with pytest.raises(ValueError, match="load of partition"):
        assign(8, ["a", "b"], loads={0: -1.0})
    with pytest.raises(ValueError, match="load of partition"):
        assign(8, ["a", "b"], loads={0: float("nan")})
    with pytest.raises(ValueError, match="modulo"):
        assign(8, ["a"], strategy="modulo", loads={0: 1.0})


# --------------------------------------------------------------------------- modulo


@pytest.mark.parametrize("newcomer", ["a", "c", "e", "z"])
def test_modulo_moves_far_more_on_join(newcomer: str) -> None:
    three = ["b", "d", "f"]
    four = [*three, newcomer]
    mod_before = assign(128, three, strategy="modulo")
    mod_after = assign(128, four, mod_before, strategy="modulo")
    check_valid(128, four, mod_after)
    assert mod_after == {p: sorted(four)[p % 4] for p in range(128)}
    sticky_before = assign(128, three)
    sticky_moves = len(moved(sticky_before, assign(128, four, sticky_before)))
    modulo_moves = len(moved(mod_before, mod_after))
    assert sticky_moves == 32
    # 95..98 of 128 (74-77%, depending on where the newcomer sorts): about 3x sticky.
    assert modulo_moves >= 95
    assert modulo_moves >= 0.74 * 128
    assert modulo_moves > 2.9 * sticky_moves


def test_modulo_ignores_previous() -> None:
    previous = assign(16, ["a", "b"])
    assert assign(16, ["b", "a"], previous, strategy="modulo") == assign(
        16, ["a", "b"], strategy="modulo"
    )


# --------------------------------------------------------------------------- loads


@settings(max_examples=150, deadline=None)
@given(
    partitions=st.sampled_from(PARTITION_CHOICES),
    n=st.integers(1, 40),
    max_moves=st.one_of(st.none(), st.integers(0, 40)),
    data=st.data(),
)
def test_loads_mode(partitions: int, n: int, max_moves: int | None, data: st.DataObject) -> None:
    members = [member_id(i) for i in range(n)]
    previous_members = members[: data.draw(st.integers(1, n))]
    previous = assign(partitions, previous_members)
    # Integral loads keep every sum exact, so "never increases" is checked exactly.
    loads = data.draw(
        st.dictionaries(
            st.integers(0, partitions - 1),
            st.integers(0, 10**6).map(float),
            max_size=partitions,
        )
    )
    sticky = assign(partitions, members, previous)
    result = assign(partitions, members, previous, loads=loads, max_moves=max_moves)
    # Same input, same output; member order irrelevant.
    shuffled = list(members)
    data.draw(st.randoms(use_true_random=False)).shuffle(shuffled)
    assert assign(partitions, shuffled, previous, loads=loads, max_moves=max_moves) == result
    assert list(result) == list(range(partitions))
    assert set(result.values()) <= set(members)
    budget = default_max_moves(partitions, n) if max_moves is None else max_moves
    # Extra hand-overs beyond the sticky minimum are bounded by max_moves.
    assert len(moved(previous, result)) <= len(moved(previous, sticky)) + budget
    assert len(moved(sticky, result)) <= budget

    def peak(assignment: Mapping[int, str]) -> float:
        return max(member_loads(assignment, loads).values(), default=0.0)

    assert peak(result) <= peak(sticky)
    if not loads or max_moves == 0:
        assert result == sticky


def test_hot_partition() -> None:
    # One hot partition: the sticky start puts 0..3 (load 103) on "a" and 4..7 (4) on
    # "b"; relieving "a" means moving its cold partitions away, not the hot one.
    loads = {0: 100.0} | {p: 1.0 for p in range(1, 8)}
    sticky = assign(8, ["a", "b"])
    assert member_loads(sticky, loads) == {"a": 103.0, "b": 4.0}
    result = assign(8, ["a", "b"], sticky, loads=loads, max_moves=10)
    assert result[0] == "a"
    assert member_loads(result, loads) == {"a": 100.0, "b": 7.0}
    assert len(moved(sticky, result)) == 3
    # The default budget at P=8, n=2 is one move: still an improvement.
    one = assign(8, ["a", "b"], sticky, loads=loads)
    assert len(moved(sticky, one)) == default_max_moves(8, 2) == 1
    assert member_loads(one, loads)["a"] == 102.0


def test_loads_balance_two_hot_partitions() -> None:
    # Both hot partitions start on "a"; one move puts one on each member.
    loads = {0: 50.0, 1: 50.0}
    sticky = assign(8, ["a", "b"])
    result = assign(8, ["a", "b"], sticky, loads=loads, max_moves=1)
    assert member_loads(result, loads) == {"a": 50.0, "b": 50.0}
    assert moved(sticky, result) == [(0, "a", "b")] or moved(sticky, result) == [(1, "a", "b")]


def test_loads_prefer_partitions_moving_anyway() -> None:
    # "x" leaves; sticky gives its 6, 7 to "a" and 8 to "b". The load sits on "a"; among
    # equally good moves the greedy step takes the orphans 6 and 7, whose hand-over is
    # happening anyway, so load balancing adds no hand-over at all.
    previous = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "b", 6: "x", 7: "x", 8: "x"}
    sticky = assign(9, ["a", "b"], previous)
    assert sticky == previous | {6: "a", 7: "a", 8: "b"}
    loads = {p: 1.0 for p in (0, 1, 2, 6, 7)}
    result = assign(9, ["a", "b"], previous, loads=loads, max_moves=5)
    assert moved(sticky, result) == [(6, "a", "b"), (7, "a", "b")]
    assert member_loads(result, loads) == {"a": 3.0, "b": 2.0}
    assert len(moved(previous, result)) == len(moved(previous, sticky)) == 3


def test_uniform_loads_move_nothing() -> None:
    previous = assign(12, ["a", "b"])
    sticky = assign(12, ["a", "b", "c"], previous)
    loads = {p: 1.0 for p in range(12)}
    assert assign(12, ["a", "b", "c"], previous, loads=loads, max_moves=5) == sticky
