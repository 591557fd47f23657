"""The stall check (progress.py) and the leader's moves of stalled partitions
(assignor.relieve_stalls): pure logic, exhaustive where it is small."""

from __future__ import annotations

import itertools
import random

from shoal.assignor import assign, owner_counts, relieve_stalls
from shoal.consumer.progress import Change, Progress


def test_work_without_progress_stalls_once_then_recovers() -> None:
    p = Progress()
    assert p.observe((0, 0, 0), True, 100.0, 60) is None
    assert p.observe((0, 0, 0), True, 159.0, 60) is None
    assert p.observe((0, 0, 0), True, 160.0, 60) is Change.STALLED
    assert p.stalled_for(170.0) == 70.0
    # Said once per episode.
    assert p.observe((0, 0, 0), True, 200.0, 60) is None
    assert p.observe((0, 1, 0), True, 201.0, 60) is Change.RECOVERED
    assert p.stalled_for(201.0) == 0.0
    assert p.observe((0, 1, 0), True, 230.0, 60) is None


def test_no_work_is_never_a_stall() -> None:
    p = Progress()
    for t in range(0, 1000, 10):
        assert p.observe((0, 0, 0), False, float(t), 60) is None
    # Work appears: the clock starts then, not at the last progress long ago.
    assert p.observe((0, 0, 0), True, 1000.0, 60) is None
    assert p.observe((0, 0, 0), True, 1059.0, 60) is None
    assert p.observe((0, 0, 0), True, 1060.0, 60) is Change.STALLED
    # Work gone (drained by someone else, say): not stalled any more.
    assert p.observe((0, 0, 0), False, 1061.0, 60) is Change.RECOVERED


def test_steady_progress_never_stalls() -> None:
    p = Progress()
    for t in range(1000):
        assert p.observe((t, t // 3, t), True, float(t * 30), 60) is None


def balanced(assignment: dict[int, str], members: list[str]) -> int:
    counts = owner_counts(assignment, members)
    return max(counts.values()) - min(counts.values())


def test_a_stalled_partition_moves_away_and_balance_holds() -> None:
    rng = random.Random(7)
    for n in range(1, 6):
        members = [f"m{i}" for i in range(n)]
        for partitions in (1, 2, 5, 16, 128):
            base = assign(partitions, members)
            for _ in range(20):
                stalled: dict[str, list[int]] = {}
                for p, owner in base.items():
                    if rng.random() < 0.2:
                        stalled.setdefault(owner, []).append(p)
                result = relieve_stalls(base, stalled, members)
                assert set(result) == set(base)
                assert set(result.values()) <= set(members)
                if n > 1:
                    for owner, ps in stalled.items():
                        for p in ps:
                            assert result[p] != owner, (n, partitions, p)
                # Owner counts as they were (swaps) while every member had a partition
                # nobody reports stalled to give back.
                reported = {p for ps in stalled.values() for p in ps}
                if all(any(base[p] == m and p not in reported for p in base) for m in members):
                    assert balanced(result, members) == balanced(base, members)


def test_stale_reports_and_lone_members_change_nothing() -> None:
    base = assign(8, ["a", "b"])
    # "a" reports partitions it no longer owns: old news.
    not_a = [p for p, m in base.items() if m != "a"]
    assert relieve_stalls(base, {"a": not_a}, ["a", "b"]) == base
    only = assign(8, ["a"])
    assert relieve_stalls(only, {"a": [0, 1]}, ["a"]) == only


def test_swaps_give_back_partitions_nobody_reports() -> None:
    members = ["a", "b", "c"]
    base = assign(12, members)
    for a_count, b_count in itertools.product(range(3), repeat=2):
        a_ps = sorted(p for p, m in base.items() if m == "a")[:a_count]
        b_ps = sorted(p for p, m in base.items() if m == "b")[:b_count]
        stalled = {"a": a_ps, "b": b_ps}
        result = relieve_stalls(base, stalled, members)
        reported = set(a_ps) | set(b_ps)
        for p in reported:
            assert result[p] != base[p]
        # What came back in exchange was not itself reported stalled.
        for p, owner in result.items():
            if owner != base[p] and p not in reported:
                assert p not in reported
        assert balanced(result, members) == balanced(base, members)
