"""The etcd values' schemas (shoal.contracts.values): what earlier code wrote still parses.

The old values below are byte for byte what the code before these models wrote
(election.py's json.dumps of the target; autoscaler.ScaleRecord.to_json; runtime.py's
and worker.py's stats dicts), including the targets of leaders from before `ts` existed
and the stats of members from before stalls, loads and buffers were reported.
"""

from __future__ import annotations

import json

import pytest

from shoal.contracts.values import MemberStats, ScaleRecord, TargetValue, ValueRefused

OLD_TARGETS = {
    b'{"owner": "m-1", "generation": 7, "epoch": 3, "ts": 1795000000.25}': TargetValue(
        owner="m-1", generation=7, epoch=3, ts=1795000000.25
    ),
    b'{"owner": "m-0", "generation": 1, "epoch": 1}': TargetValue(
        owner="m-0", generation=1, epoch=1, ts=None
    ),
    # A newer writer's extra key is ignored.
    b'{"owner": "m-2", "generation": 2, "epoch": 5, "ts": 1, "weight": 3}': TargetValue(
        owner="m-2", generation=2, epoch=5, ts=1.0
    ),
}

OLD_SCALE_RECORDS = {
    b'{"time": 1795000000.5, "from": 2, "to": 3, "reason": "lag 9000", "dryRun": false, '
    b'"epoch": 7}': ScaleRecord(
        time=1795000000.5, from_replicas=2, to_replicas=3, reason="lag 9000", epoch=7
    ),
    # Records from before dryRun and epoch were written.
    b'{"time": 10, "from": 4, "to": 3, "reason": "idle"}': ScaleRecord(
        time=10.0, from_replicas=4, to_replicas=3, reason="idle"
    ),
}


@pytest.mark.parametrize("raw", OLD_TARGETS)
def test_targets_written_by_earlier_code_parse(raw: bytes) -> None:
    assert TargetValue.parse(raw) == OLD_TARGETS[raw]


def test_a_target_round_trips() -> None:
    target = TargetValue(owner="m-3", generation=12, epoch=4, ts=1795000001.5)
    assert TargetValue.parse(target.to_json()) == target


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"", "Invalid JSON"),
        (b"[]", "Input should be an object"),
        (b'{"generation": 1, "epoch": 1}', "owner: Field required"),
        (b'{"owner": "", "generation": 1, "epoch": 1}', "owner: String should have at least"),
        (b'{"owner": "m", "generation": "1", "epoch": 1}', "generation: Input should be a valid"),
        (b'{"owner": "m", "generation": 1.5, "epoch": 1}', "generation: Input should be a valid"),
        (b'{"owner": "m", "generation": 1, "epoch": null}', "epoch: Input should be a valid"),
    ],
)
def test_a_value_that_is_no_target_is_refused_with_the_reason(raw: bytes, why: str) -> None:
    with pytest.raises(ValueRefused, match=why):
        TargetValue.parse(raw)


@pytest.mark.parametrize("raw", OLD_SCALE_RECORDS)
def test_scale_records_written_by_earlier_code_parse(raw: bytes) -> None:
    assert ScaleRecord.parse(raw) == OLD_SCALE_RECORDS[raw]


def test_a_scale_record_keeps_its_json_keys() -> None:
    record = ScaleRecord(
        time=1.5, from_replicas=2, to_replicas=3, reason="cpu", dry_run=True, epoch=2
    )
    assert record.to_json() == (
        b'{"time":1.5,"from":2,"to":3,"reason":"cpu","dryRun":true,"epoch":2}'
    )
    for garbage in (b"{}", b'{"time": "x", "from": 1, "to": 2, "reason": ""}', b"null"):
        assert ScaleRecord.parse(garbage) is None


# -- member stats ------------------------------------------------------------------------

# What runtime.py and worker.py wrote before MemberStats (json.dumps(sort_keys=True) of
# their dicts): a member consuming, one that has not started its worker yet (no worker
# fields; cut from NATS), and one of a version from before stalls, loads and buffers.
OLD_STATS = [
    b'{"active_projects": 12, "buffered": 40, "cpu": 37.5, "inflight": 3, "lag": 120, '
    b'"nats_ok": true, "owned": [0, 5, 9], "partition_rates": {"0": 10.5, "9": 3.25}, '
    b'"pid": 4242, "rate": 13.75, "rss_mb": 61.2, "stalled": [5], "ts": 1795000000.125}',
    b'{"cpu": 0.0, "lag": 0, "nats_ok": false, "pid": 17, "rss_mb": 48.0, "ts": 1795000001.5}',
    b'{"active_projects": 3, "cpu": 5.0, "inflight": 0, "lag": 0, "owned": [1], "pid": 7, '
    b'"rate": 0.0, "rss_mb": 50.0, "ts": 1700000000.0}',
]


def test_member_stats_written_by_earlier_code_parse_and_are_written_back_alike() -> None:
    busy, starting, old = (MemberStats.parse(raw) for raw in OLD_STATS)
    assert busy.problems == {} and busy.scaling_problem() is None
    assert busy.owned == (0, 5, 9) and busy.stalled == (5,) and busy.nats_ok
    assert busy.partition_rates == {0: 10.5, 9: 3.25}
    # The writer writes what the old code wrote: old readers (a member of the previous
    # version, mid-upgrade) read the new values as before.
    assert busy.to_json() == OLD_STATS[0]
    assert not starting.nats_ok and starting.stalled == () and starting.partition_rates == {}
    assert starting.scaling_problem() == "no 'active_projects'"
    assert old.problems == {} and old.scaling_problem() is None and old.nats_ok


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("cpu", True, "valid number"),
        ("cpu", "5", "valid number"),
        ("cpu", 10_001, "less than or equal to 10000"),
        ("cpu", -1, "greater than or equal to 0"),
        ("ts", 0, "greater than 0"),
        ("lag", 5.0, "valid integer"),
        ("lag", -1, "greater than or equal to 0"),
        ("rate", False, "valid number"),
        ("owned", "0,1", "not a list of partitions"),
        ("owned", [0, "1"], "valid integer"),
        ("inflight", None, "valid integer"),
    ],
)
def test_a_broken_field_reads_as_its_default_and_says_why(
    field: str, value: object, why: str
) -> None:
    good = json.loads(OLD_STATS[0])
    stats = MemberStats.parse({**good, field: value})
    assert set(stats.problems) == {field}
    assert why in stats.problems[field] and repr(value) in stats.problems[field]
    assert stats.scaling_problem() == stats.problems[field]
    # The other fields still count: a broken cpu reading costs the leader nothing else.
    assert stats.stalled == (5,) and stats.partition_rates == {0: 10.5, 9: 3.25}


def test_nan_and_infinity_are_no_measurement() -> None:
    stats = MemberStats.parse(b'{"cpu": NaN, "ts": Infinity, "lag": 1, "active_projects": 0}')
    assert set(stats.problems) == {"cpu", "ts"} and "finite" in stats.problems["cpu"]


def test_bad_entries_of_stalls_and_loads_are_dropped_one_by_one() -> None:
    stats = MemberStats.parse(
        {
            "stalled": ["3", 3.0, None, True, -1, 7, [3]],
            "partition_rates": {"0": 1, "x": 5, "2": -1, "3": True, "4": "7", "5": 2.5},
            "nats_ok": "no",
        }
    )
    assert stats.stalled == (7,) and stats.partition_rates == {0: 1.0, 5: 2.5}
    # Only a literal false cuts a member off: a broken flag keeps it eligible.
    assert stats.nats_ok and set(stats.problems) == {"nats_ok"}


@pytest.mark.parametrize(
    ("raw", "why"),
    [(b"[1, 2]", "not a JSON object (list)"), (b"{", "not JSON"), (b"\xff", "not JSON")],
)
def test_a_value_that_is_no_stats_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(ValueRefused) as refused:
        MemberStats.parse(raw)
    assert why in str(refused.value)
