"""Images other than shoal:dev on the local plane's kubelet.

With the image runtime (root, buildah), a container of any image buildah has locally
runs from that image's own root filesystem (mounted once per image), beside shoal:dev
pods; an image buildah lacks waits with ErrImageNeverPull (nothing is pulled). Without
it (the venv runtime), an image runs only through a local stand-in (`--local-image
IMAGE=PATH`), and the container's log says so; any other waits with ErrImageNotLocal.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.kubetest import create_namespace, get_json, wait_until
from harness.localkube.image import RECORD
from harness.localkube.plane import LocalKube

pytestmark = [pytest.mark.timeout(300)]

SLEEP = ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.1; done"]


def pod(name: str, ns: str, sidecar: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "initContainers": [{"restartPolicy": "Always", **sidecar}],
            "containers": [{"name": "main", "image": "shoal:dev", "command": SLEEP}],
        },
    }


def apply(plane: LocalKube, manifest: dict[str, Any]) -> None:
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(manifest))


def status_of(plane: LocalKube, name: str, ns: str, container: str) -> dict[str, Any]:
    status = get_json(plane, "pod", name, "-n", ns).get("status", {})
    for key in ("initContainerStatuses", "containerStatuses"):
        for item in status.get(key, []):
            if item["name"] == container:
                return dict(item)
    return {}


def running_pid(plane: LocalKube, name: str, ns: str, container: str) -> int:
    def pid() -> int | None:
        status = status_of(plane, name, ns, container)
        if "running" not in status.get("state", {}):
            return None
        return int(status["containerID"].removeprefix("process://"))

    found: int = wait_until(pid, 60, f"{name}/{container} to run")
    return found


def waiting(plane: LocalKube, name: str, ns: str, container: str) -> dict[str, Any]:
    def reason() -> dict[str, Any] | None:
        state = status_of(plane, name, ns, container).get("state", {})
        return state.get("waiting") if state.get("waiting", {}).get("message") else None

    found: dict[str, Any] = wait_until(reason, 60, f"{name}/{container} to wait")
    return found


# -- without the image runtime: stand-ins -------------------------------------------------


@pytest.fixture
def stand_in_plane(tmp_path: Path) -> Iterator[tuple[LocalKube, Path]]:
    marks = tmp_path / "marks"
    marks.mkdir()
    handler = tmp_path / "handler"
    handler.write_text(
        "#!/bin/sh\n"
        f'echo "$0 $*" > {marks}/args\n'
        "echo serving\n"
        "trap 'exit 0' TERM; while true; do sleep 0.1; done\n"
    )
    handler.chmod(0o755)
    plane = LocalKube(tmp_path / "plane", local_images={"example.com/handler:1": handler})
    try:
        plane.up()
        yield plane, marks
    finally:
        plane.down()


@pytest.mark.e2e
def test_without_the_image_runtime_a_stand_in_runs_and_says_so(
    stand_in_plane: tuple[LocalKube, Path],
) -> None:
    plane, marks = stand_in_plane
    ns = "stand-ins"
    create_namespace(plane, ns)
    handler = {"name": "handler", "image": "example.com/handler:1", "args": ["--port", "8080"]}
    apply(plane, pod("served", ns, handler))
    running_pid(plane, "served", ns, "handler")
    running_pid(plane, "served", ns, "main")
    wait_until(lambda: (marks / "args").exists(), 30, "the stand-in to run")
    command, args = (marks / "args").read_text().split(" ", 1)
    assert Path(command).name == "handler" and args.strip() == "--port 8080"
    logs = plane.kubectl("logs", "served", "-n", ns, "-c", "handler").stdout
    assert "localkube: image 'example.com/handler:1' is not run from an image here" in logs
    assert "runs its local stand-in" in logs and "serving" in logs

    # An image with no stand-in waits, and the message says what would run it.
    apply(plane, pod("absent", ns, {"name": "other", "image": "example.com/other:2"}))
    state = waiting(plane, "absent", ns, "other")
    assert state["reason"] == "ErrImageNotLocal"
    assert "--local-image example.com/other:2=PATH" in state["message"]
    # Nothing after the sidecar starts.
    assert status_of(plane, "absent", ns, "main")["state"]["waiting"]["reason"] == (
        "PodInitializing"
    )


# -- the image runtime: any image buildah has ---------------------------------------------


def buildah(*args: str) -> str:
    return subprocess.run(
        ["buildah", *args], capture_output=True, text=True, check=True, timeout=600
    ).stdout.strip()


@pytest.fixture(scope="module")
def base_image(request: pytest.FixtureRequest) -> str:
    """shoal:dev as buildah has it (SHOAL_IMAGE to name another), else built now."""
    if os.geteuid() != 0:
        # Not a skip: `make image` runs as root, and this is what it is there to show.
        pytest.fail("the image runtime needs root: run `make image` as root")
    tag = os.environ.get("SHOAL_IMAGE", "shoal:dev")
    try:
        buildah("inspect", "--type", "image", tag)
    except (subprocess.CalledProcessError, FileNotFoundError):
        built: str = request.getfixturevalue("image")
        return built
    return tag


@pytest.fixture(scope="module")
def other_image(base_image: str) -> Iterator[str]:
    """Another image: the base with an ENV and a USER of its own (committed, so its
    config is its own), removed afterwards."""
    name = "localhost/shoal-sidecar-test:1"
    container = buildah("from", "--pull-never", "--quiet", base_image)
    try:
        buildah("config", "--env", "MADE_FOR=sidecar-test", "--user", "10002:10002", container)
        buildah("commit", "--quiet", container, name)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
    yield name
    subprocess.run(["buildah", "rmi", name], capture_output=True, check=False)


@pytest.fixture(scope="module")
def image_plane(
    base_image: str, other_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalKube]:
    plane = LocalKube(tmp_path_factory.mktemp("images-plane"), image=base_image)
    try:
        plane.up()
        yield plane
    finally:
        plane.down()


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(pid)


@pytest.mark.image
def test_images_buildah_has_run_from_their_own_root(
    image_plane: LocalKube, other_image: str
) -> None:
    plane, ns = image_plane, "images"
    create_namespace(plane, ns)
    sidecar = {"name": "handler", "image": other_image, "command": SLEEP}
    apply(plane, pod("served", ns, sidecar))
    side, main = (
        running_pid(plane, "served", ns, "handler"),
        running_pid(plane, "served", ns, "main"),
    )
    # Each from its own image: the other image's ENV and USER for the sidecar only.
    assert environ(side).get("MADE_FOR") == "sidecar-test"
    assert "MADE_FOR" not in environ(main)
    assert (uid(side), uid(main)) == (10002, 10001)
    assert Path(os.readlink(f"/proc/{side}/root")) != Path(os.readlink(f"/proc/{main}/root"))
    # Mounted once each: two working containers recorded, whatever the number of pods.
    apply(plane, pod("again", ns, {**sidecar}))
    running_pid(plane, "again", ns, "handler")
    recorded = (plane.root / "kubelet" / RECORD).read_text().split()
    assert len(recorded) == 2, recorded

    apply(plane, pod("absent", ns, {"name": "other", "image": "localhost/no-such-image:0"}))
    state = waiting(plane, "absent", ns, "other")
    assert state["reason"] == "ErrImageNeverPull"
    assert 'Container image "localhost/no-such-image:0" is not present' in state["message"]

    plane.down()
    assert not (plane.root / "kubelet" / RECORD).exists()
    containers = buildah("containers", "--quiet", "--notruncate")
    assert not set(recorded) & set(containers.split())
