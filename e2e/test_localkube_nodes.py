"""The local plane with three nodes: kube-scheduler places pods, kubectl drains a node, and
the node lifecycle controller notices a silent one (issue 25, first slice).

One plane of three nodes (localkube-a, -b, -c in zone-a, -b, -c) for the module, with a
node monitor grace period of 8 s (kube-controller-manager's default is 50 s), so a frozen
kubelet turns NotReady within seconds. Each test leaves every node schedulable and Ready.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.kubetest import (
    ZONE,
    condition,
    create_namespace,
    get_json,
    kubelet_pid,
    three_node_plane,
    wait_until,
    zones,
)
from harness.localkube.plane import LocalKube

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

NODES = ["localkube-a", "localkube-b", "localkube-c"]
GRACE = 8.0  # --node-monitor-grace-period for this module's plane

# Runs until SIGTERM; says where it runs.
WORKER = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "print('worker', os.environ['POD'], 'on', os.environ['NODE'], flush=True)\n"
    "while True: time.sleep(0.5)\n"
)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKube]:
    with three_node_plane(tmp_path_factory.mktemp("nodes"), GRACE) as local:
        yield local


def apply(plane: LocalKube, *items: dict[str, Any]) -> None:
    body = {"apiVersion": "v1", "kind": "List", "items": list(items)}
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(body))


def spread_deployment(
    name: str, namespace: str, replicas: int, ready_after: int = 0
) -> dict[str, Any]:
    """`replicas` workers spread over zones at most 1 apart; a cordoned node's zone does
    not count (nodeTaintsPolicy Honor: its unschedulable taint excludes it). ready_after:
    seconds after its start before a worker is Ready."""
    labels = {"app": name}
    probe = {"exec": {"command": ["true"]}, "initialDelaySeconds": ready_after, "periodSeconds": 1}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": ZONE,
                            "whenUnsatisfiable": "DoNotSchedule",
                            "nodeTaintsPolicy": "Honor",
                            "labelSelector": {"matchLabels": labels},
                        }
                    ],
                    "containers": [
                        {
                            "name": "main",
                            "image": "shoal:dev",
                            "command": ["python", "-c", WORKER],
                            **({"readinessProbe": probe} if ready_after else {}),
                            "env": [
                                {
                                    "name": "POD",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                },
                                {
                                    "name": "NODE",
                                    "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                                },
                            ],
                        }
                    ],
                },
            },
        },
    }


def running_pods(plane: LocalKube, namespace: str, selector: str) -> list[dict[str, Any]]:
    pods = get_json(plane, "pods", "-n", namespace, "-l", selector)["items"]
    return [
        p
        for p in pods
        if p["status"].get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
        and condition(p, "Ready").get("status") == "True"
    ]


def all_running(
    plane: LocalKube, namespace: str, selector: str, count: int
) -> list[dict[str, Any]] | None:
    """The pods, once `count` of them are Running and Ready."""
    pods = running_pods(plane, namespace, selector)
    return pods if len(pods) == count else None


def test_nodes_register_with_zones_ready_and_as_nodes(plane: LocalKube) -> None:
    nodes = {n["metadata"]["name"]: n for n in get_json(plane, "nodes")["items"]}
    assert sorted(nodes) == NODES
    for name, zone in zip(NODES, ["zone-a", "zone-b", "zone-c"], strict=True):
        labels = nodes[name]["metadata"]["labels"]
        assert labels[ZONE] == zone and labels["kubernetes.io/hostname"] == name
        assert condition(nodes[name], "Ready")["status"] == "True"
        assert not nodes[name]["spec"].get("taints")
        lease = get_json(plane, "lease", name, "-n", "kube-node-lease")
        assert lease["spec"]["holderIdentity"] == name
        assert lease["spec"]["leaseDurationSeconds"] == int(GRACE)
    # Each kubelet is a node to the API server (Node authorizer, NodeRestriction), not
    # an administrator: its own Node yes, another's or the cluster's Secrets no.
    config = str(plane.root / "kubelet-a.kubeconfig")

    def as_kubelet(*args: str) -> str:
        result = plane.kubectl(f"--kubeconfig={config}", *args, check=False)
        return (result.stdout + result.stderr).strip()

    assert "system:node:localkube-a" in as_kubelet("auth", "whoami")
    assert "system:nodes" in as_kubelet("auth", "whoami")
    assert "Forbidden" in as_kubelet("get", "secrets", "-A")
    assert "Forbidden" in as_kubelet(
        "label", "node", "localkube-b", "shoal.dev/touched=yes", "--overwrite"
    )
    assert "labeled" in as_kubelet(
        "label", "node", "localkube-a", "node.kubernetes.io/touched=yes", "--overwrite"
    )
    binding = ("auth", "can-i", "create", "pods", "--subresource=binding", "-n", "default")
    assert as_kubelet(*binding) == "no"  # kube-scheduler binds, not the kubelets


def test_spread_over_zones_by_the_scheduler(plane: LocalKube) -> None:
    namespace = "spread"
    create_namespace(plane, namespace)
    apply(plane, spread_deployment("spread", namespace, 6))
    started = time.monotonic()
    pods = wait_until(
        lambda: all_running(plane, namespace, "app=spread", 6),
        90,
        "6 spread pods Running and Ready",
    )
    print(f"6 pods scheduled and Ready in {time.monotonic() - started:.1f} s")
    zone_of = zones(plane)
    per_zone = Counter(zone_of[p["spec"]["nodeName"]] for p in pods)
    assert per_zone == {"zone-a": 2, "zone-b": 2, "zone-c": 2}, per_zone
    # Placed by kube-scheduler: its Scheduled events, one per pod.
    events = get_json(plane, "events", "-n", namespace, "--field-selector", "reason=Scheduled")
    scheduled = {
        e["involvedObject"]["name"]
        for e in events["items"]
        if "default-scheduler" in (e.get("reportingComponent"), e["source"].get("component"))
    }
    assert {p["metadata"]["name"] for p in pods} <= scheduled

    # Each pod runs on its node's kubelet, which serves its logs (kubectl logs goes
    # through the API server to the port that node's status names).
    def logs_of(name: str) -> str | None:
        return plane.kubectl("logs", "-n", namespace, name).stdout.strip() or None

    for pod in pods:
        name, node = pod["metadata"]["name"], pod["spec"]["nodeName"]
        logs = wait_until(functools.partial(logs_of, name), 20, f"the logs of {name}")
        assert logs == f"worker {name} on {node}"
        component = next(n for n in plane.nodes if n.name == node)
        assert (plane.logs / component.pod_logs / f"{namespace}_{name}_main.log").exists()


def test_cordon_and_drain_move_pods_through_the_budget(plane: LocalKube) -> None:
    namespace = "drain"
    create_namespace(plane, namespace)
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "work", "namespace": namespace},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "work"}}},
    }
    # Ready 3 s after they start: a replacement takes that long, so the budget refuses the
    # second eviction from the node until the first pod's replacement is Ready.
    apply(plane, spread_deployment("work", namespace, 6, ready_after=3), budget)
    wait_until(lambda: len(running_pods(plane, namespace, "app=work")) == 6, 90, "6 pods Running")
    wait_until(
        lambda: (
            get_json(plane, "pdb", "work", "-n", namespace)["status"].get("disruptionsAllowed") == 1
        ),
        30,
        "the budget to allow one disruption",
    )
    node = "localkube-b"
    on_node = {
        p["metadata"]["name"]
        for p in running_pods(plane, namespace, "app=work")
        if p["spec"]["nodeName"] == node
    }
    assert len(on_node) == 2
    try:
        plane.kubectl("cordon", node)
        assert get_json(plane, "node", node)["spec"]["unschedulable"] is True
        started = time.monotonic()
        drained = plane.kubectl(
            "drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=120s"
        )
        took = time.monotonic() - started
        print(f"drain of {node} took {took:.1f} s:\n{drained.stdout}{drained.stderr}")
        assert all(f"pod/{name} evicted" in drained.stdout for name in on_node), drained.stdout
        # Two pods behind a budget of one: the second eviction waited for a replacement.
        assert "Cannot evict pod as it would violate the pod's disruption budget" in (
            drained.stderr + drained.stdout
        )
        pods = wait_until(
            lambda: all_running(plane, namespace, "app=work", 6), 60, "6 pods Running again"
        )
        assert not on_node & {p["metadata"]["name"] for p in pods}
        zone_of = zones(plane)
        per_zone = Counter(zone_of[p["spec"]["nodeName"]] for p in pods)
        assert per_zone == {"zone-a": 3, "zone-c": 3}, per_zone
        left = get_json(plane, "pods", "-A", "--field-selector", f"spec.nodeName={node}")
        assert not left["items"], [p["metadata"]["name"] for p in left["items"]]
    finally:
        plane.kubectl("uncordon", node)
    assert not get_json(plane, "node", node)["spec"].get("unschedulable")


def test_a_silent_node_turns_not_ready_and_is_tainted(plane: LocalKube) -> None:
    """The node lifecycle controller marks a silent node NotReady, taints it and marks its
    pods NotReady; once its kubelet is back, the kubelet marks them Ready again (its
    status manager puts back the status it holds)."""
    node = "localkube-c"
    pid = kubelet_pid(plane, node)
    namespace = "silent"
    create_namespace(plane, namespace)
    probe = {"exec": {"command": ["true"]}, "periodSeconds": 1}
    main = {"name": "main", "image": "shoal:dev", "command": ["python", "-c", WORKER]}
    env = [{"name": name, "value": name.lower()} for name in ("POD", "NODE")]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "on-c", "namespace": namespace},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 1,
            "containers": [{**main, "env": env, "readinessProbe": probe}],
        },
    }
    apply(plane, pod)

    def pod_ready() -> str:
        obj = get_json(plane, "pod", "on-c", "-n", namespace)
        return str(condition(obj, "Ready").get("status"))

    wait_until(lambda: pod_ready() == "True", 60, "the pod on the node to be Ready")
    # What the node lifecycle controller puts on a node whose Ready turns Unknown: the
    # scheduler's NoSchedule taint and the NoExecute one that evicts pods.
    unreachable = [
        {"key": "node.kubernetes.io/unreachable", "effect": effect}
        for effect in ("NoSchedule", "NoExecute")
    ]

    def state() -> tuple[str, list[dict[str, str]]]:
        obj = get_json(plane, "node", node)
        taints = [{"key": t["key"], "effect": t["effect"]} for t in obj["spec"].get("taints", [])]
        return condition(obj, "Ready").get("status", ""), taints

    def silent() -> bool:
        ready, taints = state()
        return ready == "Unknown" and all(taint in taints for taint in unreachable)

    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_until(silent, GRACE + 20, f"{node} NotReady and tainted unreachable")
        took = time.monotonic() - stopped
        print(f"{node} silent: NotReady and tainted after {took:.1f} s (grace {GRACE:g} s)")
        # The grace period after the last renewal (at most a renewal period, GRACE / 4,
        # before the freeze), plus up to a monitor period and this loop's polling.
        assert GRACE - GRACE / 4 - 0.5 <= took <= GRACE + 8, took
        others = [n for n in get_json(plane, "nodes")["items"] if n["metadata"]["name"] != node]
        assert all(condition(n, "Ready")["status"] == "True" for n in others)
        wait_until(lambda: pod_ready() == "False", 15, "its pod to be marked NotReady")
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    wait_until(lambda: state() == ("True", []), 30, f"{node} Ready again, untainted")
    print(f"{node} Ready and untainted {time.monotonic() - resumed:.1f} s after SIGCONT")
    try:
        wait_until(lambda: pod_ready() == "True", 15, "its pod to be Ready again")
        print(f"its pod Ready again {time.monotonic() - resumed:.1f} s after SIGCONT")
    finally:
        plane.kubectl("delete", "namespace", namespace, "--wait=false")


def test_kubelet_state_is_per_node(plane: LocalKube) -> None:
    """Each kubelet keeps its own state directory, pod logs and log server port."""
    nodes = {n["metadata"]["name"]: n for n in get_json(plane, "nodes")["items"]}
    ports = {n["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"] for n in nodes.values()}
    assert len(ports) == 3 and 0 not in ports
    for node in plane.nodes:
        assert (plane.root / node.component / "pids").is_dir()
        assert Path(plane.logs / f"{node.component}.log").exists()


def test_only_pods_that_mount_a_token_get_one(plane: LocalKube) -> None:
    """The kubelet asks for a pod's token as its kube-api-access volume does; a pod with
    automountServiceAccountToken false has none, so it gets no KUBECONFIG (NodeRestriction
    would refuse the kubelet a token for an audience no volume of the pod names)."""
    namespace = "tokens"
    create_namespace(plane, namespace)
    show = "import os; print('KUBECONFIG' in os.environ, flush=True); import time; time.sleep(60)"
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "automountServiceAccountToken": automount,
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {"name": "main", "image": "shoal:dev", "command": ["python", "-c", show]}
                ],
            },
        }
        for name, automount in (("with-token", True), ("without-token", False))
    ]
    apply(plane, *pods)

    def said(name: str) -> str | None:
        result = plane.kubectl("logs", "-n", namespace, name, check=False)
        return result.stdout.strip() or None

    assert wait_until(functools.partial(said, "with-token"), 30, "with-token's log") == "True"
    assert wait_until(functools.partial(said, "without-token"), 30, "its log") == "False"
