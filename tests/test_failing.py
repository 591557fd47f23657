"""Member pods whose containers crash-loop or cannot start: shoal.operator.failing (pure),
the conditions shoal.operator.observe makes of it, and the status timer
(reconciler.observe_group against the session's real etcd and NATS, Kubernetes a fake
that returns the pods): Degraded MembersCrashLooping with pod, container and last exit,
one Warning per episode, across an operator restart, with one pod LIST per tick.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest

from harness.kopfcalls import Event, call_handler, record_events
from shoal.contracts.names import Keys, format_time
from shoal.group.jetstream import ensure_group
from shoal.operator import reconciler
from shoal.operator.failing import (
    MAX_DETAIL,
    Failing,
    Failure,
    container_failure,
    failing,
    failing_in_status,
)
from shoal.operator.observe import Observed, conditions
from shoal.operator.scheduling import Unschedulable
from shoal.operator.state import GroupState, OperatorMemo

PORT = "cannot serve the health probes on *:8081: Address already in use"
NOW = 1_800_000_000.0


def container(
    name: str = "consumer",
    *,
    waiting: str | None = None,
    message: str | None = None,
    restarts: int = 0,
    last_exit: int | None = None,
    last_message: str | None = None,
    terminated: int | None = None,
    running_for: float | None = None,
    ready: bool = False,
) -> dict[str, Any]:
    """A container status as the API has it."""
    state: dict[str, Any]
    if waiting is not None:
        state = {"waiting": {"reason": waiting, **({"message": message} if message else {})}}
    elif terminated is not None:
        state = {"terminated": {"exitCode": terminated, "reason": "Error"}}
    elif running_for is not None:
        state = {"running": {"startedAt": format_time(NOW - running_for)}}
    else:
        state = {"waiting": {"reason": "ContainerCreating"}}
    found: dict[str, Any] = {
        "name": name,
        "ready": ready,
        "restartCount": restarts,
        "state": state,
    }
    if last_exit is not None:
        last: dict[str, Any] = {"exitCode": last_exit, "reason": "Error"}
        if last_message is not None:
            last["message"] = last_message
        found["lastState"] = {"terminated": last}
    return found


def pod(
    name: str,
    *containers: dict[str, Any],
    init: tuple[dict[str, Any], ...] = (),
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": "Running", "containerStatuses": list(containers)}
    if init:
        status["initContainerStatuses"] = list(init)
    return {"metadata": meta, "status": status}


def looping(restarts: int = 3, message: str | None = PORT) -> dict[str, Any]:
    return container(
        waiting="CrashLoopBackOff",
        message="back-off 40s restarting failed container=consumer",
        restarts=restarts,
        last_exit=1,
        last_message=message,
    )


RUNNING = container(running_for=300, ready=True)


# -- one container -----------------------------------------------------------------------------


def test_crash_loop_back_off_names_the_last_exit_and_its_message() -> None:
    assert container_failure("p", looping(), NOW) == Failure(
        "p", "consumer", "CrashLoopBackOff", f"last exit 1: {PORT}", crash=True
    )
    # Without a termination message: the exit code; OOMKilled and the like by their reason.
    plain = container_failure("p", looping(message=None), NOW)
    assert plain is not None and plain.detail == "last exit 1"
    oom = container(waiting="CrashLoopBackOff", restarts=2)
    oom["lastState"] = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    found = container_failure("p", oom, NOW)
    assert found is not None and found.detail == "last exit 137: OOMKilled"


def test_a_log_tail_gives_its_last_line_and_long_words_are_cut() -> None:
    tail = f"Traceback (most recent call last):\n  File x\n\nOSError: {PORT}\n\n"
    found = container_failure("p", looping(message=tail), NOW)
    assert found is not None and found.detail == f"last exit 1: OSError: {PORT}"
    long = container_failure("p", looping(message="why " * 500), NOW)
    assert long is not None
    assert long.detail.startswith("last exit 1: why why")
    assert len(long.detail) == len("last exit 1: ") + MAX_DETAIL and long.detail.endswith("...")


def test_cannot_start_reasons_count_at_once_with_the_kubelets_words() -> None:
    pull = container(waiting="ImagePullBackOff", message='Back-off pulling image "shoal:typo"')
    assert container_failure("p", pull, NOW) == Failure(
        "p", "consumer", "ImagePullBackOff", 'Back-off pulling image "shoal:typo"', crash=False
    )
    for reason in ("ErrImagePull", "CreateContainerConfigError", "InvalidImageName"):
        found = container_failure("p", container(waiting=reason), NOW)
        assert found is not None and found.reason == reason and not found.crash


def test_starting_and_restarting_once_are_no_failure() -> None:
    for quiet in (
        container(),  # ContainerCreating
        container(waiting="PodInitializing"),
        # Backed off after its first exit (a kubelet that backs off at once): no loop yet.
        looping(restarts=0),
        # Exited once, runs again (not ready yet): restarting once.
        container(restarts=1, last_exit=1, running_for=2),
        # Exited 0 (a completed init container), or non-zero before any restart.
        container(terminated=0, restarts=3),
        container(terminated=1),
        RUNNING,
        {},
        {"state": "garbage", "restartCount": "x"},
    ):
        assert container_failure("p", quiet, NOW) is None, quiet


def test_a_loop_between_two_crashes_is_still_a_loop() -> None:
    # Terminated non-zero after a restart: the moment before the back-off.
    found = container_failure("p", container(terminated=1, restarts=1), NOW)
    assert found is not None and (found.reason, found.detail) == ("Error", "last exit 1")
    # Running for a moment after its third start, not ready, last exit non-zero.
    between = container(restarts=3, last_exit=1, last_message=PORT, running_for=4)
    found = container_failure("p", between, NOW)
    assert found is not None and found.reason == "CrashLoopBackOff" and found.crash
    # ... but not once it has run a while, nor once it is ready.
    settled = container(restarts=3, last_exit=1, running_for=600)
    assert container_failure("p", settled, NOW) is None
    ready = container(restarts=3, last_exit=1, running_for=4, ready=True)
    assert container_failure("p", ready, NOW) is None


# -- the group's pods --------------------------------------------------------------------------


def test_pods_failing_alike_are_named_together() -> None:
    pods = [
        pod("orders-c", RUNNING),
        pod("orders-b", looping(message="other words")),
        pod("orders-a", looping()),
    ]
    found = failing(pods, NOW)
    assert found is not None and (found.pods, found.of, found.reason) == (
        2,
        3,
        "MembersCrashLooping",
    )
    assert found.message() == (
        "2 of 3 member pods crash-looping: orders-a, orders-b container consumer: "
        f"CrashLoopBackOff (last exit 1: {PORT})"
    )


def test_sidecars_and_init_containers_count_and_kinds_are_told_apart() -> None:
    handler = container("handler", waiting="CrashLoopBackOff", restarts=2, last_exit=2)
    waiting = container(waiting="PodInitializing")
    pods = [
        pod("g-0", waiting, init=(handler,)),  # Init:CrashLoopBackOff of a native sidecar
        pod("g-1", container(waiting="ImagePullBackOff", message="Back-off pulling image")),
        pod("g-2", looping(), deleting=True),  # on its way out: counts nowhere
    ]
    found = failing(pods, NOW)
    assert found is not None
    assert found.message() == (
        "2 of 2 member pods crash-looping or cannot start: g-0 container handler: "
        "CrashLoopBackOff (last exit 2); g-1 container consumer: ImagePullBackOff "
        "(Back-off pulling image)"
    )
    assert found.reason == "MembersCrashLooping"
    pull = failing([pod("g-1", container(waiting="ErrImagePull"))], NOW)
    assert pull is not None and pull.reason == "MembersCannotStart"
    assert pull.message() == "1 of 1 member pod cannot start: g-1 container consumer: ErrImagePull"


def test_many_pods_and_failures_keep_the_message_short() -> None:
    pods = [pod(f"g-{i:02}", looping()) for i in range(40)]
    config = "CreateContainerConfigError"
    pods += [pod(f"h-{i}", container(f"c{i}", waiting=config)) for i in range(5)]
    found = failing(pods, NOW)
    assert found is not None
    message = found.message()
    assert message.startswith(
        "45 of 45 member pods crash-looping or cannot start: g-00, g-01, g-02 and 37 more "
        "container consumer: CrashLoopBackOff"
    )
    assert message.endswith("(and 3 other failures: kubectl describe pod)")
    assert len(message) < 1000


def test_nothing_failing_says_nothing() -> None:
    assert failing([], NOW) is None
    assert failing([pod("g-0", RUNNING), pod("g-1", container()), {}, {"status": 3}], NOW) is None


def test_an_earlier_operator_said_so_in_the_status() -> None:
    def said(kind: str, reason: str) -> dict[str, Any]:
        return {"conditions": [{"type": "Ready", "reason": "x"}, {"type": kind, "reason": reason}]}

    assert failing_in_status(said("Degraded", "MembersCrashLooping"))
    assert failing_in_status(said("Ready", "MembersCannotStart"))
    assert not failing_in_status(said("Degraded", "AsExpected"))
    assert not failing_in_status({}) and not failing_in_status(None)
    assert not failing_in_status({"conditions": ["garbage", 3]})


# -- the conditions ---------------------------------------------------------------------------


def observed(**changes: Any) -> Observed:
    """A group of 3 whose pods are not ready; `changes` on top."""
    waiting = Observed(
        generation=3,
        spec_replicas=3,
        replicas=3,
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


LOOP = Failing(
    failures=(Failure("orders-abc", "consumer", "CrashLoopBackOff", f"last exit 1: {PORT}", True),),
    of=3,
)
TOLD = (
    "1 of 3 member pod crash-looping: orders-abc container consumer: CrashLoopBackOff "
    f"(last exit 1: {PORT})"
)


def test_a_crash_loop_makes_the_group_degraded_and_says_why_everywhere() -> None:
    c = by_type(observed(failing=LOOP))
    assert c["Degraded"] == {
        "type": "Degraded",
        "status": "True",
        "reason": "MembersCrashLooping",
        "message": TOLD,
        "observedGeneration": 3,
    }
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "MembersCrashLooping")
    assert c["Ready"]["message"] == f"0 of 3 members ready; {TOLD}"
    # The Status column (Progressing's reason): not Reconciling.
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == (
        "False",
        "MembersCrashLooping",
    )


def test_what_comes_before_and_after_a_crash_loop() -> None:
    problem = ("EtcdUnavailable", "etcd at x unavailable")
    c = by_type(observed(failing=LOOP, problem=problem))
    assert {c[k]["reason"] for k in ("Degraded", "Ready", "Progressing")} == {"EtcdUnavailable"}
    refused = (("orders-abc", "NatsAuthFailed", "wrong password"),)
    c = by_type(observed(failing=LOOP, refused=refused))
    assert (c["Degraded"]["reason"], c["Ready"]["reason"]) == ("NatsAuthFailed", "NatsAuthFailed")
    # Ahead of stalls and of the scheduler (the pods that run crash; the others wait).
    refusing = Unschedulable(pods=1, of=3, scheduler="0/3 nodes are available")
    c = by_type(observed(failing=LOOP, stalled=((1, "m-0"),), unschedulable=refusing))
    assert c["Degraded"]["reason"] == "MembersCrashLooping"
    assert c["Ready"]["reason"] == "MembersCrashLooping"
    assert c["Progressing"]["reason"] == "MembersCrashLooping"
    assert c["MembersSchedulable"]["status"] == "False"
    # A rollout's new pod crash-loops while the 3 members run: Ready, and Degraded.
    serving = observed(
        replicas=4,
        ready_replicas=3,
        members={"m-0": 6, "m-1": 5, "m-2": 5},
        leader="m-0",
        unowned=0,
        unclaimed=0,
        failing=LOOP,
    )
    c = by_type(serving)
    assert c["Ready"]["status"] == "True" and c["Degraded"]["status"] == "True"


# -- the status timer ----------------------------------------------------------------------------


class FakeKube:
    """The Deployment's status and its pods, as the test sets them; LISTs counted."""

    def __init__(self) -> None:
        self.dep = {"replicas": 3, "ready": 1}
        self.pods: list[dict[str, Any]] = []
        self.listed = 0
        self.fail: Exception | None = None

    async def deployment_status(self, namespace: str, name: str) -> dict[str, int]:
        return dict(self.dep)

    async def exists(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        return True

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.listed += 1
        if self.fail is not None:
            raise self.fail
        return self.pods


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    return record_events(monkeypatch)


@pytest.fixture
async def world(
    monkeypatch: pytest.MonkeyPatch, etcd_endpoint: str, nats_url: str
) -> AsyncIterator[tuple[OperatorMemo, FakeKube]]:
    """A group's memo as the startup handler fills it: the session's etcd and NATS, a
    fake Kubernetes."""
    kube = FakeKube()
    monkeypatch.setattr(reconciler, "api_client", lambda: object())
    monkeypatch.setattr(reconciler, "Kube", lambda api: kube)
    monkeypatch.setenv("NATS_URL", nats_url)
    monkeypatch.setenv("ETCD_ENDPOINTS", etcd_endpoint)
    operator_memo = OperatorMemo()
    await call_handler(reconciler.startup, settings=kopf.OperatorSettings(), memo=operator_memo)
    memo = copy.copy(operator_memo)
    yield memo, kube
    if memo.group.stall_watch is not None:
        await memo.group.stall_watch.stop()
    await call_handler(reconciler.cleanup_clients, memo=operator_memo)


SPEC = {"handler": "shoal.consumer.handlers:noop", "partitions": 16, "replicas": 3}


async def observe(
    memo: OperatorMemo, namespace: str, group: str, status: dict[str, Any]
) -> dict[str, Any]:
    """One run of the status timer; the status after its patch."""
    patch = kopf.Patch()
    await call_handler(
        reconciler.observe_group,
        name=group,
        namespace=namespace,
        spec=SPEC,
        meta={"generation": 1},
        status=status,
        body=kopf.Body({"metadata": {"name": group, "namespace": namespace, "uid": "u"}}),
        memo=memo,
        patch=patch,
    )
    merged = {**status, **patch.get("status", {})}
    return {k: v for k, v in merged.items() if v is not None}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def failing_events(events: list[Event]) -> list[Event]:
    return [e for e in events if e[1] in ("MembersCrashLooping", "MembersCannotStart")]


async def test_crash_looping_members_make_the_group_degraded_once_per_episode(
    world: tuple[OperatorMemo, FakeKube],
    events: list[Event],
    js: Any,
    make_config: Any,
    etcd: Any,
    namespace: str,
    group: str,
) -> None:
    memo, kube = world
    await ensure_group(js, make_config(partitions=16))  # NATS and etcd are fine
    await etcd.put(Keys(namespace, group).member("g-a"), b'{"cpu": 0.1}')
    kube.pods = [
        pod("g-a", RUNNING),
        pod("g-b", looping()),
        pod("g-c", container(waiting="PodInitializing"), init=(looping(),)),
    ]
    kube.pods[2]["status"]["initContainerStatuses"][0]["name"] = "handler"
    status = await observe(memo, namespace, group, {})

    told = (
        "2 of 3 member pods crash-looping: g-b container consumer: CrashLoopBackOff "
        f"(last exit 1: {PORT}); g-c container handler: CrashLoopBackOff (last exit 1: {PORT})"
    )
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == (
        "True",
        "MembersCrashLooping",
        told,
    )
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "MembersCrashLooping")
    assert ready["message"] == f"1 of 3 members ready; {told}"
    assert condition(status, "Progressing")["reason"] == "MembersCrashLooping"
    assert condition(status, "MembersSchedulable")["status"] == "True"
    assert failing_events(events) == [("Warning", "MembersCrashLooping", told)]
    assert kube.listed == 1  # one LIST answers the scheduler's question and this one

    # Still looping, other pods, other words; the pods unreadable for a tick; an operator
    # restart (it reads the episode back from the status): no second Warning, and the
    # condition does not flap.
    kube.pods = [pod("g-a", RUNNING), pod("g-d", looping(message="other"))]
    status = await observe(memo, namespace, group, status)
    kube.fail = RuntimeError("connection refused")
    status = await observe(memo, namespace, group, status)
    assert condition(status, "Degraded")["reason"] == "MembersCrashLooping"
    assert "g-d" in condition(status, "Degraded")["message"]
    kube.fail = None
    if memo.group.stall_watch is not None:
        await memo.group.stall_watch.stop()
    memo.group = GroupState()  # an operator restart
    status = await observe(memo, namespace, group, status)
    assert condition(status, "Degraded")["reason"] == "MembersCrashLooping"
    assert len(failing_events(events)) == 1
    assert kube.listed == 4

    # Between two crashes (running a moment, not ready): the same episode.
    between = container(restarts=4, last_exit=1, running_for=2)
    between["state"]["running"]["startedAt"] = format_time(time.time() - 2)
    kube.pods = [pod("g-a", RUNNING), pod("g-d", between)]
    status = await observe(memo, namespace, group, status)
    assert condition(status, "Degraded")["reason"] == "MembersCrashLooping"
    assert len(failing_events(events)) == 1

    # Fixed: every pod ready, no pod read, Degraded False; nothing posted.
    kube.dep = {"replicas": 3, "ready": 3}
    status = await observe(memo, namespace, group, status)
    assert condition(status, "Degraded")["reason"] != "MembersCrashLooping"
    assert condition(status, "Degraded")["status"] == "False"
    assert len(failing_events(events)) == 1 and kube.listed == 5

    # A new episode (an image that cannot be pulled): a new Warning.
    kube.dep = {"replicas": 3, "ready": 2}
    kube.pods = [pod("g-a", RUNNING), pod("g-e", container(waiting="ImagePullBackOff"))]
    status = await observe(memo, namespace, group, status)
    assert condition(status, "Degraded")["reason"] == "MembersCannotStart"
    assert failing_events(events)[1] == (
        "Warning",
        "MembersCannotStart",
        "1 of 2 member pod cannot start: g-e container consumer: ImagePullBackOff",
    )
