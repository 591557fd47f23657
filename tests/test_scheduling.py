"""Member pods the scheduler cannot place: shoal.operator.scheduling (pure), the conditions
shoal.operator.observe makes of it, and the status timer's one Warning per episode
(reconciler.observe_group with a fake Kubernetes and etcd/NATS that need not answer).

e2e/test_group_on_nodes.py shows the same on the 3-node plane with a real kube-scheduler.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest

from harness.kopfcalls import Event, call_handler, record_events
from shoal.operator import reconciler
from shoal.operator.observe import Observed, conditions
from shoal.operator.scheduling import (
    MAX_SCHEDULER_MESSAGE,
    Unschedulable,
    is_unschedulable,
    unschedulable,
    unschedulable_in_status,
)
from shoal.operator.state import OperatorMemo

AFFINITY = (
    "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector. "
    "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
)
CPU = "0/3 nodes are available: 3 Insufficient cpu."


def pod(
    name: str,
    phase: str = "Pending",
    scheduled: tuple[str, str, str] | None = ("False", "Unschedulable", AFFINITY),
    deleting: bool = False,
) -> dict[str, Any]:
    """A pod as the API returns it; `scheduled`: its PodScheduled (status, reason, message)."""
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    found: list[dict[str, Any]] = []
    if scheduled is not None:
        status, reason, message = scheduled
        found.append(
            {"type": "PodScheduled", "status": status, "reason": reason, "message": message}
        )
    return {"metadata": meta, "status": {"phase": phase, "conditions": found}}


RUNNING = ("True", "", "")


# -- from pods to what the group says ----------------------------------------------------------


def test_every_pod_refused_quotes_the_scheduler_once() -> None:
    found = unschedulable([pod("m-1"), pod("m-0")])
    assert found == Unschedulable(pods=2, of=2, scheduler=AFFINITY)
    assert found.message() == f"2 of 2 member pods cannot be scheduled: {AFFINITY}"


def test_only_refused_pods_count_and_the_others_are_the_total() -> None:
    pods = [
        pod("m-0", "Running", RUNNING),
        pod("m-1", "Running", RUNNING),
        pod("m-2"),
        pod("m-3", scheduled=None),  # not looked at by the scheduler yet
        pod("m-4", scheduled=("False", "SchedulingGated", "gated")),  # held, not refused
    ]
    found = unschedulable(pods)
    assert found is not None
    assert found.message() == f"1 of 5 member pod cannot be scheduled: {AFFINITY}"


def test_pods_being_deleted_count_nowhere() -> None:
    assert unschedulable([pod("m-0", deleting=True), pod("m-1", "Running", RUNNING)]) is None
    found = unschedulable([pod("old", "Running", RUNNING, deleting=True), pod("new")])
    assert found is not None and (found.pods, found.of) == (1, 1)


def test_no_refused_pod_no_pods_and_garbage_say_nothing() -> None:
    assert unschedulable([]) is None
    assert unschedulable([pod("m-0", "Running", RUNNING), pod("m-1", scheduled=None)]) is None
    # A pod Running with a stale PodScheduled False is not Pending: the scheduler placed it.
    assert not is_unschedulable(pod("m-0", "Running"))
    assert unschedulable([{}, {"status": None}, {"status": {"conditions": "x"}}]) is None


def test_the_most_common_message_wins_and_the_others_are_counted() -> None:
    found = unschedulable(
        [pod("m-0", scheduled=("False", "Unschedulable", CPU)), pod("m-1"), pod("m-2")]
    )
    assert found == Unschedulable(pods=3, of=3, scheduler=AFFINITY, others=1)
    assert found.message().endswith(f"{AFFINITY} (and 1 other reason: kubectl describe pod)")
    # A tie: the first pod's by name.
    tie = unschedulable([pod("m-1"), pod("m-0", scheduled=("False", "Unschedulable", CPU))])
    assert tie is not None and tie.scheduler == CPU


def test_a_long_or_empty_message_is_kept_readable() -> None:
    found = unschedulable([pod("m-0", scheduled=("False", "Unschedulable", "x  y\n" * 1000))])
    assert found is not None
    assert len(found.scheduler) == MAX_SCHEDULER_MESSAGE and found.scheduler.endswith("...")
    assert "\n" not in found.scheduler and "  " not in found.scheduler
    empty = unschedulable([pod("m-0", scheduled=("False", "Unschedulable", ""))])
    assert empty is not None and empty.scheduler == "no reason given"


def test_an_earlier_operator_said_so_in_the_status() -> None:
    def with_condition(value: str) -> dict[str, Any]:
        return {"conditions": [{"type": "Ready"}, {"type": "MembersSchedulable", "status": value}]}

    assert unschedulable_in_status(with_condition("False"))
    assert not unschedulable_in_status(with_condition("True"))
    assert not unschedulable_in_status(with_condition("Unknown"))
    assert not unschedulable_in_status({}) and not unschedulable_in_status(None)
    assert not unschedulable_in_status({"conditions": ["garbage", 3]})


# -- the conditions --------------------------------------------------------------------------


def observed(**changes: Any) -> Observed:
    """A group of 2 whose pods are not ready yet; `changes` on top."""
    waiting = Observed(
        generation=3,
        spec_replicas=2,
        replicas=2,
        ready_replicas=0,
        members={},
        leader=None,
        assignment_generation=0,
        partitions=16,
        unowned=16,
        unclaimed=16,
        lag=0,
    )
    return dataclasses.replace(waiting, **changes)


def by_type(o: Observed) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in conditions(o)}


REFUSED = Unschedulable(pods=2, of=2, scheduler=AFFINITY)


def test_refused_pods_make_the_condition_false_and_ready_say_why() -> None:
    c = by_type(observed(unschedulable=REFUSED))
    assert c["MembersSchedulable"] == {
        "type": "MembersSchedulable",
        "status": "False",
        "reason": "Unschedulable",
        "message": f"2 of 2 member pods cannot be scheduled: {AFFINITY}",
        "observedGeneration": 3,
    }
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "MembersUnschedulable")
    assert c["Ready"]["message"] == (
        f"0 of 2 members ready; 2 of 2 member pods cannot be scheduled: {AFFINITY}"
    )


def test_schedulable_unknown_and_a_ready_group_with_a_refused_surge_pod() -> None:
    c = by_type(observed())
    assert (c["MembersSchedulable"]["status"], c["MembersSchedulable"]["reason"]) == (
        "True",
        "Schedulable",
    )
    assert c["Ready"]["reason"] == "WaitingForMembers"
    c = by_type(observed(pods_unread="403 Forbidden"))
    assert (c["MembersSchedulable"]["status"], c["MembersSchedulable"]["reason"]) == (
        "Unknown",
        "PodsUnread",
    )
    assert c["MembersSchedulable"]["message"].endswith("403 Forbidden")
    # A rollout's surge pod fits nowhere while the 2 members run: the group stays Ready.
    surge = Unschedulable(pods=1, of=3, scheduler=AFFINITY)
    ready = observed(
        replicas=3,
        ready_replicas=2,
        members={"m-0": 8, "m-1": 8},
        leader="m-0",
        unowned=0,
        unclaimed=0,
        unschedulable=surge,
    )
    c = by_type(ready)
    assert c["Ready"]["status"] == "True" and c["MembersSchedulable"]["status"] == "False"


def test_a_problem_of_the_spec_comes_before_the_scheduler_in_ready() -> None:
    c = by_type(observed(unschedulable=REFUSED, problem=("HandlerInvalid", "no such handler")))
    assert c["Ready"]["reason"] == "HandlerInvalid"
    assert c["MembersSchedulable"]["status"] == "False"


# -- the status timer: one Warning per episode ----------------------------------------------------


class FakeKube:
    """The Deployment's status and its pods, as the test sets them; pod lists counted."""

    def __init__(self) -> None:
        self.dep = {"replicas": 2, "ready": 0}
        self.pods: list[dict[str, Any]] = []
        self.listed = 0
        self.selectors: list[str] = []
        self.fail: Exception | None = None

    async def deployment_status(self, namespace: str, name: str) -> dict[str, int]:
        return dict(self.dep)

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.selectors.append(selector)  # checked by the tests (an assert here would be
        self.listed += 1  # caught as a failed read)
        if self.fail is not None:
            raise self.fail
        return self.pods


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    return record_events(monkeypatch)


@pytest.fixture
async def world(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[OperatorMemo, FakeKube]]:
    """A group's memo as the startup handler fills it, with a fake Kubernetes; etcd and
    NATS point at a port nothing listens on (their part of the status says unavailable,
    which is not what these tests look at)."""
    kube = FakeKube()
    monkeypatch.setattr(reconciler, "api_client", lambda: object())
    monkeypatch.setattr(reconciler, "Kube", lambda api: kube)
    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:9")
    monkeypatch.setenv("ETCD_ENDPOINTS", "127.0.0.1:9")
    operator_memo = OperatorMemo()
    await call_handler(reconciler.startup, settings=kopf.OperatorSettings(), memo=operator_memo)
    yield copy.copy(operator_memo), kube
    await call_handler(reconciler.cleanup_clients, memo=operator_memo)


async def observe(memo: OperatorMemo, status: dict[str, Any]) -> dict[str, Any]:
    """One run of the status timer; the status after its patch."""
    patch = kopf.Patch()
    await call_handler(
        reconciler.observe_group,
        name="g",
        namespace="ns",
        spec={
            "handler": "shoal.consumer.handlers:noop",
            "replicas": 2,
            "partitions": 16,
        },
        meta={"generation": 1},
        status=status,
        body=kopf.Body({"metadata": {"name": "g", "namespace": "ns", "uid": "u"}}),
        memo=memo,
        patch=patch,
    )
    merged = {**status, **patch.get("status", {})}  # no status: nothing changed
    return {k: v for k, v in merged.items() if v is not None}


def schedulable_of(status: dict[str, Any]) -> tuple[str, str]:
    c = next(c for c in status["conditions"] if c["type"] == "MembersSchedulable")
    return c["status"], c["message"]


def warnings(events: list[Event]) -> list[Event]:
    return [e for e in events if e[1] == "MembersUnschedulable"]


async def test_one_warning_per_episode_and_none_when_they_schedule(
    world: tuple[OperatorMemo, FakeKube], events: list[Event]
) -> None:
    memo, kube = world
    kube.pods = [pod("m-0"), pod("m-1")]
    status = await observe(memo, {})
    message = f"2 of 2 member pods cannot be scheduled: {AFFINITY}"
    assert schedulable_of(status) == ("False", message)
    # The Deployment's own selector: the group's member pods and no others.
    assert kube.selectors[0] == "app.kubernetes.io/name=shoal-consumer,shoal.dev/group=g"
    assert warnings(events) == [("Warning", "MembersUnschedulable", message)]
    # Still refused, for other words: the same episode, no second Warning.
    kube.pods = [pod("m-0", scheduled=("False", "Unschedulable", CPU)), pod("m-1")]
    status = await observe(memo, status)
    assert schedulable_of(status)[0] == "False" and len(warnings(events)) == 1
    # The pods cannot be read for a while: Unknown, and the episode goes on.
    kube.fail = RuntimeError("connection refused")
    status = await observe(memo, status)
    assert schedulable_of(status)[0] == "Unknown" and len(warnings(events)) == 1
    kube.fail = None
    status = await observe(memo, status)
    assert len(warnings(events)) == 1
    # They schedule and run: True, and nothing is posted.
    kube.pods = [pod("m-0", "Running", RUNNING), pod("m-1", "Running", RUNNING)]
    status = await observe(memo, status)
    assert schedulable_of(status) == ("True", "The scheduler refuses no member pod")
    assert len(warnings(events)) == 1
    # A new episode: a new Warning.
    kube.pods = [pod("m-0", "Running", RUNNING), pod("m-2")]
    status = await observe(memo, status)
    assert len(warnings(events)) == 2 and warnings(events)[1][2].startswith("1 of 2 member pod ")


async def test_a_healthy_group_lists_no_pods(
    world: tuple[OperatorMemo, FakeKube], events: list[Event]
) -> None:
    memo, kube = world
    kube.dep = {"replicas": 2, "ready": 2}
    kube.pods = [pod("m-0")]  # would be news, if read
    status = await observe(memo, {})
    assert kube.listed == 0 and schedulable_of(status)[0] == "True" and not warnings(events)
    # A surge pod (3 pods, 2 ready) is read.
    kube.dep = {"replicas": 3, "ready": 2}
    status = await observe(memo, status)
    assert kube.listed == 1 and schedulable_of(status)[0] == "False"


async def test_a_restarted_operator_does_not_post_the_warning_again(
    world: tuple[OperatorMemo, FakeKube], events: list[Event]
) -> None:
    memo, kube = world
    kube.pods = [pod("m-0"), pod("m-1")]
    earlier = {"conditions": [{"type": "MembersSchedulable", "status": "False"}]}
    status = await observe(memo, earlier)
    assert schedulable_of(status)[0] == "False" and not warnings(events)
