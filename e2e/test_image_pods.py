"""Consumer pods run from the image on the local plane (the kubelet's image runtime).

The plane's kubelet gets `image=shoal:dev`: it mounts the image built by `make image` and
runs each pod chrooted into it, as the pod's user, in its own mount namespace. The
operator stays a process of the venv (it only writes the Deployment); the consumers it
creates must run from the image. Checked from outside the pods (/proc: uid, root,
command line, mapped files) and from inside (the same entry exec probes use), then
messages are consumed, a killed pod restarts from the image, deletion is graceful, and
`down` leaves no process, mount or buildah container behind. Marked `image`: it needs
the image (and root), so `make image` runs it after building, `make test` does not.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml

from harness import REPO_ROOT
from harness.kubetest import condition, get_json, namespace_operator, running_plane, wait_until
from harness.localkube.image import RECORD, run_inside
from harness.localkube.plane import LocalKube, alive
from harness.waiting import eventually_async
from shoal.consumer.ledger import audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER, default_stream_name, ledger_stream_name

pytestmark = [pytest.mark.image, pytest.mark.timeout(900)]

NS = "image-pods"
UID = 10001
MESSAGES = 3000
# What the pods see: the image's interpreter and virtualenv.
IMAGE_PYTHON = "/opt/shoal/bin/python3"
INSIDE = {
    "uid": UID,
    "gid": UID,
    "groups": [],
    "workdir": "/",
    "env": {"PATH": "/opt/shoal/bin:/usr/bin:/bin"},
}


@pytest.fixture(scope="module")
def plane(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKube]:
    with running_plane(tmp_path_factory.mktemp("image-plane"), image=image) as plane:
        yield plane


@pytest.fixture(scope="module")
def operator(plane: LocalKube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with namespace_operator(plane, NS, tmp_path_factory.mktemp("image-operator")) as log_path:
        yield log_path


def group(replicas: int) -> str:
    manifest = yaml.safe_load((REPO_ROOT / "examples" / "consumergroup.yaml").read_text())
    manifest["metadata"]["namespace"] = NS
    manifest["spec"]["replicas"] = replicas
    return json.dumps(manifest)


def consumer_pods(plane: LocalKube) -> list[dict[str, Any]]:
    pods = get_json(plane, "pods", "-n", NS, "-l", "app.kubernetes.io/instance=orders")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def pid_of(pod: dict[str, Any]) -> int:
    (status,) = pod["status"]["containerStatuses"]
    return int(status["containerID"].removeprefix("process://"))


def ids(pid: int) -> tuple[list[str], list[str]]:
    """(real, effective, saved, fs uids), the same for gids, from /proc."""
    lines = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return lines["Uid"].split(), lines["Gid"].split()


def inside(pid: int, *command: str) -> str:
    result = run_inside(pid, INSIDE, list(command), timeout=30)
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode().strip()


def assert_runs_from_the_image(plane: LocalKube, pid: int) -> None:
    uids, gids = ids(pid)
    assert uids == [str(UID)] * 4 and gids == [str(UID)] * 4, (uids, gids)
    # Its root is the container's overlay (assembled under the pod's directory), in which
    # the image's virtualenv exists and the checkout does not.
    root = Path(os.readlink(f"/proc/{pid}/root"))
    assert root.is_relative_to(plane.root / "kubelet" / "pods"), root
    proc_root = Path(f"/proc/{pid}/root")
    assert (proc_root / "opt/shoal/pyvenv.cfg").is_file()
    assert not (proc_root / str(REPO_ROOT).lstrip("/")).exists()
    # The process is the image's interpreter running the image's entry point, and the
    # code it has loaded is the image's site-packages (not the venv's .so files).
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert [a.decode() for a in argv[:2]] == [IMAGE_PYTHON, "/opt/shoal/bin/shoal-consumer"]
    # /proc/<pid>/maps names the files as the process sees them (inside its root); the
    # host has no /opt/shoal, so these compiled modules (pydantic_core, grpc, ...) are the
    # image's, and none comes from the checkout's venv.
    assert not Path("/opt/shoal").exists()
    maps = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()}
    assert any(m.startswith("/opt/shoal/lib/python3.11/site-packages/") for m in maps), maps
    assert not [m for m in maps if m.startswith(str(REPO_ROOT))]


def test_consumer_pods_run_from_the_image(plane: LocalKube, operator: Path) -> None:
    started = time.monotonic()
    plane.kubectl("apply", "-f", "-", input_text=group(2))
    wait_until(
        lambda: (
            condition(get_json(plane, "cg", "orders", "-n", NS), "Ready").get("status") == "True"
        ),
        120,
        "the group to become Ready",
    )
    print(f"\ngroup Ready (2 pods from the image) in {time.monotonic() - started:.0f} s")
    pods = consumer_pods(plane)
    assert len(pods) == 2
    node = get_json(plane, "node", "localkube")["status"]["nodeInfo"]
    assert node["containerRuntimeVersion"] == "chroot://1"
    for pod in pods:
        assert pod["status"]["containerStatuses"][0]["ready"]
        assert_runs_from_the_image(plane, pid_of(pod))

    # Inside, as exec probes see it: the image's Python, the pod's user, a read-only root
    # filesystem with a writable /tmp (the group's emptyDir), the token where Kubernetes
    # puts it.
    pid = pid_of(pods[0])
    program = (
        "import os, sys, shoal.consumer; print(sys.prefix, os.getuid(), shoal.consumer.__path__[0])"
    )
    prefix, uid, package = inside(pid, IMAGE_PYTHON, "-c", program).split()
    assert (prefix, uid) == ("/opt/shoal", str(UID))
    assert package.startswith("/opt/shoal/lib/python3.11/site-packages/shoal/")
    denied = run_inside(pid, INSIDE, ["touch", "/opt/shoal/written"], timeout=30)
    assert denied.returncode != 0 and b"Read-only file system" in denied.stderr
    assert inside(pid, "sh", "-c", "touch /tmp/written && echo ok") == "ok"
    token_dir = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert inside(pid, "cat", f"{token_dir}/namespace") == NS
    environ = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    env = dict(item.split("=", 1) for item in environ if "=" in item)
    assert env["KUBECONFIG"] == f"{token_dir}/kubeconfig"
    assert env["PATH"].startswith("/opt/shoal/bin:")  # the image's ENV

    asyncio.run(produce_and_audit(plane))


async def produce_and_audit(plane: LocalKube) -> None:
    nc = await nats.connect(plane.state.nats_url)
    try:
        js = nc.jetstream()
        items = [
            Outgoing(f"project-{i % 500}", b"x", f"img-{i}", {SEQ_HEADER: str(i // 500)})
            for i in range(MESSAGES)
        ]
        await Producer(js, f"shoal.{NS}.orders", 128).publish_many(items, window=256)

        async def left() -> int:
            return int((await js.stream_info(f"shoal_{NS}_orders")).state.messages)

        await eventually_async(
            left, 90, "the pods to drain the stream", until=lambda n: n == 0, interval=0.5
        )
        records = await read_ledger(js, ledger_stream_name(default_stream_name(NS, "orders")))
        summary = audit(records, [i.message_id or "" for i in items]).summary()
        assert summary["lost"] == 0 and summary["duplicates"] == 0, summary
    finally:
        await nc.close()


def test_a_killed_pod_restarts_from_the_image(plane: LocalKube, operator: Path) -> None:
    pod = consumer_pods(plane)[0]
    name, old = pod["metadata"]["name"], pid_of(pod)
    os.kill(old, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        current = get_json(plane, "pod", name, "-n", NS)
        (status,) = current["status"]["containerStatuses"]
        ok = status["restartCount"] == 1 and status["ready"] and pid_of(current) != old
        return current if ok else None

    assert_runs_from_the_image(plane, pid_of(wait_until(restarted, 90, "a restart, Ready")))


def test_deletion_is_graceful(plane: LocalKube, operator: Path) -> None:
    pods = consumer_pods(plane)
    pids = [pid_of(p) for p in pods]
    plane.kubectl("delete", "cg", "orders", "-n", NS, "--timeout=120s")
    wait_until(lambda: not consumer_pods(plane), 90, "the consumer pods to go")
    wait_until(lambda: not any(alive(pid) for pid in pids), 30, "their processes to exit")
    for pod in pods:
        log = plane.root / "logs" / "pods" / f"{NS}_{pod['metadata']['name']}_consumer.log"
        text = log.read_text()
        # SIGTERM reached the consumer inside its chroot, and it left the group.
        assert "Leaving the group gracefully" in text, text[-2000:]


def test_down_leaves_nothing_behind(plane: LocalKube, operator: Path) -> None:
    container = (plane.root / "kubelet" / RECORD).read_text().strip()
    assert container in buildah_containers()
    plane.down()
    assert container not in buildah_containers()
    assert not (plane.root / "kubelet" / RECORD).exists()
    assert str(plane.root) not in Path("/proc/mounts").read_text()
    assert not rooted_under(plane.root)


def rooted_under(root: Path) -> list[int]:
    """Processes whose root directory is a container root of this plane."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if Path(os.readlink(entry / "root")).is_relative_to(root):
                found.append(int(entry.name))
        except OSError:
            pass  # gone meanwhile
    return found


def buildah_containers() -> list[str]:
    out = subprocess.run(
        ["buildah", "containers", "--format", "{{.ContainerName}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()
