"""The operator shows stalled partitions: status, conditions and one Event per episode.

The operator's status timer (reconciler.observe_group) runs as kopf would call it, against
the session's real etcd (and, in the last test, real nats-server and member processes);
only Kubernetes is a fake (the Deployment's status, and kopf's Events recorded).

1. Member keys written by hand, garbage included: what the status and Events say, episode
   by episode, and that an etcd outage ends no episode.
2. A real stall (tests/test_stall_moves.py's: one project's handler hangs on one member):
   from the member's own report through etcd to the operator's status and Events.
3. A member NATS refuses (its problems/ key, written by hand, garbage beside it): Degraded
   with its reason naming the member, one Warning per episode, across an operator restart,
   also while another problem outranks the refusals in Degraded (status.refusedMembers);
   etcd's NOSPACE alarm likewise (one EtcdNoSpace Warning across restarts).
   (tests/test_refusal_report.py has real refused members write and remove the key.)
4. status.deadLetters: the messages in the group's dead-letter stream, at every tick.
5. What etcd holds, as the status tells it: an etcd outage, a reset's pause, a group
   scaled to zero, a member cut from NATS, a pause record with a garbage time.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kopf
import pytest

from harness.fleet import Fleet, settled, wait_for_status
from harness.kopfcalls import Event, call_handler, record_events
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER, Keys, dlq_subject, partition_for
from shoal.contracts.values import PauseRecord, TargetValue
from shoal.group.config import config_env
from shoal.group.jetstream import ensure_group
from shoal.group.pause import RESET_SOURCE
from shoal.operator import reconciler
from shoal.operator.state import GroupState, OperatorMemo


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    """kopf's Events, recorded instead of posted."""
    return record_events(monkeypatch)


class FakeKube:
    replicas = 2  # the Deployment's pods, all ready

    async def deployment_status(self, namespace: str, name: str) -> dict[str, int]:
        return {"replicas": self.replicas, "ready": self.replicas}

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return []  # read when a spec asks for more than 2 replicas: none refused


@pytest.fixture
async def memo(
    monkeypatch: pytest.MonkeyPatch, etcd_endpoint: str, nats_url: str
) -> AsyncIterator[OperatorMemo]:
    """A group's memo as the real startup handler fills it: real etcd and NATS clients on
    the session's servers, a fake Kubernetes client."""
    monkeypatch.setattr(reconciler, "api_client", lambda: object())
    monkeypatch.setattr(reconciler, "Kube", lambda api: FakeKube())
    monkeypatch.setenv("NATS_URL", nats_url)
    monkeypatch.setenv("ETCD_ENDPOINTS", etcd_endpoint)
    operator_memo = OperatorMemo()
    await call_handler(reconciler.startup, settings=kopf.OperatorSettings(), memo=operator_memo)
    yield copy.copy(operator_memo)  # the group's own memo, as kopf makes it
    await call_handler(reconciler.cleanup_clients, memo=operator_memo)


async def observe(
    memo: OperatorMemo, namespace: str, group: str, spec: dict[str, Any], status: dict[str, Any]
) -> dict[str, Any]:
    """One run of the status timer; the status after its patch (None deletes a field)."""
    patch = kopf.Patch()
    await call_handler(
        reconciler.observe_group,
        name=group,
        namespace=namespace,
        spec=spec,
        meta={"generation": 1},
        status=status,
        body=kopf.Body({"metadata": {"name": group, "namespace": namespace, "uid": "u"}}),
        memo=memo,
        patch=patch,
    )
    merged = {**status, **patch.get("status", {})}  # no status: nothing changed
    return {k: v for k, v in merged.items() if v is not None}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def stall_events(events: list[Event]) -> list[Event]:
    return [e for e in events if e[1].startswith("PartitionStall")]


async def test_member_reports_become_status_and_one_event_per_episode(
    etcd: Etcd,
    js: Any,
    make_config: Any,
    memo: OperatorMemo,
    events: list[Event],
    namespace: str,
    group: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = Keys(namespace, group)
    spec = {"handler": "shoal.consumer.handlers:noop", "partitions": 16, "stallAfterSeconds": 30}
    await ensure_group(js, make_config(partitions=16))  # NATS is fine: only stalls are news

    async def report(member: str, stats: Any) -> None:
        await etcd.put(keys.member(member), json.dumps(stats).encode())

    await report("c-0", {"cpu": 0.1, "stalled": [3]})
    await report("c-1", {"stalled": "3"})  # garbage: ignored
    await report("c-2", {"stalled": [1, "x", True, 99, None, 1.5, 12]})  # only 1 and 12
    await etcd.put(keys.member("c-3"), b"not json at all")
    status = await observe(memo, namespace, group, spec, {})

    assert status["stalledPartitions"] == [
        {"partition": 1, "member": "c-2"},
        {"partition": 3, "member": "c-0"},
        {"partition": 12, "member": "c-2"},
    ]
    progressing = condition(status, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "PartitionsStalled")
    assert progressing["message"] == (
        "3 partitions stalled (3 on c-0; 1, 12 on c-2): work waiting and no progress for "
        "30 s or more; the leader moves them elsewhere"
    )
    assert condition(status, "Degraded")["reason"] == "PartitionsStalled"
    assert stall_events(events) == [
        (
            "Warning",
            "PartitionStalled",
            "Partition 3 stalled on member c-0: work waiting and no progress for 30 s or "
            "more; the leader moves it to another member",
        ),
        (
            "Warning",
            "PartitionStalled",
            "Partitions 1, 12 stalled on member c-2: work waiting and no progress for 30 s "
            "or more; the leader moves them elsewhere",
        ),
    ]

    # Still stalled at the next observations: no Event more.
    for _ in range(2):
        status = await observe(memo, namespace, group, spec, status)
    assert len(stall_events(events)) == 2

    # etcd unreadable for one observation: no episode ends, none starts again afterwards.
    real_read = reconciler._read_group

    async def unreadable(*_: Any) -> Any:
        raise ConnectionError("etcd away")

    monkeypatch.setattr(reconciler, "_read_group", unreadable)
    away = await observe(memo, namespace, group, spec, status)
    assert condition(away, "Degraded")["reason"] == "EtcdUnavailable"
    monkeypatch.setattr(reconciler, "_read_group", real_read)
    status = await observe(memo, namespace, group, spec, away)
    assert len(stall_events(events)) == 2
    assert len(status["stalledPartitions"]) == 3

    # c-0's partition 3 is moved: c-0 stops reporting it. c-2 goes on with 12 only.
    await report("c-0", {"cpu": 0.1, "stalled": []})
    await report("c-2", {"stalled": [12]})
    status = await observe(memo, namespace, group, spec, status)
    assert status["stalledPartitions"] == [{"partition": 12, "member": "c-2"}]
    assert stall_events(events)[2:] == [
        (
            "Normal",
            "PartitionStallEnded",
            "Partition 3 no longer reported stalled by member c-0 (progressing again, moved "
            "to another member, or the member left)",
        ),
        (
            "Normal",
            "PartitionStallEnded",
            "Partition 1 no longer reported stalled by member c-2 (progressing again, moved "
            "to another member, or the member left)",
        ),
    ]
    # The next owner of 3 stalls on it too: a new episode, a new Warning.
    await report("c-1", {"stalled": [3]})
    status = await observe(memo, namespace, group, spec, status)
    assert stall_events(events)[4:] == [
        (
            "Warning",
            "PartitionStalled",
            "Partition 3 stalled on member c-1: work waiting and no progress for 30 s or "
            "more; the leader moves it to another member",
        )
    ]

    # Every member gone: every episode ends, the field goes, the conditions clear.
    await etcd.delete_prefix(keys.members)
    status = await observe(memo, namespace, group, spec, status)
    assert "stalledPartitions" not in status
    assert [e[:2] for e in stall_events(events)[5:]] == [("Normal", "PartitionStallEnded")] * 2
    assert condition(status, "Progressing")["reason"] != "PartitionsStalled"
    assert condition(status, "Degraded")["reason"] == "AsExpected"
    assert memo.group.stalled == frozenset()


async def test_a_stall_shorter_than_the_timers_period_is_still_told(
    etcd: Etcd,
    js: Any,
    make_config: Any,
    memo: OperatorMemo,
    events: list[Event],
    namespace: str,
    group: str,
) -> None:
    """The usual case: the leader moves a stalled partition within a second or two, and
    its member stops reporting it at its next stats write, all between two runs of the
    status timer. Both Events are posted all the same, Warning first."""
    keys = Keys(namespace, group)
    spec = {"handler": "shoal.consumer.handlers:noop", "partitions": 16}
    await ensure_group(js, make_config(partitions=16))
    await etcd.put(keys.member("c-0"), b'{"stalled": []}')
    status = await observe(memo, namespace, group, spec, {})  # starts the watch
    for stats in ('{"stalled": [5]}', '{"stalled": [5, 6]}', "garbage", '{"stalled": []}'):
        await etcd.put(keys.member("c-0"), stats.encode())
    await etcd.put(keys.member("c-1"), b'{"stalled": [9]}')
    await etcd.delete(keys.member("c-1"))  # it reported a stall, then left

    async def told() -> list[Event]:
        nonlocal status
        status = await observe(memo, namespace, group, spec, status)
        return stall_events(events)

    # The watch's callback runs on etcd3's thread: give it a moment (it is not the timer).
    found = await eventually_async(told, 5, "the Events", until=lambda e: len(e) == 4)
    assert [e[:2] for e in found] == [
        ("Warning", "PartitionStalled"),
        ("Warning", "PartitionStalled"),
        ("Normal", "PartitionStallEnded"),
        ("Normal", "PartitionStallEnded"),
    ]
    assert found[0][2].startswith("Partitions 5, 6 stalled on member c-0")
    assert found[1][2].startswith("Partition 9 stalled on member c-1")
    assert found[2][2].startswith("Partitions 5, 6 no longer reported stalled by member c-0")
    assert "stalledPartitions" not in status
    # Told once: later observations add nothing.
    for _ in range(2):
        status = await observe(memo, namespace, group, spec, status)
    assert len(stall_events(events)) == 4
    # Deleting the group stops its watch.
    watch = memo.group.stall_watch
    assert watch is not None and watch.watch is not None
    await watch.stop()
    assert watch.watch is None


HANDLER = "harness.handlers:scripted_ledger"
PARTITIONS = 4
STALL_AFTER = 5
SETTINGS = ("handler", "partitions", "ledger", "handler_timeout", "stall_after")


@pytest.mark.e2e
@pytest.mark.timeout(180)
async def test_a_real_stall_shows_in_status_and_events(
    make_fleet: Callable[..., Fleet],
    etcd: Etcd,
    js: Any,
    make_config: Any,
    memo: OperatorMemo,
    events: list[Event],
    tmp_path: Path,
) -> None:
    config = make_config(
        handler=HANDLER, partitions=PARTITIONS, handler_timeout=0, stall_after=STALL_AFTER
    )
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=PARTITIONS)
    for member in ("m-0", "m-1"):
        fleet.start(member, **config_env(config, SETTINGS))
    members = await wait_for_status(
        etcd, config.namespace, config.group, PARTITIONS, settled({"m-0", "m-1"}), 30
    )
    victim = min(p for p, m in members.owners.items() if m == "m-0")
    project = next(
        f"wedged-{i}" for i in range(1000) if partition_for(f"wedged-{i}", PARTITIONS) == victim
    )
    # One project's handler never returns on m-0, and more messages than the partition
    # holds wait behind it: its partition stalls there (see tests/test_stall_moves.py).
    items = [
        Outgoing(project, b"hang-on:m-0", f"{project}-{i}", {SEQ_HEADER: str(i)})
        for i in range(150)
    ]
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)
    spec = {
        "handler": HANDLER,
        "partitions": PARTITIONS,
        "replicas": 2,
        "maxReplicas": 2,
        "ledger": True,
        "stallAfterSeconds": STALL_AFTER,
        "nats": {"consumer": {"handlerTimeoutSeconds": 0}},
    }
    seen: list[dict[str, Any]] = []

    async def observed() -> dict[str, Any]:
        status = await observe(memo, config.namespace, config.group, spec, seen[-1] if seen else {})
        seen.append(status)
        return status

    # At the operator's own period: the stall is often over (moved) before the next run.
    await eventually_async(
        observed,
        STALL_AFTER + 40,
        "the operator to tell of the stall",
        until=lambda _: any(e[1] == "PartitionStallEnded" for e in events),
        interval=reconciler.OBSERVE_INTERVAL,
    )
    print(f"stalledPartitions seen in {sum('stalledPartitions' in st for st in seen)} runs")
    for st in seen:
        if "stalledPartitions" in st:
            assert st["stalledPartitions"] == [{"partition": victim, "member": "m-0"}]
            assert condition(st, "Progressing")["reason"] == "PartitionsStalled"
    assert stall_events(events) == [
        (
            "Warning",
            "PartitionStalled",
            f"Partition {victim} stalled on member m-0: work waiting and no progress for "
            f"{STALL_AFTER} s or more; the leader moves it to another member",
        ),
        (
            "Normal",
            "PartitionStallEnded",
            f"Partition {victim} no longer reported stalled by member m-0 (progressing again, "
            "moved to another member, or the member left)",
        ),
    ]
    final = await wait_for_status(
        etcd, config.namespace, config.group, PARTITIONS, settled({"m-0", "m-1"}), 30
    )
    assert final.owners[victim] == "m-1"


async def test_a_restarted_operator_does_not_announce_an_ongoing_stall_again(
    etcd: Etcd,
    js: Any,
    make_config: Any,
    memo: OperatorMemo,
    events: list[Event],
    namespace: str,
    group: str,
) -> None:
    """The episodes a previous operator process announced are in the status it wrote: a
    new process (an empty memo) takes them from there. One still going on gets no second
    Warning; one that ended while no operator ran gets its PartitionStallEnded."""
    keys = Keys(namespace, group)
    spec = {"handler": "shoal.consumer.handlers:noop", "partitions": 16, "stallAfterSeconds": 30}
    await ensure_group(js, make_config(partitions=16))
    await etcd.put(keys.member("c-0"), json.dumps({"stalled": [3]}).encode())
    await etcd.put(keys.member("c-1"), json.dumps({"stalled": []}).encode())
    # What the operator before the restart wrote: 3 on c-0 (still stalled), 5 on c-1
    # (healed since).
    before = {
        "stalledPartitions": [
            {"partition": 3, "member": "c-0"},
            {"partition": 5, "member": "c-1"},
        ]
    }
    status = await observe(memo, namespace, group, spec, before)

    assert status["stalledPartitions"] == [{"partition": 3, "member": "c-0"}]
    assert stall_events(events) == [
        (
            "Normal",
            "PartitionStallEnded",
            "Partition 5 no longer reported stalled by member c-1 (progressing again, moved "
            "to another member, or the member left)",
        )
    ]
    # Garbage in the old status is ignored, not a crash.
    memo.group.stalled = None
    await observe(memo, namespace, group, spec, {"stalledPartitions": [{"partition": "x"}, 7]})
    assert [e[1] for e in stall_events(events)] == ["PartitionStallEnded", "PartitionStalled"]


async def test_a_member_nats_refuses_makes_the_group_degraded(
    etcd: Etcd,
    js: Any,
    make_config: Any,
    memo: OperatorMemo,
    events: list[Event],
    namespace: str,
    group: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    keys = Keys(namespace, group)
    spec = {"handler": "shoal.consumer.handlers:noop", "partitions": 16, "replicas": 3}
    await ensure_group(js, make_config(partitions=16))  # NATS is fine for the operator
    await etcd.put(keys.member("c-0"), b'{"cpu": 0.1}')
    why = "NATS refused the credentials (Authorization Violation): wrong user or password"
    refused = {"reason": "NatsAuthFailed", "message": why, "since": time.time()}
    await etcd.put(keys.problem("c-1"), json.dumps(refused).encode())
    await etcd.put(keys.problem("c-2"), b"garbage")  # ignored, as is c-3's
    await etcd.put(keys.problem("c-3"), json.dumps({**refused, "reason": 7}).encode())
    status = await observe(memo, namespace, group, spec, {})

    told = f"member c-1 cannot connect to NATS: NatsAuthFailed: {why}"
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == (
        "True",
        "NatsAuthFailed",
        told,
    )
    ready = condition(status, "Ready")  # FakeKube: 2 of the 3 pods are ready
    assert (ready["status"], ready["reason"]) == ("False", "NatsAuthFailed")
    assert ready["message"] == f"2 of 3 members ready; {told}"
    assert status["members"] == 1  # a problems/ key is no member
    assert refusal_events(events) == [("Warning", "NatsAuthFailed", told)]

    # Still refused at the next observation, and after an operator restart (its state
    # gone: it reads the episode back from the status it wrote): no Warning again.
    status = await observe(memo, namespace, group, spec, status)
    ignored = [r for r in caplog.records if "Ignored etcd key" in r.getMessage()]
    assert len(ignored) == 2, ignored  # c-2 and c-3, once each: not at every observation
    memo.group.refused = None
    status = await observe(memo, namespace, group, spec, status)
    assert len(refusal_events(events)) == 1

    # A second member with another reason: one more Warning; Degraded names both.
    tls = {"reason": "NatsTLSFailed", "message": "it has expired", "since": time.time()}
    await etcd.put(keys.problem("c-4"), json.dumps(tls).encode())
    status = await observe(memo, namespace, group, spec, status)
    both = f"{told}; member c-4 cannot connect to NATS: NatsTLSFailed: it has expired"
    assert condition(status, "Degraded")["message"] == both
    assert refusal_events(events)[1:] == [
        (
            "Warning",
            "NatsTLSFailed",
            "member c-4 cannot connect to NATS: NatsTLSFailed: it has expired",
        )
    ]

    # NATS accepts them (their keys go with their leases): the episodes end.
    await etcd.delete(keys.problem("c-1"))
    await etcd.delete(keys.problem("c-4"))
    status = await observe(memo, namespace, group, spec, status)
    assert condition(status, "Degraded")["reason"] == "AsExpected"
    assert condition(status, "Ready")["reason"] == "WaitingForMembers"
    assert [e[:2] for e in refusal_events(events)[2:]] == [("Normal", "NatsRefusalEnded")] * 2


def refusal_events(events: list[Event]) -> list[Event]:
    return [e for e in events if e[1].startswith("Nats")]


async def restart(memo: OperatorMemo, **state: Any) -> None:
    """An operator restart, as the group's memo sees it: a fresh state (with `state`, what
    the new process's own reconcile set), the old one's etcd watch stopped."""
    watch = memo.group.stall_watch
    if watch is not None:
        await watch.stop()
    memo.group = GroupState(**state)


async def test_a_restarted_operator_reads_the_refusals_back_while_a_problem_outranks_them(
    etcd: Etcd,
    js: Any,
    make_config: Any,
    memo: OperatorMemo,
    events: list[Event],
    namespace: str,
    group: str,
) -> None:
    """While a problem of the group's own is the Degraded condition (here the last
    reconcile's HandlerInvalid; EtcdNoSpace, NatsUnavailable alike), its message names no
    refused member: status.refusedMembers lists them. A restarted operator reads them back
    from there: no second Warning for an episode going on, a NatsRefusalEnded for one that
    ended while no operator ran."""
    keys = Keys(namespace, group)
    spec = {"handler": NOOP, "partitions": 16, "replicas": 3}
    await ensure_group(js, make_config(partitions=16))
    await etcd.put(keys.member("c-0"), b'{"cpu": 0.1}')
    why = "NATS refused the credentials (Authorization Violation): wrong user or password"
    refused = json.dumps({"reason": "NatsAuthFailed", "message": why, "since": time.time()})
    await etcd.put(keys.problem("c-1"), refused.encode())
    await etcd.put(keys.problem("c-2"), refused.encode())
    problem = ("HandlerInvalid", "no module named nope")
    memo.group.problem = problem
    status = await observe(memo, namespace, group, spec, {})

    assert condition(status, "Degraded")["reason"] == "HandlerInvalid"
    assert "c-1" not in condition(status, "Degraded")["message"]
    assert [e[:2] for e in refusal_events(events)] == [("Warning", "NatsAuthFailed")] * 2

    # Restarts, the problem still there (the new process's reconcile fails again).
    for _ in range(3):
        await restart(memo, problem=problem)
        status = await observe(memo, namespace, group, spec, status)
    assert len(refusal_events(events)) == 2
    assert status["refusedMembers"] == [
        {"member": "c-1", "reason": "NatsAuthFailed"},
        {"member": "c-2", "reason": "NatsAuthFailed"},
    ]

    # NATS accepts c-2 while no operator runs (its key goes with its lease).
    await etcd.delete(keys.problem("c-2"))
    await restart(memo, problem=problem)
    status = await observe(memo, namespace, group, spec, status)
    assert refusal_events(events)[2:] == [
        (
            "Normal",
            "NatsRefusalEnded",
            "Member c-2 no longer reports that NATS refuses it (NatsAuthFailed): NATS "
            "accepts it now, or the member left",
        )
    ]
    assert status["refusedMembers"] == [{"member": "c-1", "reason": "NatsAuthFailed"}]

    # The problem fixed: the refusal is the Degraded condition again, and no news.
    await restart(memo)
    status = await observe(memo, namespace, group, spec, status)
    assert condition(status, "Degraded")["reason"] == "NatsAuthFailed"
    assert len(refusal_events(events)) == 3
    await etcd.delete(keys.problem("c-1"))
    status = await observe(memo, namespace, group, spec, status)
    assert "refusedMembers" not in status
    assert [e[1] for e in refusal_events(events)[3:]] == ["NatsRefusalEnded"]


async def test_a_restarted_operator_does_not_announce_etcd_nospace_again(
    js: Any,
    make_config: Any,
    memo: OperatorMemo,
    events: list[Event],
    namespace: str,
    group: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One EtcdNoSpace Warning while etcd's NOSPACE alarm stays raised, across operator
    restarts (the new process reads it back from the Degraded condition the last one
    wrote), and an EtcdSpaceRecovered for an alarm cleared while no operator ran."""
    spec = {"handler": NOOP, "partitions": 16, "replicas": 2}
    await ensure_group(js, make_config(partitions=16))
    alarm = {"raised": True}

    async def nospace(_etcd: Any) -> bool:
        return alarm["raised"]

    monkeypatch.setattr(memo.alarms, "nospace", nospace)
    status = await observe(memo, namespace, group, spec, {})
    status = await observe(memo, namespace, group, spec, status)
    assert condition(status, "Degraded")["reason"] == "EtcdNoSpace"
    for _ in range(3):
        await restart(memo)
        status = await observe(memo, namespace, group, spec, status)

    def told() -> list[tuple[str, str]]:
        return [e[:2] for e in events if e[1] in ("EtcdNoSpace", "EtcdSpaceRecovered")]

    assert told() == [("Warning", "EtcdNoSpace")]

    alarm["raised"] = False  # etcdctl alarm disarm, while no operator runs
    await restart(memo)
    status = await observe(memo, namespace, group, spec, status)
    assert told() == [("Warning", "EtcdNoSpace"), ("Normal", "EtcdSpaceRecovered")]
    assert condition(status, "Degraded")["reason"] == "AsExpected"


async def test_the_dead_letter_count_is_in_status(
    js: Any, make_config: Any, memo: OperatorMemo, namespace: str, group: str
) -> None:
    """One STREAM.INFO of the group's dead-letter stream per tick: `kubectl describe cg`
    shows it (Dead Letters), `kubectl get cg -o wide` too (DLQ)."""
    spec = {"handler": "shoal.consumer.handlers:noop", "partitions": 4, "maxReplicas": 4}
    config = make_config(partitions=4)
    await ensure_group(js, config)
    status = await observe(memo, namespace, group, spec, {})
    assert status["deadLetters"] == 0
    for p in (0, 1, 1):
        await js.publish(dlq_subject(config.subject_prefix, p), b"x")
    status = await observe(memo, namespace, group, spec, status)
    assert status["deadLetters"] == 3
    await js.purge_stream(config.dlq_stream)
    assert (await observe(memo, namespace, group, spec, status))["deadLetters"] == 0


NOOP = "shoal.consumer.handlers:noop"


async def settled_group(etcd: Etcd, keys: Keys, members: list[str], partitions: int) -> None:
    """Assignment generation 5 written by members[0], every partition claimed by its
    target owner (member keys written by hand, without leases)."""
    await etcd.put(keys.leader, members[0].encode())
    for member in members:
        await etcd.put(keys.member(member), b'{"nats_ok": true}')
    for p in range(partitions):
        owner = members[p % len(members)]
        await etcd.put(keys.partition(p), TargetValue(owner=owner, generation=5, epoch=1).to_json())
        await etcd.put(keys.claim(p), owner.encode())


async def test_an_etcd_outage_keeps_the_status_and_is_no_rebalance(
    etcd: Etcd,
    js: Any,
    make_config: Any,
    memo: OperatorMemo,
    events: list[Event],
    namespace: str,
    group: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One tick without etcd wrote leader "", members 0, assignmentGeneration 0,
    partitionsPerMember 0..0 and skew 0, and deleted stalledPartitions; when etcd was
    back, the generation "changed" from 0: a Rebalanced Event and a new
    lastRebalanceTime, with the assignment as it was."""
    keys = Keys(namespace, group)
    spec = {"handler": NOOP, "partitions": 16, "stallAfterSeconds": 30}
    await ensure_group(js, make_config(partitions=16))
    await settled_group(etcd, keys, ["c-0", "c-1"], 16)
    await etcd.put(keys.member("c-1"), b'{"nats_ok": true, "stalled": [3]}')
    status = await observe(memo, namespace, group, spec, {})
    assert (status["leader"], status["assignmentGeneration"], status["members"]) == ("c-0", 5, 2)
    rebalanced = [e for e in events if e[1] == "Rebalanced"]
    assert len(rebalanced) == 1
    real_read = reconciler._read_group

    async def unreadable(*_: Any) -> Any:
        raise ConnectionError("etcd away")

    monkeypatch.setattr(reconciler, "_read_group", unreadable)
    away = await observe(memo, namespace, group, spec, status)
    assert condition(away, "Degraded")["reason"] == "EtcdUnavailable"
    for key in (
        "leader",
        "assignmentGeneration",
        "members",
        "partitionsPerMember",
        "skew",
        "stalledPartitions",
    ):
        assert away[key] == status[key], key
    monkeypatch.setattr(reconciler, "_read_group", real_read)
    await asyncio.sleep(1.1)  # a new lastRebalanceTime would differ (whole seconds)
    back = await observe(memo, namespace, group, spec, away)
    assert [e for e in events if e[1] == "Rebalanced"] == rebalanced, events
    assert back["lastRebalanceTime"] == status["lastRebalanceTime"]
    assert condition(back, "Degraded")["reason"] == "PartitionsStalled"


async def test_a_group_paused_by_a_reset_says_so(
    etcd: Etcd,
    js: Any,
    make_config: Any,
    memo: OperatorMemo,
    events: list[Event],
    namespace: str,
    group: str,
) -> None:
    """An interrupted `shoal-consumer reset` leaves the group paused (source "reset"),
    and the operator rightly leaves that pause; but with spec.paused false its status
    said Paused False ("The group is not paused") while no member pulled."""
    keys = Keys(namespace, group)
    spec = {"handler": NOOP, "partitions": 16}
    await ensure_group(js, make_config(partitions=16))
    await settled_group(etcd, keys, ["c-0", "c-1"], 16)
    record = PauseRecord(by="alice@host", time=time.time(), source=RESET_SOURCE)
    await etcd.put(keys.paused, record.to_json())
    status = await observe(memo, namespace, group, spec, {})
    assert keys.paused in (await etcd.get_prefix(keys.paused))[1]
    paused = condition(status, "Paused")
    assert (paused["status"], paused["reason"]) == ("True", "ResetPaused"), paused
    assert "by alice@host" in paused["message"]
    assert condition(status, "Progressing")["reason"] == "Paused"


async def test_a_group_scaled_to_zero_is_stable(
    etcd: Etcd,
    js: Any,
    make_config: Any,
    memo: OperatorMemo,
    events: list[Event],
    namespace: str,
    group: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scaled to zero after running: the targets stay in etcd, the claims went with the
    leases. The status said Rebalancing ("16 of 16 partitions moving between 0
    members") for as long as it stayed at zero."""
    keys = Keys(namespace, group)
    spec = {"handler": NOOP, "partitions": 16, "replicas": 0}
    await ensure_group(js, make_config(partitions=16))
    await settled_group(etcd, keys, ["c-0", "c-1"], 16)
    for prefix in (keys.claims, keys.members):
        await etcd.delete_prefix(prefix)
    await etcd.delete(keys.leader)
    monkeypatch.setattr(FakeKube, "replicas", 0)
    status = await observe(memo, namespace, group, spec, {})
    assert condition(status, "Ready")["reason"] == "ScaledToZero"
    progressing = condition(status, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "Stable"), progressing
    assert status["skew"] == 0


async def test_a_member_cut_from_nats_is_no_rebalance(
    etcd: Etcd,
    js: Any,
    make_config: Any,
    memo: OperatorMemo,
    events: list[Event],
    namespace: str,
    group: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The leader gives a member that cannot reach NATS nothing (election._eligible):
    its zero share kept the group "Rebalancing: 0 of 16 partitions moving" while it
    stayed cut."""
    keys = Keys(namespace, group)
    spec = {"handler": NOOP, "partitions": 16, "replicas": 3}
    await ensure_group(js, make_config(partitions=16))
    await settled_group(etcd, keys, ["c-0", "c-1"], 16)
    await etcd.put(keys.member("c-2"), b'{"nats_ok": false}')
    monkeypatch.setattr(FakeKube, "replicas", 3)
    status = await observe(memo, namespace, group, spec, {})
    assert condition(status, "Progressing")["reason"] == "Stable", condition(status, "Progressing")
    assert status["partitionsPerMember"] == {"min": 0, "max": 8}


async def test_a_garbage_pause_time_does_not_stop_the_status_timer(
    etcd: Etcd,
    js: Any,
    make_config: Any,
    memo: OperatorMemo,
    events: list[Event],
    namespace: str,
    group: str,
) -> None:
    """A pause record whose time parses but is out of range (1e300) made the status
    timer raise (OverflowError in format_time) at every tick: no status at all."""
    keys = Keys(namespace, group)
    spec = {"handler": NOOP, "partitions": 16, "paused": True}
    await ensure_group(js, make_config(partitions=16))
    await settled_group(etcd, keys, ["c-0", "c-1"], 16)
    await etcd.put(keys.paused, b'{"by": "x", "time": 1e300, "source": "cli"}')
    status = await observe(memo, namespace, group, spec, {})
    paused = condition(status, "Paused")
    assert paused["status"] == "True" and "by x at an unknown time" in paused["message"]


async def test_the_lag_of_a_limits_stream_is_its_durables(
    make_fleet: Callable[..., Fleet],
    etcd: Etcd,
    js: Any,
    make_config: Any,
    memo: OperatorMemo,
    events: list[Event],
    namespace: str,
    group: str,
) -> None:
    """A `limits` stream keeps what was processed, so its message count is no lag: the
    status showed no lag at all for such a group (the LAG column stayed empty while a
    backlog grew). Now it is what waits in the durables: theirs while no member runs
    them, the members' own reports once they do."""
    partitions = 4
    config = make_config(partitions=partitions, retention="limits")
    spec = {"handler": NOOP, "partitions": partitions, "maxReplicas": partitions}
    spec["nats"] = {"stream": {"retention": "limits"}}
    await ensure_group(js, config)
    items = [Outgoing(f"p-{i % 9}", b"x", f"lag-{i}") for i in range(30)]
    await Producer(js, config.subject_prefix, partitions).publish_many(items)
    status = await observe(memo, namespace, group, spec, {})
    assert status.get("lag") == 30  # nobody runs the durables: they tell

    fleet = make_fleet(handler=NOOP, partitions=partitions, ledger=False)
    fleet.start("m-0", **config_env(config, ("retention",)))
    await wait_for_status(etcd, namespace, group, partitions, settled({"m-0"}), 30)

    async def lag() -> Any:
        return (await observe(memo, namespace, group, spec, status)).get("lag")

    await eventually_async(lag, 30, "the lag to reach 0", until=lambda n: n == 0, interval=0.5)
    assert (await js.stream_info(config.stream)).state.messages == 30  # kept, processed


async def test_a_cli_pause_outlasts_the_status_timer(
    etcd: Etcd,
    js: Any,
    make_config: Any,
    memo: OperatorMemo,
    events: list[Event],
    namespace: str,
    group: str,
) -> None:
    """`shoal-consumer pause` on a group the operator runs, spec.paused false: the status
    timer lifted it at its next tick (about 2 s later) with a Resumed Event blaming
    whoever last set spec.paused. spec.paused: false lifts only the pause spec.paused
    made: the CLI's stands (Paused True, who and why), with no Event, tick after tick."""
    keys = Keys(namespace, group)
    spec = {"handler": NOOP, "partitions": 16}
    await ensure_group(js, make_config(partitions=16))
    await settled_group(etcd, keys, ["c-0", "c-1"], 16)
    record = PauseRecord(by="root@vm", time=time.time(), source="cli", reason="test")
    await etcd.put(keys.paused, record.to_json())
    status: dict[str, Any] = {}
    for _ in range(2):
        status = await observe(memo, namespace, group, spec, status)
        paused = condition(status, "Paused")
        assert paused["status"] == "True", paused
        assert "by root@vm" in paused["message"] and "(cli): test" in paused["message"]
    assert keys.paused in (await etcd.get_prefix(keys.paused))[1]
    assert [e for e in events if e[1] in ("Paused", "Resumed")] == [], events
