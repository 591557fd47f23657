"""A ConsumerGroup on the three-node local plane: spread over zones by kube-scheduler, a
node drained with `kubectl drain`, a node lost (frozen) and back (issue 25).

One plane of three nodes (localkube-a, -b, -c in zone-a, -b, -c) and one operator (a
local process) for the module. Each test runs a group of its own (6 members, the built-in
`ledger` handler, the group's ledger on) under a steady producer, and ends by draining the
stream and auditing the ledger (shoal.consumer.ledger.audit: lost, duplicates, out of
order, overlaps). Members are processes of the project's virtualenv (the process kubelet,
no image runtime), so every pod of every node shares the host's loopback: members need no
port of their own (the operator runs them without a metrics server: its
SHOAL_CONSUMER_METRICS_PORT is unset), so nothing collides.

The plane's node monitor grace period is GRACE (20 s; kube-controller-manager's default is
50 s), longer than a member lease (10 s), so the lost-node test also shows the order of
events the issue asks for: Shoal moves the node's partitions before Kubernetes even marks
the node NotReady.

Figures (durations, the longest partition gap, the most members unavailable at once, the
time to move a lost node's partitions, the audit) are printed; run with -s to see them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
from kubernetes import client, config, watch

from harness.audit import longest_gap, resumed_after
from harness.fleet import settled_count, wait_for_status
from harness.kubetest import (
    ZONE,
    component_of,
    condition,
    get_json,
    group_ready,
    kubelet_pid,
    namespace_operator,
    three_node_plane,
    wait_until,
    zones,
)
from harness.localkube.plane import LocalKube
from harness.steadyload import SteadyLoad
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import audit, read_ledger
from shoal.contracts.names import default_stream_name, ledger_stream_name
from shoal.group.config import GroupConfig
from shoal.group.status import GroupStatus
from shoal.operator.builders import selector

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NS = "group-nodes"
GRACE = 20.0  # --node-monitor-grace-period of this module's plane
TTL = int(GroupConfig.model_fields["lease_ttl"].default)  # a member's lease, 10 s
REPLICAS = 6
PARTITIONS = 48
PROJECTS = 240
RATE = 150  # messages a second, per test
INSTANCE = "app.kubernetes.io/instance"
MEMBER = "consumer"  # the member's container (shoal.operator.builders.CONTAINER_NAME)
SPREAD = {
    "maxSkew": 1,
    "topologyKey": ZONE,
    "whenUnsatisfiable": "DoNotSchedule",
    # A cordoned or tainted node's zone does not count: without this, draining zone-b's
    # only node would leave its zone at 0 members and every replacement unschedulable
    # (zone-a or zone-c at 3 would be a skew of 3), so the drain would wait forever on
    # the disruption budget.
    "nodeTaintsPolicy": "Honor",
}


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKube]:
    with three_node_plane(tmp_path_factory.mktemp("group-nodes"), GRACE) as local:
        yield local


@pytest.fixture(scope="module")
def operator(plane: LocalKube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    workdir = tmp_path_factory.mktemp("group-nodes-operator")
    with namespace_operator(plane, NS, workdir) as log_path:
        yield log_path


@pytest.fixture
def timed(request: pytest.FixtureRequest) -> Iterator[None]:
    started = time.monotonic()
    yield
    print(f"\n{request.node.name}: {time.monotonic() - started:.0f} s")


# -- the group ------------------------------------------------------------------------------


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "shoal.dev/v1alpha1",
        "kind": "ConsumerGroup",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "handler": "shoal.consumer.handlers:ledger",
            "replicas": REPLICAS,
            "partitions": PARTITIONS,
            "autoscaling": {"enabled": False},
            "nats": {"stream": {"ledger": True}},
            "topologySpreadConstraints": [SPREAD],
            **spec,
        },
    }


def member_pods(plane: LocalKube, name: str) -> list[dict[str, Any]]:
    """The group's pods that are not being deleted."""
    pods = get_json(plane, "pods", "-n", NS, "-l", f"{INSTANCE}={name}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def ready_pods(plane: LocalKube, name: str) -> list[dict[str, Any]]:
    return [p for p in member_pods(plane, name) if condition(p, "Ready").get("status") == "True"]


def per_zone(plane: LocalKube, pods: list[dict[str, Any]]) -> Counter[str]:
    zone_of = zones(plane)
    return Counter(zone_of[p["spec"]["nodeName"]] for p in pods)


def settled_on(members: set[str] | None = None, count: int = REPLICAS) -> Any:
    """`count` members (exactly `members` if given), every partition owned and claimed by
    one of them, skew <= 1."""
    return settled_count(count, members)


def settled_without(gone: set[str]) -> Any:
    """Settled on REPLICAS members, none of them in `gone`, and led. A leader that leaves
    resigns after its hand-overs, so for a moment the group is settled with no leader key
    until a member's campaign (woken by the delete) wins: a status read in that moment is
    not the end state (CI once read exactly that after a rolling update)."""
    settled = settled_on()
    return lambda s: settled(s) and not gone & set(s.members) and s.leader is not None


@contextmanager
def running_group(plane: LocalKube, name: str, **spec: Any) -> Iterator[list[dict[str, Any]]]:
    """The group applied and Ready with all its pods Running and Ready; yields the pods.
    Deleted on the way out, whatever happened, and its pods gone."""
    body = manifest(name, **spec)
    replicas = body["spec"]["replicas"]
    started = time.monotonic()
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(body))
    try:
        wait_until(lambda: group_ready(plane, NS, name), 180, f"group {name} to become Ready")
        pods = wait_until(
            lambda: (p := ready_pods(plane, name)) and len(p) == replicas and p,
            60,
            f"{replicas} member pods Ready",
        )
        print(f"\ngroup {name}: Ready with {replicas} pods in {time.monotonic() - started:.0f} s")
        yield pods
    finally:
        delete_group(plane, name)


def delete_group(plane: LocalKube, name: str) -> None:
    plane.kubectl("delete", "cg", name, "-n", NS, "--timeout=120s", check=False)
    wait_until(
        lambda: not get_json(plane, "pods", "-n", NS, "-l", f"{INSTANCE}={name}")["items"],
        120,
        f"the pods of {name} to go",
    )


# -- load and audit -------------------------------------------------------------------------


class Load(SteadyLoad):
    """The steady producer of group `name`: RATE messages a second over PROJECTS projects
    (harness.steadyload), which says what it sent when stopped."""

    def __init__(self, js: Any, name: str) -> None:
        super().__init__(
            js,
            f"shoal.{NS}.{name}",
            PARTITIONS,
            rate=RATE,
            projects=PROJECTS,
            id_prefix=name,
            report=True,
        )


async def drain_and_audit(js: Any, name: str, load: Load) -> tuple[dict[str, int], list[Any]]:
    """Wait for the group to drain its stream; the ledger's audit summary and records."""
    stream = default_stream_name(NS, name)

    async def left() -> int:
        return int((await js.stream_info(stream)).state.messages)

    await eventually_async(
        left, 120, f"{name} to drain its stream", until=lambda n: n == 0, interval=0.5
    )
    ids = [i.message_id or "" for i in load.items]
    records = await read_ledger(js, ledger_stream_name(stream))
    summary = audit(records, ids).summary()
    print(f"ledger audit of {name}: {summary}")
    return summary, records


def clean(expected: int) -> dict[str, int]:
    return {
        "expected": expected,
        "processed": expected,
        "lost": 0,
        "duplicates": 0,
        "out_of_order": 0,
        "overlaps": 0,
    }


class Clients:
    """etcd (the group's status) and NATS (load, stream, ledger) for one asyncio.run."""

    def __init__(self, plane: LocalKube) -> None:
        self.plane = plane
        self.etcd = Etcd(plane.state.etcd_endpoint)
        self.nc: Any = None

    async def __aenter__(self) -> Clients:
        await self.etcd.connect(attempts=5)
        self.nc = await nats.connect(self.plane.state.nats_url)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.nc is not None:
            await self.nc.close()
        self.etcd.close()

    @property
    def js(self) -> Any:
        return self.nc.jetstream()

    async def status(self, name: str, predicate: Any, timeout: float) -> GroupStatus:
        return await wait_for_status(self.etcd, NS, name, PARTITIONS, predicate, timeout)


# -- watching pods --------------------------------------------------------------------------


@dataclass
class PodWatch:
    """Watches the group's pods (a Kubernetes watch, in a thread) and records the most
    members unavailable at once: REPLICAS minus the pods that are Ready and not being
    deleted, as the disruption budget counts them."""

    plane: LocalKube
    name: str
    most_unavailable: int = 0
    most_deleting: int = 0  # pods being deleted (terminating) at once
    most_live: int = 0  # pods not being deleted at once
    timeline: list[tuple[float, int]] = field(default_factory=list)
    _pods: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def __enter__(self) -> PodWatch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise AssertionError("the pod watch did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _note(self, pod: Any, deleted: bool = False) -> None:
        name = pod.metadata.name
        if deleted:
            self._pods.pop(name, None)
            return
        ready = any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))
        self._pods[name] = (ready, pod.metadata.deletion_timestamp is not None)

    def _measure(self) -> None:
        available = sum(1 for ready, deleting in self._pods.values() if ready and not deleting)
        unavailable = max(0, REPLICAS - available)
        if not self.timeline or self.timeline[-1][1] != unavailable:
            self.timeline.append((time.monotonic(), unavailable))
        self.most_unavailable = max(self.most_unavailable, unavailable)
        deleting = sum(1 for _, d in self._pods.values() if d)
        self.most_deleting = max(self.most_deleting, deleting)
        self.most_live = max(self.most_live, len(self._pods) - deleting)

    def _run(self) -> None:
        try:
            api = client.CoreV1Api(
                config.new_client_from_config(config_file=str(self.plane.kubeconfig_path))
            )
            selector = f"{INSTANCE}={self.name}"
            while not self._stop.is_set():
                listed = api.list_namespaced_pod(NS, label_selector=selector)
                self._pods.clear()
                for pod in listed.items:
                    self._note(pod)
                self._measure()
                self._ready.set()
                stream = watch.Watch().stream(
                    api.list_namespaced_pod,
                    NS,
                    label_selector=selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=5,
                )
                for event in stream:
                    self._note(event["object"], deleted=event["type"] == "DELETED")
                    self._measure()
                    if self._stop.is_set():
                        return
        except BaseException as exc:  # reported by the test
            self.error = exc
            self._ready.set()


# -- node helpers ---------------------------------------------------------------------------


def container_pids(plane: LocalKube, node: str, pods: list[dict[str, Any]]) -> dict[str, int]:
    """pod name -> the pid of its member container, from that node's kubelet state (each
    container's process leads a process group of its own)."""
    pid_dir = plane.root / component_of(plane, node) / "pids"
    found = {}
    for pod in pods:
        path = pid_dir / f"{pod['metadata']['uid']}_{MEMBER}.pid"
        found[pod["metadata"]["name"]] = int(path.read_text())
    return found


def member_log(plane: LocalKube, node: str, pod: str) -> str:
    component = next(n for n in plane.nodes if n.name == node)
    return (plane.logs / component.pod_logs / f"{NS}_{pod}_{MEMBER}.log").read_text()


# -- the tests ------------------------------------------------------------------------------


def test_six_members_spread_two_per_zone_by_the_scheduler(
    plane: LocalKube, operator: Path, timed: None
) -> None:
    """spec.topologySpreadConstraints (maxSkew 1 over zones) on a group of 6: kube-scheduler
    puts 2 members in each zone (read from the pods' spec.nodeName and the nodes' zone
    labels), and all 6 consume a steady load, every message once and in order."""
    name = "spread"
    with running_group(plane, name) as pods:
        placed = per_zone(plane, pods)
        print(f"members per zone: {dict(sorted(placed.items()))}")
        assert placed == {"zone-a": 2, "zone-b": 2, "zone-c": 2}, placed
        # The operator rendered the constraint (with the group's selector), and
        # kube-scheduler placed every pod: its Scheduled events, one per pod.
        template = get_json(plane, "deployment", f"{name}-consumer", "-n", NS)["spec"]["template"]
        (rendered,) = template["spec"]["topologySpreadConstraints"]
        assert rendered["labelSelector"]["matchLabels"] == selector(name)
        events = get_json(plane, "events", "-n", NS, "--field-selector", "reason=Scheduled")
        scheduled = {
            e["involvedObject"]["name"]
            for e in events["items"]
            if "default-scheduler" in (e.get("reportingComponent"), e["source"].get("component"))
        }
        assert {p["metadata"]["name"] for p in pods} <= scheduled
        asyncio.run(steady_load_only(plane, name, {p["metadata"]["name"] for p in pods}))


async def steady_load_only(plane: LocalKube, name: str, members: set[str]) -> None:
    """10 s of steady load on a settled group; the ledger audited clean, and every member
    consumed some of it."""
    async with Clients(plane) as c:
        await c.status(name, settled_on(members, len(members)), 60)
        load = Load(c.js, name)
        load.start()
        try:
            await asyncio.sleep(10)
        finally:
            await load.stop()
        summary, records = await drain_and_audit(c.js, name, load)
        assert summary == clean(len(load.items)), summary
        served = Counter(r.member for r in records)
        print(f"records per member: {dict(sorted(served.items()))}")
        assert set(served) == members  # every member consumed


def test_drain_of_the_leaders_node_holds_the_budget_and_loses_nothing(
    plane: LocalKube, operator: Path, timed: None
) -> None:
    """`kubectl drain` of the node running the leader and one more member, under a steady
    load. A pod watch records how many members are unavailable (not Ready, or being
    deleted) at once: never more than the budget's maxUnavailable (1), so the second
    eviction waits for the first member's replacement. The evicted members leave
    gracefully (their partitions handed over, not expired), the group settles on 6
    members on the two remaining nodes (3 + 3) and is Ready; the ledger shows nothing
    lost, duplicated or out of order. Prints the longest time any partition went without
    processing during the drain."""
    name = "drained"
    with running_group(plane, name):
        asyncio.run(drain_under_load(plane, name))


async def drain_under_load(plane: LocalKube, name: str) -> None:
    async with Clients(plane) as c:
        before = await c.status(name, settled_on(), 60)
        assert before.leader is not None
        pods = {p["metadata"]["name"]: p for p in member_pods(plane, name)}
        node = pods[before.leader]["spec"]["nodeName"]
        evicted = {n for n, p in pods.items() if p["spec"]["nodeName"] == node}
        assert len(evicted) == 2 and before.leader in evicted, (node, evicted)
        budget = get_json(plane, "pdb", f"{name}-consumer", "-n", NS)
        max_unavailable = budget["spec"]["maxUnavailable"]
        assert max_unavailable == 1
        await eventually_async(
            lambda: asyncio.to_thread(
                lambda: get_json(plane, "pdb", f"{name}-consumer", "-n", NS)["status"].get(
                    "disruptionsAllowed"
                )
            ),
            30,
            "the budget to allow a disruption",
            until=lambda n: n == 1,
            interval=0.5,
        )
        print(f"draining {node}: leader {before.leader}, members {sorted(evicted)}")

        load = Load(c.js, name)
        load.start()
        try:
            await asyncio.sleep(5)
            with PodWatch(plane, name) as pods_watch:
                t0, wall0 = time.monotonic(), time.time()
                try:
                    drained = await asyncio.to_thread(
                        plane.kubectl,
                        "drain",
                        node,
                        "--ignore-daemonsets",
                        "--delete-emptydir-data",
                        "--timeout=180s",
                    )
                    took = time.monotonic() - t0
                    print(f"kubectl drain {node}: {took:.1f} s\n{drained.stdout}{drained.stderr}")
                    # Then the group settles on 6 members again, on the other nodes.
                    after = await c.status(name, settled_without(evicted), 120)
                    wall1 = time.time()
                    settled_s = time.monotonic() - t0
                finally:
                    await asyncio.to_thread(plane.kubectl, "uncordon", node, check=False)
            assert pods_watch.error is None, pods_watch.error
            timeline = [(round(t - t0, 1), n) for t, n in pods_watch.timeline]
            print(
                f"most members unavailable at once: {pods_watch.most_unavailable} "
                f"(budget maxUnavailable {max_unavailable}); timeline (s, unavailable): "
                f"{timeline}"
            )
            await asyncio.sleep(5)
        finally:
            await load.stop()
        assert all(f"pod/{n} evicted" in drained.stdout for n in evicted), drained.stdout
        # Two members on the node behind a budget of one: the second eviction waited.
        assert "Cannot evict pod as it would violate the pod's disruption budget" in (
            drained.stderr + drained.stdout
        )
        assert pods_watch.most_unavailable <= max_unavailable, timeline
        assert after.leader is not None and after.leader not in evicted

        summary, records = await drain_and_audit(c.js, name, load)
        gap, partition = longest_gap(records, wall0, wall1)
        # For scale: the same measure over the 4 s before the drain (a partition gets a
        # message every ~0.3 s on average, in bursts of the producer's 0.1 s batches).
        quiet, _ = longest_gap(records, wall0 - 4, wall0)
        print(
            f"drain: settled on 6 members {settled_s:.1f} s after it began; longest gap of "
            f"any partition during it {gap:.2f} s (partition {partition}; {quiet:.2f} s in "
            "the 4 s before it)"
        )
        assert summary == clean(len(load.items)), summary
        assert gap < 60, gap  # a generous bound: a hand-over takes a second or two
        # Evicted members handed over gracefully: they left the group.
        for pod in evicted:
            text = member_log(plane, node, pod)
            assert "Leaving the group gracefully" in text, text[-3000:]
            assert "Stopped" in text and "not released in time" not in text, text[-3000:]

    # Ready again, six pods on the two remaining nodes, none on the drained one.
    wait_until(lambda: group_ready(plane, NS, name), 60, "the group Ready again")
    pods_after = ready_pods(plane, name)
    assert len(pods_after) == REPLICAS
    assert node not in {p["spec"]["nodeName"] for p in pods_after}
    placed = per_zone(plane, pods_after)
    print(f"members per zone after the drain: {dict(sorted(placed.items()))}")
    assert sum(placed.values()) == REPLICAS and len(placed) == 2, placed


# -- a node lost ----------------------------------------------------------------------------

FROZEN = 60.0  # seconds the node stays frozen (the issue says 3 minutes; see the test)
EVICT_AFTER = 5  # the members' tolerationSeconds for an unreachable or not-ready node
UNREACHABLE = "node.kubernetes.io/unreachable"
NOT_READY = "node.kubernetes.io/not-ready"


def node_state(plane: LocalKube, node: str) -> tuple[str, set[tuple[str, str]]]:
    """The node's Ready status and its taints (key, effect)."""
    obj = get_json(plane, "node", node)
    taints = {(t["key"], t["effect"]) for t in obj["spec"].get("taints", [])}
    return condition(obj, "Ready").get("status", ""), taints


def test_a_lost_node_moves_its_partitions_within_the_lease_then_kubernetes_follows(
    plane: LocalKube, operator: Path, timed: None
) -> None:
    """The node running the group's leader is lost: its kubelet and its two members are
    frozen (SIGSTOP) for FROZEN seconds, then resumed. The issue says 3 minutes; this
    freezes 60 s, to keep the file's runtime reasonable: by then every step on Kubernetes'
    side has happened (NotReady at ~GRACE, taint, eviction EVICT_AFTER s later,
    replacements Running and joined), and a longer freeze changes nothing for the members,
    whose leases expired within TTL seconds either way.

    The members tolerate the unreachable and not-ready taints for EVICT_AFTER seconds
    (spec.nodeLossTolerationSeconds, 30 by default; Kubernetes' own default is 300 s), so
    the lost node's pods are evicted and replaced while it is frozen; when it resumes,
    its kubelet stops them."""
    name = "lost"
    with running_group(plane, name, nodeLossTolerationSeconds=EVICT_AFTER) as pods:
        # The operator's tolerations, and so not the 300 s of DefaultTolerationSeconds.
        for pod in pods:
            by_key = {t.get("key"): t for t in pod["spec"]["tolerations"]}
            for key in (UNREACHABLE, NOT_READY):
                assert by_key[key]["tolerationSeconds"] == EVICT_AFTER, by_key
                assert by_key[key]["effect"] == "NoExecute", by_key
        asyncio.run(lose_a_node(plane, name))


async def lose_a_node(plane: LocalKube, name: str) -> None:
    async with Clients(plane) as c:
        before = await c.status(name, settled_on(), 60)
        assert before.leader is not None
        pods = member_pods(plane, name)
        node = next(p["spec"]["nodeName"] for p in pods if p["metadata"]["name"] == before.leader)
        on_node = [p for p in pods if p["spec"]["nodeName"] == node]
        frozen = {p["metadata"]["name"] for p in on_node}
        assert len(frozen) == 2, frozen
        others = set(before.members) - frozen
        their_partitions = {p for p, m in before.owners.items() if m in frozen}
        kubelet = kubelet_pid(plane, node)
        members = container_pids(plane, node, on_node)
        print(f"losing {node}: leader {before.leader}, members {sorted(frozen)}")

        def moved(s: GroupStatus) -> bool:
            return (
                len(s.owners) == PARTITIONS
                and not s.unowned
                and s.claims == s.owners
                and not frozen & set(s.owners.values())
                and not frozen & set(s.members)
                and s.leader not in frozen
            )

        load = Load(c.js, name)
        load.start()
        try:
            await asyncio.sleep(5)
            try:
                os.kill(kubelet, signal.SIGSTOP)
                for pid in members.values():
                    os.killpg(pid, signal.SIGSTOP)
                t0, wall0 = time.monotonic(), time.time()
                after_move = await c.status(name, moved, TTL + 30)
                moved_s = time.monotonic() - t0

                def silent() -> bool:
                    ready, taints = node_state(plane, node)
                    return ready == "Unknown" and (UNREACHABLE, "NoExecute") in taints

                await asyncio.to_thread(
                    wait_until, silent, GRACE + 30, f"{node} NotReady, tainted unreachable"
                )
                not_ready_s = time.monotonic() - t0

                def evicted() -> bool:
                    pods = get_json(plane, "pods", "-n", NS, "-l", f"{INSTANCE}={name}")
                    deleting = {
                        p["metadata"]["name"]
                        for p in pods["items"]
                        if p["metadata"].get("deletionTimestamp")
                    }
                    return frozen <= deleting

                await asyncio.to_thread(
                    wait_until, evicted, EVICT_AFTER + 30, "the lost node's pods evicted"
                )
                evicted_s = time.monotonic() - t0
                replaced = await c.status(
                    name, lambda s: settled_on()(s) and not frozen & set(s.members), 120
                )
                replaced_s = time.monotonic() - t0
                offsets = {pod: len(member_log(plane, node, pod)) for pod in frozen}
                await asyncio.sleep(max(0.0, FROZEN - (time.monotonic() - t0)))
            finally:
                # Whatever happened, nothing stays frozen (a process may be gone already).
                for pid in members.values():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGCONT)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(kubelet, signal.SIGCONT)
            wall_resumed = time.time()
            print(
                f"{node} frozen {time.monotonic() - t0:.0f} s: its partitions moved after "
                f"{moved_s:.1f} s (lease TTL {TTL} s; new leader {after_move.leader}); "
                f"NotReady and tainted after {not_ready_s:.1f} s (grace {GRACE:g} s); its "
                f"pods evicted after {evicted_s:.1f} s; 6 members again after "
                f"{replaced_s:.1f} s ({sorted(set(replaced.members) - others)} new)"
            )
            resumed = time.monotonic()
            # Back: the kubelet stops the evicted pods (their members fenced, so they
            # consume nothing on the way out) and deletes them; the node is Ready again.
            await asyncio.to_thread(
                wait_until,
                lambda: (
                    not frozen
                    & {
                        p["metadata"]["name"]
                        for p in get_json(plane, "pods", "-n", NS, "-l", f"{INSTANCE}={name}")[
                            "items"
                        ]
                    }
                ),
                60,
                "the lost node's pods to go",
            )
            await asyncio.to_thread(
                wait_until,
                lambda: node_state(plane, node) == ("True", set()),
                60,
                f"{node} Ready again, untainted",
            )
            final = await c.status(
                name, lambda s: settled_on()(s) and not frozen & set(s.members), 60
            )
            print(
                "after SIGCONT: pods gone, node Ready, group settled in "
                f"{time.monotonic() - resumed:.1f} s"
            )
            await asyncio.sleep(5)
        finally:
            await load.stop()

        summary, records = await drain_and_audit(c.js, name, load)
        gap, partition = longest_gap(records, wall0, wall_resumed)
        late, _ = resumed_after(records, wall0, their_partitions)
        # Fenced: nothing the frozen members had started before the freeze was recorded
        # after it (what they record after SIGCONT, once re-joined, the overlap check
        # covers).
        after_resume = [r for r in records if r.member in frozen and r.started < wall0 < r.finished]
        rejoined = Counter(r.member for r in records if r.member in frozen and r.started > wall0)
        print(
            f"lost node: longest gap of any partition while frozen {gap:.2f} s (partition "
            f"{partition}); the lost node's partitions consumed again {late:.1f} s after the "
            f"freeze; records by the frozen members after SIGCONT: {dict(rejoined)}"
        )
        for pod in frozen:
            text = member_log(plane, node, pod)[offsets[pod] :]
            print(f"{pod} after SIGCONT:\n{text[-1500:]}")

    assert moved_s <= TTL + 5, f"the lost node's partitions moved after {moved_s:.1f} s"
    assert summary["lost"] == 0 and summary["overlaps"] == 0, summary
    assert summary["out_of_order"] == 0, summary
    assert not after_resume, after_resume[:5]
    assert final.leader not in frozen


# -- placement by node selector --------------------------------------------------------------


def test_a_node_selector_naming_one_zone_puts_every_member_there(
    plane: LocalKube, operator: Path, timed: None
) -> None:
    """spec.nodeSelector naming zone-b: kube-scheduler puts all 3 members on localkube-b,
    and they consume a steady load (audited)."""
    name = "zoned"
    with running_group(
        plane, name, replicas=3, nodeSelector={ZONE: "zone-b"}, topologySpreadConstraints=[]
    ) as pods:
        nodes = Counter(p["spec"]["nodeName"] for p in pods)
        print(f"members per node: {dict(nodes)}")
        assert nodes == {"localkube-b": 3}, nodes
        asyncio.run(steady_load_only(plane, name, {p["metadata"]["name"] for p in pods}))


def test_an_unsatisfiable_affinity_leaves_the_members_pending_and_the_group_says_why(
    plane: LocalKube, operator: Path, timed: None
) -> None:
    """A required node affinity for a zone no node is in: the scheduler leaves every member
    Pending (PodScheduled False, Unschedulable, with its reason), and the ConsumerGroup
    says why: its MembersSchedulable condition is False (reason Unschedulable) quoting the
    scheduler, its Ready condition (MembersUnschedulable) too, and one Warning Event
    MembersUnschedulable says it, all shown by `kubectl describe cg`. Then the affinity
    names zone-a: the pods are placed, the condition turns True, and no second Warning
    follows (the operator posts one per episode, not one per observation)."""
    name = "nowhere"
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": ZONE, "operator": "In", "values": ["zone-x"]}]}
                ]
            }
        }
    }
    body = manifest(name, replicas=2, affinity=affinity, topologySpreadConstraints=[])
    started = time.monotonic()
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(body))
    try:

        def pending() -> list[dict[str, Any]] | None:
            pods = member_pods(plane, name)
            unschedulable = [
                p
                for p in pods
                if p["status"].get("phase") == "Pending"
                and condition(p, "PodScheduled").get("reason") == "Unschedulable"
            ]
            return unschedulable if len(unschedulable) == 2 else None

        pods = wait_until(pending, 60, "2 member pods Pending, Unschedulable")
        for pod in pods:
            assert not pod["spec"].get("nodeName")
            message = condition(pod, "PodScheduled")["message"]
            assert "didn't match Pod's node affinity/selector" in message, message
        print(f"the scheduler says: {message}")

        def refused() -> dict[str, Any] | None:
            # Both pods: an observation between the scheduler's two refusals says "1 of 2".
            found = condition(get_json(plane, "cg", name, "-n", NS), "MembersSchedulable")
            both = found.get("message", "").startswith("2 of 2 ")
            return found if found.get("status") == "False" and both else None

        schedulable = wait_until(refused, 30, "MembersSchedulable False")
        print(f"the group's MembersSchedulable condition after {time.monotonic() - started:.1f} s")
        print(json.dumps(schedulable, indent=2))
        assert schedulable["reason"] == "Unschedulable", schedulable
        said = schedulable["message"]
        assert said.startswith("2 of 2 member pods cannot be scheduled: 0/3 nodes are available")
        assert "didn't match Pod's node affinity/selector" in said, said
        ready = condition(get_json(plane, "cg", name, "-n", NS), "Ready")
        print(f"the group's Ready condition: {json.dumps(ready, indent=2)}")
        assert (ready["status"], ready["reason"]) == ("False", "MembersUnschedulable"), ready
        assert ready["message"] == f"0 of 2 members ready; {said}", ready

        (warning,) = wait_until(
            lambda: group_events(plane, name, "MembersUnschedulable"), 30, "the Warning Event"
        )
        # Its words are those of the observation that began the episode (which may have
        # seen one pod refused, before the scheduler had looked at the other).
        assert warning["type"] == "Warning", warning
        assert "member pods cannot be scheduled: 0/3 nodes" in warning["message"] or (
            "member pod cannot be scheduled: 0/3 nodes" in warning["message"]
        ), warning
        assert "didn't match Pod's node affinity/selector" in warning["message"], warning
        described = plane.kubectl("describe", "cg", name, "-n", NS).stdout
        print(f"kubectl describe cg {name}:\n{described}")
        conditions_part, events_part = described.split("\nEvents:", 1)
        assert "Type:                  MembersSchedulable" in conditions_part, described
        assert re.search(r"Warning\s+MembersUnschedulable\s", events_part), described

        # A zone that exists: the Deployment replaces the pods, the scheduler places them.
        fixed = json.loads(json.dumps(affinity).replace("zone-x", "zone-a"))
        patch = {"spec": {"affinity": fixed}}
        plane.kubectl("patch", "cg", name, "-n", NS, "--type=merge", "-p", json.dumps(patch))

        def placed() -> dict[str, Any] | None:
            found = condition(get_json(plane, "cg", name, "-n", NS), "MembersSchedulable")
            return found if found.get("status") == "True" else None

        schedulable = wait_until(placed, 90, "MembersSchedulable True")
        print(f"after the patch: {json.dumps(schedulable, indent=2)}")
        nodes = {p["spec"].get("nodeName") for p in member_pods(plane, name)}
        assert nodes <= {"localkube-a", None}, nodes
        # The operator observed the group at least once between the Warning and now (the
        # condition changed): still exactly the one Warning.
        again = group_events(plane, name, "MembersUnschedulable")
        assert [e["message"] for e in again] == [warning["message"]], again
    finally:
        delete_group(plane, name)


def group_events(plane: LocalKube, name: str, reason: str) -> list[dict[str, Any]]:
    """The Events about ConsumerGroup `name` with that reason, as `kubectl get events` has
    them. kopf posts each Event as an object of its own, so a repeat would be a second one
    (or a count above 1, if the API server aggregated them)."""
    selector = f"involvedObject.kind=ConsumerGroup,involvedObject.name={name},reason={reason}"
    found = get_json(plane, "events", "-n", NS, "--field-selector", selector)["items"]
    return [e for e in found for _ in range(int(e.get("count") or 1))]


# -- a rolling update -----------------------------------------------------------------------


def test_a_rolling_update_across_the_nodes_replaces_one_member_at_a_time(
    plane: LocalKube, operator: Path, timed: None
) -> None:
    """`kubectl patch cg` changing an env value of the members, under a steady load: the
    Deployment (maxSurge 1, maxUnavailable 0) replaces the 6 members over the 3 nodes one
    at a time, each hand-over graceful: 0 lost, 0 duplicates, 0 out of order.

    "One at a time", as a pod watch sees it: never more than one new member beside the 6
    (7 pods not being deleted at most), and no member unavailable (at most 1, for a
    readiness blip on a loaded machine). Old members still leaving may overlap: the next
    old pod is deleted as soon as the next new one is Ready, which can be before the
    previous old one has finished leaving; the most seen at once is printed."""
    name = "rolled"
    with running_group(plane, name) as pods:
        asyncio.run(roll_under_load(plane, name, {p["metadata"]["name"] for p in pods}))


async def roll_under_load(plane: LocalKube, name: str, old: set[str]) -> None:
    async with Clients(plane) as c:
        await c.status(name, settled_on(old), 60)
        load = Load(c.js, name)
        load.start()
        try:
            await asyncio.sleep(5)
            with PodWatch(plane, name) as pods_watch:
                t0, wall0 = time.monotonic(), time.time()
                patch = {"spec": {"env": [{"name": "SHOAL_ROLLED", "value": "1"}]}}
                await asyncio.to_thread(
                    plane.kubectl,
                    "patch",
                    "cg",
                    name,
                    "-n",
                    NS,
                    "--type=merge",
                    "-p",
                    json.dumps(patch),
                )
                after = await c.status(name, settled_without(old), 240)
                rolled_s = time.monotonic() - t0
                wall1 = time.time()
            assert pods_watch.error is None, pods_watch.error
            await asyncio.sleep(5)
        finally:
            await load.stop()
        print(
            f"rolled 6 members in {rolled_s:.1f} s; most pods at once: {pods_watch.most_live} "
            f"live, {pods_watch.most_deleting} being deleted; most members unavailable at "
            f"once {pods_watch.most_unavailable}"
        )
        summary, records = await drain_and_audit(c.js, name, load)
        gap, partition = longest_gap(records, wall0, wall1)
        print(f"rolling update: longest gap of any partition {gap:.2f} s (partition {partition})")
        assert summary == clean(len(load.items)), summary
        # The Deployment keeps its ReplicaSets' replicas within REPLICAS + maxSurge (1), but
        # the pods lag those counts: when it moves one replica from the old ReplicaSet to the
        # new one, the new ReplicaSet's create can land before the old one's delete, so one
        # more pod than the surge can be seen for a moment (CI saw 8 once). Two over is
        # never right.
        assert pods_watch.most_live <= REPLICAS + 2, pods_watch.most_live
        assert pods_watch.most_unavailable <= 1, pods_watch.timeline
        assert after.leader is not None

    pods = ready_pods(plane, name)
    assert len(pods) == REPLICAS and not old & {p["metadata"]["name"] for p in pods}
    for pod in pods:
        (member,) = [c for c in pod["spec"]["containers"] if c["name"] == MEMBER]
        assert {"name": "SHOAL_ROLLED", "value": "1"} in member["env"]
    placed = per_zone(plane, pods)
    # Printed, not asserted: the scheduler keeps maxSkew 1 as each new pod is placed, but
    # which old pod the ReplicaSet removes next is its own choice, so the new pods alone
    # need not end up 2 per zone.
    print(f"members per zone after the rolling update: {dict(sorted(placed.items()))}")
