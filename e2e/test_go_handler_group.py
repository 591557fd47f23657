"""A ConsumerGroup whose handler is the Go service of examples/go, in its own image, as a
native sidecar of every member pod, on the local plane (issue 26's first "Done when").

The plane's kubelet runs the image runtime (`image`: shoal:dev, built by `make image`)
with `--pod-network`: each pod gets a network namespace of its own (as in Kubernetes), so
every member's Go handler listens on 127.0.0.1:8080 of its own pod, and the plane's
API server, NATS and etcd are forwarded into it. The handler image
(`localhost/shoal-go-handler:dev`, FROM scratch, the static binary) is built with buildah
by harness.goimage. The operator runs as a local process (as in e2e/test_image_pods.py);
the group's ledger is on, so each member records what its service answered 2xx.

Under a steady producer the group is scaled 3 -> 5, one member pod is deleted (and
replaced), then 5 -> 2; each step waits for a settled assignment. Then the stream is
drained and the ledger audited: 0 lost, 0 duplicates, 0 out of order, 0 overlaps. No
request failed (no "Handler failed" in any member's log, the dead-letter stream empty),
and the deleted pod stopped its member before its handler.

Needs root and buildah (the kubelet's image runtime, the pods' network namespaces, the
images): marked `image`, run by `make image`. Without them it fails, saying so: the
kubelet's non-root fallback (a local stand-in for the handler image, --local-image)
cannot serve this test, since without network namespaces the pods share the host's
loopback and only one of them could listen on 127.0.0.1:8080.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from harness import goimage
from harness.fleet import settled_count, wait_for_status
from harness.kubetest import condition, get_json, namespace_operator, running_plane, wait_until
from harness.localkube.plane import LocalKube
from harness.steadyload import SteadyLoad
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import audit, read_ledger
from shoal.contracts.names import (
    default_stream_name,
    dlq_stream_name,
    ledger_stream_name,
)
from shoal.group.status import GroupStatus

pytestmark = [pytest.mark.image, pytest.mark.timeout(900)]

NS = "go-handler"
GROUP = "orders"
PARTITIONS = 128
PROJECTS = 500
RATE = 400  # messages per second, for the whole test
HANDLER = "handler"  # the sidecar's name
MEMBER = "consumer"  # the member's container (shoal.operator.builders.CONTAINER_NAME)


@pytest.fixture(scope="module")
def handler_image() -> str:
    """The Go handler's image, built once per version (harness.goimage)."""
    started = time.monotonic()
    try:
        tag = goimage.build()
    except goimage.MissingBuildah as exc:
        pytest.fail(
            f"{exc}. This test runs the handler from its image in pods with network "
            "namespaces of their own (the kubelet's --pod-network), which need root; the "
            "kubelet's non-root fallback (--local-image, a local binary standing in for the "
            "image) cannot serve it: without network namespaces the pods share the host's "
            "loopback and only one handler could listen on 127.0.0.1:8080"
        )
    print(f"\n{tag} ready in {time.monotonic() - started:.1f} s")
    return tag


@pytest.fixture(scope="module")
def plane(
    image: str, handler_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalKube]:
    workdir = tmp_path_factory.mktemp("go-plane")
    with running_plane(workdir, image=image, pod_network=True) as plane:
        yield plane


@pytest.fixture(scope="module")
def operator(plane: LocalKube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with namespace_operator(plane, NS, tmp_path_factory.mktemp("go-operator")) as log_path:
        yield log_path


def group(handler_image: str) -> dict[str, Any]:
    return {
        "apiVersion": "shoal.dev/v1alpha1",
        "kind": "ConsumerGroup",
        "metadata": {"name": GROUP, "namespace": NS},
        "spec": {
            "handler": "http://127.0.0.1:8080/messages",
            "handlerReadyPath": "/healthz",
            "replicas": 3,
            "autoscaling": {"enabled": False},
            "containers": [
                {
                    "name": HANDLER,
                    "image": handler_image,
                    "args": ["-listen", "127.0.0.1:8080", "-delay", "5ms"],
                    "startupProbe": {
                        "httpGet": {"path": "/healthz", "port": 8080},
                        "periodSeconds": 1,
                        "failureThreshold": 30,
                    },
                }
            ],
            "nats": {"stream": {"ledger": True}},
        },
    }


def member_pods(plane: LocalKube) -> list[dict[str, Any]]:
    pods = get_json(plane, "pods", "-n", NS, "-l", f"app.kubernetes.io/instance={GROUP}")
    return [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]


def pid_of(pod: dict[str, Any], container: str) -> int:
    status = pod["status"]
    for item in status.get("initContainerStatuses", []) + status.get("containerStatuses", []):
        if item["name"] == container:
            return int(item["containerID"].removeprefix("process://"))
    raise AssertionError(f"no container {container} in {pod['metadata']['name']}")


def test_a_go_handler_group_scales_loses_nothing_and_fails_no_request(
    plane: LocalKube, operator: Path, handler_image: str
) -> None:
    started = time.monotonic()
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(group(handler_image)))
    wait_until(
        lambda: condition(get_json(plane, "cg", GROUP, "-n", NS), "Ready").get("status") == "True",
        180,
        "the group to become Ready",
    )
    print(f"group Ready (3 pods, each with its Go handler) in {time.monotonic() - started:.0f} s")
    pods = member_pods(plane)
    assert len(pods) == 3
    networks = set()
    for pod in pods:
        (sidecar,) = pod["spec"]["initContainers"]
        assert (sidecar["name"], sidecar["restartPolicy"]) == (HANDLER, "Always")
        handler = pid_of(pod, HANDLER)
        # The handler runs from its own image (its root is the image's overlay, its
        # program the image's /handler), in the pod's network namespace, which it shares
        # with its member and with no other pod.
        root = Path(os.readlink(f"/proc/{handler}/root"))
        assert root.is_relative_to(plane.root / "kubelet" / "pods"), root
        assert Path(f"/proc/{handler}/cmdline").read_bytes().split(b"\0")[0] == b"/handler"
        net = os.readlink(f"/proc/{handler}/ns/net")
        assert os.readlink(f"/proc/{pid_of(pod, MEMBER)}/ns/net") == net
        networks.add(net)
    assert len(networks) == 3 and os.readlink("/proc/self/ns/net") not in networks
    # With a network of its own, each member answers its probes over HTTP on the same
    # port (the chart's default on a real cluster): Ready above came from GET /readyz.
    for pod in pods:
        (member,) = [c for c in pod["spec"]["containers"] if c["name"] == MEMBER]
        # (The API server adds its defaults, scheme: HTTP among them.)
        ready, live = member["readinessProbe"]["httpGet"], member["livenessProbe"]["httpGet"]
        assert (ready["path"], ready["port"]) == ("/readyz", "health"), ready
        assert (live["path"], live["port"]) == ("/livez", "health"), live

    deleted = asyncio.run(scale_under_load(plane))
    check_logs(plane, deleted)
    plane.kubectl("delete", "cg", GROUP, "-n", NS, "--timeout=120s")
    wait_until(lambda: not member_pods(plane), 90, "the member pods to go")
    print(f"whole test {time.monotonic() - started:.0f} s")


async def scale_under_load(plane: LocalKube) -> str:
    """3 -> 5, a member pod deleted, 5 -> 2, under a steady load; then drain and audit.
    Returns the deleted pod's name."""
    etcd = Etcd(plane.state.etcd_endpoint)
    await etcd.connect(attempts=5)
    nc = await nats.connect(plane.state.nats_url)
    load = SteadyLoad(
        nc.jetstream(),
        f"shoal.{NS}.{GROUP}",
        PARTITIONS,
        rate=RATE,
        projects=PROJECTS,
        id_prefix="go",
    )
    try:
        js = nc.jetstream()
        await wait_for_status(etcd, NS, GROUP, PARTITIONS, settled_count(3), 60)
        load.start()
        t0 = time.monotonic()

        async def step(what: str, count: int, *kubectl: str) -> None:
            begun = time.monotonic()
            if kubectl:
                await asyncio.to_thread(plane.kubectl, *kubectl)
            await wait_for_status(etcd, NS, GROUP, PARTITIONS, settled_count(count), 120)
            print(
                f"{what}: settled on {count} members in {time.monotonic() - begun:.1f} s "
                f"({len(load.items)} messages published so far)"
            )

        await asyncio.sleep(5)
        patch = ["patch", "cg", GROUP, "-n", NS, "--type=merge", "-p"]
        await step("3 -> 5", 5, *patch, '{"spec": {"replicas": 5}}')
        await asyncio.sleep(5)
        victim: str = (await asyncio.to_thread(member_pods, plane))[0]["metadata"]["name"]
        begun = time.monotonic()
        await asyncio.to_thread(plane.kubectl, "delete", "pod", victim, "-n", NS)
        print(f"kubectl delete pod {victim}: returned in {time.monotonic() - begun:.1f} s")

        def replaced(s: GroupStatus) -> bool:
            return victim not in s.members and settled_count(5)(s)

        await wait_for_status(etcd, NS, GROUP, PARTITIONS, replaced, 120)
        print(f"{victim} replaced, settled on 5 in {time.monotonic() - begun:.1f} s")
        await asyncio.sleep(5)
        await step("5 -> 2", 2, *patch, '{"spec": {"replicas": 2}}')
        await asyncio.sleep(5)
        await load.stop()
        print(
            f"load stopped: {len(load.items)} messages in {time.monotonic() - t0:.0f} s "
            f"({len(load.items) / (time.monotonic() - t0):.0f}/s)"
        )

        records = await drain_and_audit(js, GROUP, [i.message_id or "" for i in load.items])
        # Every member that ever ran served some of it (the deleted one included).
        assert victim in {r.member for r in records}
        return victim
    finally:
        await load.stop()
        await nc.close()
        etcd.close()


def check_logs(plane: LocalKube, deleted: str) -> None:
    """No request failed in any member (all 6 that ran, the deleted and the scaled-down
    ones included), and the deleted pod stopped its member before its handler."""
    logs = plane.logs / "pods"
    members = sorted(logs.glob(f"{NS}_*_{MEMBER}.log"))
    assert len(members) == 6, members  # 3 + 2 scaled up + 1 replacement
    for path in members:
        text = path.read_text()
        for bad in ("Handler failed", "HttpUnavailable", "Traceback"):
            assert bad not in text, f"{path.name}: {bad}\n{text[-3000:]}"
    member_log = (logs / f"{NS}_{deleted}_{MEMBER}.log").read_text()
    assert "Leaving the group gracefully" in member_log, member_log[-3000:]
    handler_log = (logs / f"{NS}_{deleted}_{HANDLER}.log").read_text()
    assert handler_log.rstrip().endswith("stopped"), handler_log[-2000:]

    kubelet = (plane.logs / "kubelet.log").read_text().splitlines()

    def exited(container: str) -> int:
        wanted = f"Pod {NS}/{deleted} container {container} stopped (exit 0)"
        found = [i for i, line in enumerate(kubelet) if line.endswith(wanted)]
        assert len(found) == 1, (wanted, found)
        return found[0]

    assert exited(MEMBER) < exited(HANDLER), "the handler stopped before its member"


SOCKET_GROUP = "sockets"
SOCKET = "/run/handler/http.sock"


def socket_group(handler_image: str) -> dict[str, Any]:
    """The Go handler on a Unix socket in its pod (spec.handlerSocket). It has no TCP
    port, so no httpGet startupProbe: the member's handlerReadyPath, asked over the
    socket, is what waits for it."""
    return {
        "apiVersion": "shoal.dev/v1alpha1",
        "kind": "ConsumerGroup",
        "metadata": {"name": SOCKET_GROUP, "namespace": NS},
        "spec": {
            "handler": "http://localhost/messages",
            "handlerSocket": SOCKET,
            "handlerReadyPath": "/healthz",
            "replicas": 2,
            "autoscaling": {"enabled": False},
            "containers": [
                {
                    "name": HANDLER,
                    "image": handler_image,
                    "args": ["-listen", f"unix:{SOCKET}", "-delay", "5ms"],
                }
            ],
            "nats": {"stream": {"ledger": True}},
        },
    }


def test_a_go_handler_on_a_unix_socket_serves_its_group(
    plane: LocalKube, operator: Path, handler_image: str
) -> None:
    """spec.handlerSocket on the plane: the operator's emptyDir is where the sidecar
    listens and the member connects, in each pod, and nothing is lost or reordered."""
    started = time.monotonic()
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(socket_group(handler_image)))
    wait_until(
        lambda: (
            condition(get_json(plane, "cg", SOCKET_GROUP, "-n", NS), "Ready").get("status")
            == "True"
        ),
        180,
        "the group to become Ready",
    )
    print(f"socket group Ready in {time.monotonic() - started:.0f} s")
    pods = [
        p
        for p in get_json(
            plane, "pods", "-n", NS, "-l", f"app.kubernetes.io/instance={SOCKET_GROUP}"
        )["items"]
        if not p["metadata"].get("deletionTimestamp")
    ]
    assert len(pods) == 2
    for pod in pods:
        # The socket is in the pod's shared directory, as both containers see it.
        for container in (HANDLER, MEMBER):
            root = Path(f"/proc/{pid_of(pod, container)}/root")
            assert (root / SOCKET.lstrip("/")).is_socket(), (pod["metadata"]["name"], container)
    items = asyncio.run(publish_and_audit(plane, 3000))
    logs = plane.logs / "pods"
    for pod in pods:
        text = (logs / f"{NS}_{pod['metadata']['name']}_{MEMBER}.log").read_text()
        assert "Traceback" not in text and "Handler failed" not in text, text[-3000:]
    plane.kubectl("delete", "cg", SOCKET_GROUP, "-n", NS, "--timeout=120s")
    print(f"{items} messages through Unix sockets; whole test {time.monotonic() - started:.0f} s")


async def publish_and_audit(plane: LocalKube, count: int) -> int:
    nc = await nats.connect(plane.state.nats_url)
    try:
        js = nc.jetstream()
        load = SteadyLoad(
            js,
            f"shoal.{NS}.{SOCKET_GROUP}",
            PARTITIONS,
            rate=1000,
            projects=PROJECTS,
            id_prefix="sock",
        )
        load.start()

        async def published() -> int:
            return len(load.items)

        await eventually_async(
            published,
            60,
            f"{count} messages published",
            until=lambda n: n >= count,
            interval=0.2,
        )
        await load.stop()
        await drain_and_audit(js, SOCKET_GROUP, [i.message_id or "" for i in load.items])
        return len(load.items)
    finally:
        await nc.close()


async def drain_and_audit(js: Any, group: str, ids: list[str]) -> list[Any]:
    """Wait for the group to drain its stream, then audit its ledger against `ids`: 0
    lost, 0 duplicates, 0 out of order, 0 overlaps, and no dead letter. The records."""
    stream = default_stream_name(NS, group)

    async def left() -> int:
        return int((await js.stream_info(stream)).state.messages)

    await eventually_async(
        left, 120, f"{group} to drain its stream", until=lambda n: n == 0, interval=0.5
    )
    records = await read_ledger(js, ledger_stream_name(stream))
    summary = audit(records, ids).summary()
    print(f"{group}: ledger audit {summary}")
    assert summary == {
        "expected": len(ids),
        "processed": len(ids),
        "lost": 0,
        "duplicates": 0,
        "out_of_order": 0,
        "overlaps": 0,
    }, summary
    dead = int((await js.stream_info(dlq_stream_name(stream))).state.messages)
    assert dead == 0, f"{dead} dead letters"
    return records
