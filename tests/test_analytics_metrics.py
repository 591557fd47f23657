"""Analytics without Spark: the event model, the pure metrics, reading lines, the generator.

The minimum-moves rule is checked exhaustively on small cases against the assignor's own
min_moves and against brute force over every balanced assignment.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from shoal import assignor
from shoal.analytics import metrics
from shoal.analytics.export import group_log_stream, parse_since
from shoal.analytics.generate import HistorySpec, corrupt, history, write_history
from shoal.analytics.ingest import parse_file
from shoal.analytics.layout import PartWriter, input_files, is_hidden, relative_name
from shoal.contracts.events import AssignmentEvent, EventError, parse_event


def event(**overrides: object) -> AssignmentEvent:
    values: dict[str, object] = {
        "ts": 1_790_000_000.25,
        "namespace": "prod",
        "group": "orders",
        "generation": 3,
        "epoch": 7,
        "leader": "c-0",
        "reason": "join",
        "members": ["c-1", "c-0"],
        "assignment": {1: "c-1", 0: "c-0"},
        "moved": [(1, "c-0", "c-1")],
        "handover_ms": {1: 12.5},
        "loads": {0: 3.0, 1: 4.5},
    }
    values.update(overrides)
    return AssignmentEvent.of(**values)  # type: ignore[arg-type]


# -- the event model ----------------------------------------------------------------------


def test_event_round_trips_through_its_wire_form() -> None:
    ev = event()
    line = ev.to_json()
    assert "\n" not in line
    wire = json.loads(line)
    assert wire["schema"] == 1
    assert wire["ts"] == "2026-09-21T14:13:20.250Z"
    assert wire["members"] == ["c-0", "c-1"]
    assert wire["assignment"] == {"0": "c-0", "1": "c-1"}
    assert wire["moved"] == [{"partition": 1, "from": "c-0", "to": "c-1"}]
    assert wire["handover_ms"] == {"1": 12.5}
    assert wire["strategy"] == "sticky"
    assert parse_event(line) == ev
    assert parse_event(ev.to_bytes()) == ev


def test_handover_and_loads_are_optional_and_unknown_fields_ignored() -> None:
    wire = json.loads(event().to_json())
    del wire["handover_ms"], wire["loads"]
    wire["future_field"] = {"x": 1}
    parsed = parse_event(json.dumps(wire))
    assert parsed.handover_ms == {} and parsed.loads == {}


def test_time_stamps_are_utc() -> None:
    wire = json.loads(event().to_json())
    wire["ts"] = "2026-11-21T12:00:00+02:00"
    assert parse_event(json.dumps(wire)).ts == datetime(2026, 11, 21, 10, tzinfo=UTC)
    wire["ts"] = "2026-11-21T12:00:00"
    assert parse_event(json.dumps(wire)).ts == datetime(2026, 11, 21, 12, tzinfo=UTC)


@pytest.mark.parametrize(
    ("line", "kind", "says"),
    [
        (b"not json", "malformed", "not JSON"),
        (b'{"schema": 1, "ts": "2026-11', "malformed", "not JSON"),
        (b"[1, 2]", "malformed", "not a JSON object"),
        (b"\xff\xfe", "malformed", "not JSON"),
        (b'{"ts": "2026-11-21T00:00:00Z"}', "malformed", "no 'schema'"),
        (b'{"schema": 2, "whatever": true}', "unknown_schema", "schema 2"),
        (b'{"schema": "1"}', "unknown_schema", "schema '1'"),
        (b'{"schema": true}', "unknown_schema", "schema True"),
        (b'{"schema": 1, "ts": "2026-11-21T00:00:00Z"}', "malformed", "namespace"),
    ],
)
def test_bad_lines_say_what_is_wrong(line: bytes, kind: str, says: str) -> None:
    with pytest.raises(EventError) as caught:
        parse_event(line)
    assert caught.value.kind == kind
    assert says in caught.value.detail


@pytest.mark.parametrize(
    "overrides",
    [
        {"reason": "boredom"},
        {"strategy": "random"},
        {"generation": -1},
        {"handover_ms": {1: -5.0}},
        {"loads": {0: float("nan")}},
        {"assignment": {-1: "c-0"}},
        {"namespace": ""},
    ],
)
def test_the_model_refuses_invalid_values(overrides: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        event(**overrides)


def test_every_reason_and_strategy_of_the_contract_is_accepted() -> None:
    for reason in ("initial", "join", "leave", "scale", "failover", "rebalance"):
        for strategy in ("sticky", "modulo"):
            assert event(reason=reason, strategy=strategy).reason == reason


# -- pure metrics -------------------------------------------------------------------------


def brute_force_min_moves(partitions: int, members: list[str], previous: Mapping[int, str]) -> int:
    """Independent of both min_moves: the fewest moves over every balanced assignment."""
    best = partitions + 1
    for owners in itertools.product(members, repeat=partitions):
        counts = [owners.count(m) for m in members]
        if max(counts) - min(counts) > 1:
            continue
        moves = sum(1 for p, owner in enumerate(owners) if previous.get(p) not in (None, owner))
        best = min(best, moves)
    return best


def all_previous(partitions: int, owners: list[str | None]) -> list[dict[int, str]]:
    out = []
    for combo in itertools.product(owners, repeat=partitions):
        out.append({p: o for p, o in enumerate(combo) if o is not None})
    return out


def test_min_moves_agrees_with_the_assignor_exhaustively() -> None:
    names = ["a", "b", "c", "d"]
    subsets = [list(s) for n in range(1, 5) for s in itertools.combinations(names, n)]
    checked = 0
    for partitions in range(1, 6):
        for previous in all_previous(partitions, ["a", "b", "c", "e", None]):
            for members in subsets:
                ours = metrics.min_moves(range(partitions), members, previous)
                assert ours == assignor.min_moves(partitions, members, previous), (
                    partitions,
                    members,
                    previous,
                )
                checked += 1
    assert checked > 40_000


def test_min_moves_is_what_the_best_balanced_assignment_achieves() -> None:
    for partitions in range(1, 5):
        for previous in all_previous(partitions, ["a", "b", "x", None]):
            for members in (["a"], ["a", "b"], ["a", "c"], ["a", "b", "c"], ["c", "d"]):
                expected = brute_force_min_moves(partitions, members, previous)
                assert metrics.min_moves(range(partitions), members, previous) == expected


def test_min_moves_edge_cases() -> None:
    assert metrics.min_moves(range(8), ["a"], None) == 0  # a group's first generation
    assert metrics.min_moves(range(8), [], {0: "a"}) == 0  # nobody to move to
    assert metrics.min_moves([], ["a"], {0: "a"}) == 0  # nothing to place
    # 7 partitions, a and b held 3 each: their +1 quotas (2, 2, 2, 1) leave 1 excess each.
    previous = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "b", 6: "c"}
    assert metrics.min_moves(range(7), ["a", "b", "c", "d"], previous) == 2
    # Partitions named other than 0..P-1 (a partial log) count by position.
    assert metrics.min_moves([10, 11, 12], ["a", "b"], {10: "a", 11: "a", 12: "a"}) == 1


def test_moves_counts_only_partitions_that_had_another_owner() -> None:
    assert metrics.moves(None, {0: "a"}) == 0
    assert metrics.moves({0: "a", 1: "a"}, {0: "b", 1: "a", 2: "c"}) == 1
    assert metrics.moves({0: "a", 1: "a"}, {0: "a"}) == 0


def test_owner_counts_and_loads_include_members_without_partitions_and_outsiders() -> None:
    assignment = {0: "a", 1: "a", 2: "gone"}
    assert metrics.owner_counts(assignment, ["a", "b"]) == {"a": 2, "b": 0, "gone": 1}
    loads = metrics.member_loads(assignment, ["a", "b"], {0: 1.5, 2: 2.0, 7: 9.0})
    assert loads == {"a": 1.5, "b": 0.0, "gone": 2.0}
    stats = metrics.count_stats({"a": 2, "b": 0, "gone": 1})
    assert (stats.min, stats.max, stats.skew, stats.mean) == (0, 2, 2, 1.0)
    assert stats.max_over_mean == 2.0
    assert stats.stddev == pytest.approx(np.std([2, 0, 1]))
    empty = metrics.count_stats({})
    assert empty.skew == 0 and empty.min is None and empty.max_over_mean is None


def test_churn_ratio() -> None:
    assert metrics.churn_ratio(0, 0) == 1.0
    assert metrics.churn_ratio(32, 32) == 1.0
    assert metrics.churn_ratio(96, 32) == 3.0
    assert metrics.churn_ratio(3, 0) is None


def test_percentile_is_numpys_linear_interpolation() -> None:
    rng = random.Random(4)
    for n in (1, 2, 3, 10, 101):
        values = [rng.uniform(0, 1000) for _ in range(n)]
        for q in (0.0, 0.5, 0.9, 0.99, 1.0):
            assert metrics.percentile(values, q) == pytest.approx(np.percentile(values, q * 100))
    assert metrics.percentile([], 0.5) is None


# -- reading files ------------------------------------------------------------------------


def test_parse_file_keeps_line_numbers_and_skips_blank_lines() -> None:
    good = event().to_bytes()
    rows = list(parse_file("x.jsonl", b"\n".join([good, b"", b"  ", b"nope", good + b"\r"])))
    assert [(r["line"], r["kind"]) for r in rows] == [(1, None), (4, "malformed"), (5, None)]
    first = rows[0]
    assert first["parts"] == [0, 1] and first["owners"] == ["c-0", "c-1"]
    assert first["loads"] == [3.0, 4.5] and first["has_loads"] is True
    assert first["handover"] == [12.5] and first["moved_recorded"] == 1
    assert first["ts_us"] == 1_790_000_000_250_000


def test_readers_skip_what_spark_skips(tmp_path: Path) -> None:
    for name in [
        "date=2026-11-02/part-b.jsonl",
        "date=2026-11-01/part-a.jsonl",
        "date=2026-11-01/.part-c.jsonl.tmp",
        "_temporary/x.jsonl",
        ".hidden.jsonl",
        "_col=1/kept.jsonl",
        "other.json",
    ]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    found = [p.relative_to(tmp_path).as_posix() for p in input_files(tmp_path)]
    assert found == [
        "_col=1/kept.jsonl",
        "date=2026-11-01/part-a.jsonl",
        "date=2026-11-02/part-b.jsonl",
    ]
    assert is_hidden("a/.b/c.jsonl") and not is_hidden("a/b/c.jsonl")
    assert relative_name(str(tmp_path), str(tmp_path / "a" / "b.jsonl")) == "a/b.jsonl"


def test_part_writer_rotates_by_date_and_size(tmp_path: Path) -> None:
    day1, day2 = datetime(2026, 11, 1).date(), datetime(2026, 11, 2).date()
    with PartWriter(tmp_path, "ns.g", max_lines=2) as writer:
        for seq, day in enumerate([day1, day1, day1, day2], start=10):
            writer.write(day, seq, f'{{"n": {seq}}}'.encode())
    names = [p.relative_to(tmp_path).as_posix() for p in writer.files]
    assert names == [
        "date=2026-11-01/part-ns.g-000000000010.jsonl",
        "date=2026-11-01/part-ns.g-000000000012.jsonl",
        "date=2026-11-02/part-ns.g-000000000013.jsonl",
    ]
    assert (tmp_path / names[0]).read_text() == '{"n": 10}\n{"n": 11}\n'
    assert not list(tmp_path.rglob(".*"))


def test_since_accepts_times_dates_and_durations() -> None:
    now = datetime(2026, 11, 21, 12, tzinfo=UTC)
    assert parse_since("24h", now) == now - timedelta(days=1)
    assert parse_since("30m", now) == now - timedelta(minutes=30)
    assert parse_since("2026-11-20", now) == datetime(2026, 11, 20, tzinfo=UTC)
    assert parse_since("2026-11-20T10:00:00Z", now) == datetime(2026, 11, 20, 10, tzinfo=UTC)
    with pytest.raises(ValueError, match="RFC 3339"):
        parse_since("last tuesday", now)
    assert group_log_stream("prod", "orders") == "shoal_prod_orders_log"
    assert group_log_stream("prod", "orders", "custom") == "custom_log"


# -- the generator ------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["sticky", "modulo"])
def test_generated_histories_are_valid_and_follow_the_assignor(strategy: str) -> None:
    spec = HistorySpec(strategy=strategy, generations=150, seed=3, empty_weight=3)
    events = list(history(spec))
    assert [e.generation for e in events] == list(range(1, 151))
    reasons = {e.reason for e in events}
    assert {"initial", "join", "leave", "scale", "failover"} <= reasons
    previous: dict[int, str] | None = None
    extra = 0
    for ev in events:
        assert parse_event(ev.to_json()) == ev
        assert sorted(ev.handover_ms) == sorted(m.partition for m in ev.moved)
        if ev.members:
            assert set(ev.assignment.values()) <= set(ev.members)
            assert len(ev.loads) == spec.partitions
        moves = metrics.moves(previous, ev.assignment)
        assert moves == len(ev.moved)
        minimum = metrics.min_moves(ev.assignment, ev.members, previous)
        if strategy == "sticky" and ev.reason != "rebalance":
            assert moves == minimum, ev.generation
        extra += moves - minimum
        previous = ev.assignment if ev.assignment else None
    if strategy == "modulo":
        assert extra > 1000  # modulo reshuffles far beyond the minimum
    assert any(not e.members for e in events)  # the group emptied at least once


def test_corrupt_mixes_in_each_kind_of_bad_line(tmp_path: Path) -> None:
    events = list(history(HistorySpec(generations=30, seed=1)))
    lines = [e.to_bytes() for e in events]
    bad = corrupt(lines, random.Random(2), malformed=7, unknown_schema=2, out_of_order=3)
    assert len(bad) == len(lines) + 12
    assert bad[0] == lines[0]
    kinds: dict[str | None, int] = {}
    for row in parse_file("x", b"\n".join(bad)):
        kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
    assert kinds == {None: 33, "malformed": 7, "unknown_schema": 2}
    count, files = write_history(events, tmp_path, bad={"out_of_order": 2}, max_lines=10)
    assert count == 32 and len(files) == 4
