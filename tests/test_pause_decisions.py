"""Pause and resume, decision by decision, without servers: the pause record, a runner's
pause (what it gives back, with which credits, and the gate it resumes behind), the
stall check, the autoscaler, and the operator's status, condition, Event messages and
the managed-fields manager who set spec.paused. tests/test_pause.py runs it all on real
servers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shoal.consumer.autoscaler import handlers_away_reason, paused_reason
from shoal.consumer.dispatch import Held
from shoal.consumer.metrics import Metrics
from shoal.consumer.partition import PartitionRunner, Phase
from shoal.consumer.worker import Worker
from shoal.contracts.names import Keys
from shoal.contracts.spec import parse_spec
from shoal.contracts.values import MemberStats, PauseRecord, ValueRefused
from shoal.group.config import GroupConfig
from shoal.operator.observe import (
    Observed,
    conditions,
    parse_time,
    pause_manager,
    pause_record,
    paused_message,
    resumed_message,
)

CONFIG = GroupConfig(group="g", namespace="ns", member_id="m-0", partitions=4)
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
RECORD = PauseRecord(by="kubectl-patch", time=T0, source="spec.paused")


# -- the record ---------------------------------------------------------------------------------


def test_the_pause_key_and_record() -> None:
    assert Keys("ns", "g").paused == "/shoal/ns/g/paused"
    assert PauseRecord.parse(RECORD.to_json()) == RECORD
    assert RECORD.describe() == "by kubectl-patch at 2026-01-01T00:00:00Z (spec.paused)"
    cli = PauseRecord(by="ann@host", time=T0, source="cli", reason="db upgrade")
    assert cli.describe().endswith("(cli): db upgrade")
    assert PauseRecord.parse(b"{}").describe() == "by someone at an unknown time"
    with pytest.raises(ValueRefused):
        PauseRecord.parse(b"not json")


def test_an_unreadable_pause_key_still_pauses() -> None:
    from shoal.clients.etcd import KV
    from shoal.group.view import GroupView

    keys = Keys("ns", "g")
    unused: Any = None
    view = GroupView(unused, keys, 4)
    assert view.paused() is None
    view.load(1, {keys.paused: KV(keys.paused, b"garbage", 1, 1, 0)})
    assert view.paused() == PauseRecord.unknown()
    view.load(2, {keys.paused: KV(keys.paused, RECORD.to_json(), 2, 2, 0)})
    assert view.paused() == RECORD


def test_spec_paused_defaults_to_false() -> None:
    assert parse_spec({"handler": "a.b:c"}).paused is False
    assert parse_spec({"handler": "a.b:c", "paused": True}).paused is True


# -- a runner's pause ---------------------------------------------------------------------------


class Membership:
    def safe(self) -> bool:
        return True


class FakeNats:
    """Records the naks a give-back sends: (subject, payload, as a request)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bool]] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.sent.append((subject, payload, False))

    async def request(self, subject: str, payload: bytes, timeout: float) -> None:
        self.sent.append((subject, payload, True))


class Msg:
    def __init__(self, seq: int, delivered: int = 1) -> None:
        self.reply = f"$JS.ACK.s.p2.{delivered}.{seq}.{seq}.0.0"


def make_runner() -> tuple[Worker, PartitionRunner, FakeNats]:
    unused: Any = None
    membership: Any = Membership()
    nc = FakeNats()
    nats: Any = nc
    worker = Worker(CONFIG, unused, unused, membership, nats, None, unused, Metrics())
    return worker, PartitionRunner(worker, 2, claim_revision=10, target_ts=None), nc


def hold(worker: Worker, runner: PartitionRunner, seq: int, project: str) -> Held:
    held = Held(Msg(seq), project, seq, 1, 0.0)
    runner.buffered += 1
    worker.buffered += 1
    worker.dispatcher.submit(runner, held)
    return held


def phase(r: PartitionRunner) -> Phase:
    return r.phase  # (read through a call: mypy would keep an earlier assert's narrowing)


def test_pausing_stops_what_starts_not_the_partition() -> None:
    _, r, _ = make_runner()
    r.pause()
    assert phase(r) is Phase.PAUSING and r.stopping and not r.letting_go
    r.pause()  # again: no move
    assert r._enter(Phase.PAUSED) and r.stopping and not r.letting_go
    assert r.waiting_on() == "nothing: the group is paused"
    r.stop()  # a paused partition can still be handed over
    assert phase(r) is Phase.STOPPING and r.letting_go
    r.pause()  # letting go: a pause changes nothing any more
    assert phase(r) is Phase.STOPPING


def test_a_paused_partition_has_no_work_for_the_stall_check() -> None:
    _, r, _ = make_runner()
    r.server_lag = 500
    assert r.has_work()
    r.pause()
    assert r.has_work()  # still pausing: its handlers are finishing
    r._enter(Phase.PAUSED)
    assert not r.has_work()


async def test_the_pause_gives_back_in_stream_order_with_credits_and_resumes_behind_them() -> None:
    worker, r, nc = make_runner()
    hold(worker, r, 12, "b")
    retried = hold(worker, r, 10, "a")
    retried.failures = 1  # failed once here: that attempt counts
    hold(worker, r, 11, "a")
    r._late.append(Msg(13))  # arrived from the pull open when the pause came
    r.pause()
    assert await r._give_back_paused() == 4
    assert [s.split(".")[5] for s, _, _ in nc.sent] == ["10", "11", "12", "13"]
    assert [payload for _, payload, _ in nc.sent] == [b"-NAK"] * 4
    assert [request for _, _, request in nc.sent] == [False, False, False, True]
    # A pause nak is no attempt; the failure in place is one.
    assert r.credits == {10: 0, 11: 1, 12: 1, 13: 1}
    assert r.projects == {} and r.buffered == 0 and worker.buffered == 0 and not r._late
    r._enter(Phase.PAUSED)
    worker.paused = False
    await r._resume()
    try:
        assert phase(r) is Phase.CONSUMING and not r.stopping
        assert r.gate is not None and r.gate.expected == frozenset({10, 11, 12, 13})
    finally:
        for task in list(worker._tasks):
            task.cancel()
        await asyncio.sleep(0)


async def test_what_cannot_be_given_back_is_kept_for_the_hand_over() -> None:
    worker, r, _ = make_runner()
    worker.nats_reachable = lambda: False
    hold(worker, r, 5, "a")
    r.pause()
    assert await r._give_back_paused() == 0
    assert [h.seq for h in r._unreturned] == [5] and r.credits == {}
    # Stopped while paused: the hand-over gives it back with the rest.
    assert [h.seq for h in r._unstarted(0.0)] == [5] and r._unreturned == []


# -- the autoscaler -----------------------------------------------------------------------------


def test_the_autoscaler_waits_while_paused() -> None:
    assert paused_reason(False, None) is None
    assert paused_reason(True, None) == "paused (spec.paused): no scaling until the group resumes"
    assert paused_reason(False, RECORD) == (
        "paused by kubectl-patch at 2026-01-01T00:00:00Z (spec.paused): no scaling until the "
        "group resumes"
    )


def test_the_autoscaler_waits_while_every_members_handler_is_away() -> None:
    away, able, python = (
        MemberStats(handler_ok=False),
        MemberStats(handler_ok=True),
        MemberStats(),  # a Python handler's member writes no handler_ok
    )
    assert handlers_away_reason({}) is None
    assert handlers_away_reason({"m-0": away, "m-1": away}) == (
        "every member's HTTP handler accepts no connection: no scaling until one does"
    )
    assert handlers_away_reason({"m-0": away, "m-1": able}) is None
    assert handlers_away_reason({"m-0": away, "m-1": python}) is None


# -- the operator -------------------------------------------------------------------------------


def entry(manager: str, when: str | None, paused: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {"f:replicas": {}}
    if paused:
        spec["f:paused"] = {}
    found: dict[str, Any] = {
        "manager": manager,
        "operation": "Update",
        "fieldsType": "FieldsV1",
        "fieldsV1": {"f:spec": spec},
    }
    if when is not None:
        found["time"] = when
    return found


def test_the_manager_of_the_latest_change_of_spec_paused() -> None:
    fields = [
        entry("kubectl-client-side-apply", "2026-01-01T00:00:00Z"),
        entry("kubectl-patch", "2026-01-01T00:05:00Z"),
        entry("shoal-consumer", "2026-01-01T00:09:00Z", paused=False),  # scaled, later
        {"manager": "kopf", "fieldsV1": {"f:status": {}}},
        "garbage",
    ]
    assert pause_manager(fields) == ("kubectl-patch", T0 + 300)
    assert pause_manager([entry("a", None), entry("b", None)]) == ("b", None)
    assert pause_manager([entry("a", "2026-01-01T00:00:01Z"), entry("b", None)]) == ("a", T0 + 1)
    assert pause_manager([entry("a", "x", paused=False)]) is None
    assert pause_manager(None) is None and pause_manager("x") is None
    assert parse_time("2026-01-01T00:00:00Z") == T0 and parse_time("yesterday") is None
    assert pause_record(fields, 5.0) == PauseRecord(
        by="kubectl-patch", time=T0 + 300, source="spec.paused"
    )
    assert pause_record([], 5.0) == PauseRecord(by="unknown", time=5.0, source="spec.paused")


def observed(**changes: Any) -> Observed:
    values: dict[str, Any] = {
        "generation": 4,
        "spec_replicas": 2,
        "replicas": 2,
        "ready_replicas": 2,
        "members": {"m-0": 2, "m-1": 2},
        "leader": "m-0",
        "assignment_generation": 3,
        "partitions": 4,
        "unowned": 0,
        "unclaimed": 0,
        "lag": 10,
    }
    values.update(changes)
    return Observed(**values)


def by_type(found: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in found}


def test_a_paused_group_says_so_in_its_status() -> None:
    running = by_type(conditions(observed()))
    assert (running["Paused"]["status"], running["Paused"]["reason"]) == ("False", "Running")
    assert running["Progressing"]["reason"] == "Stable"
    paused = by_type(conditions(observed(paused=RECORD)))
    # The Status column of `kubectl get cg` is the Progressing condition's reason.
    assert (paused["Progressing"]["status"], paused["Progressing"]["reason"]) == (
        "False",
        "Paused",
    )
    assert (paused["Paused"]["status"], paused["Paused"]["reason"]) == ("True", "SpecPaused")
    assert paused["Paused"]["message"] == paused_message(RECORD)
    assert "by kubectl-patch at 2026-01-01T00:00:00Z" in paused_message(RECORD)
    assert paused["Ready"]["status"] == "True"  # the members are fine: only paused
    # A stall is news even while paused (a paused partition never reports one).
    stalled = by_type(conditions(observed(paused=RECORD, stalled=((1, "m-1"),))))
    assert stalled["Progressing"]["reason"] == "PartitionsStalled"


def test_the_resumed_event_says_who_and_how_long() -> None:
    assert resumed_message("kubectl-patch", RECORD, T0 + 90) == (
        "Resumed by kubectl-patch after 90 s (paused by kubectl-patch at 2026-01-01T00:00:00Z "
        "(spec.paused)): members pull again"
    )


def test_a_pause_changes_nothing_in_the_pods() -> None:
    """spec.paused reaches the members through etcd: the Deployment the operator applies
    is the same byte for byte, so no pod restarts."""
    from shoal.operator.builders import build_deployment
    from shoal.operator.settings import settings_from_env

    settings = settings_from_env({"NATS_URL": "nats://nats:4222"})
    running = parse_spec({"handler": "a.b:c"})
    paused = parse_spec({"handler": "a.b:c", "paused": True})
    assert build_deployment("orders", "prod", paused, settings, None, None) == build_deployment(
        "orders", "prod", running, settings, None, None
    )
