"""The etcd values' schemas (shoal.contracts.values): what earlier code wrote still parses.

The old values below are byte for byte what the code before these models wrote
(election.py's json.dumps of the target; autoscaler.ScaleRecord.to_json), including the
targets of leaders from before `ts` existed.
"""

from __future__ import annotations

import pytest

from shoal.contracts.values import ScaleRecord, TargetValue, ValueRefused

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
