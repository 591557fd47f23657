"""Native sidecars on the local plane's process kubelet, as the real kubelet runs them.

Init containers run in order; a sidecar (an init container with restartPolicy Always)
must have started (its startupProbe succeeded) before the next init container and the
main containers start; it is restarted when it exits; the pod is ready only when its
sidecars are; on deletion the main containers stop first, then the sidecars in reverse
order. The containers are shell scripts (the venv runtime runs them as local processes)
that write what they do, with a timestamp, to one file the test reads.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from harness.kubetest import create_namespace, get_json, wait_until
from harness.localkube.plane import LocalKube

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def script(name: str, events: Path, body: str = "", on_term: str = "") -> list[str]:
    """A container that notes its start, runs `body`, then waits for SIGTERM, notes it,
    runs `on_term` and exits 0. `sleep 0.1` in a loop so the trap runs at once."""
    note = f'echo "$(date +%s.%N) {name}-$1" >> {events}'
    return [
        "sh",
        "-c",
        f"note() {{ {note}; }}\n"
        f"trap 'note term; {on_term} note exit; exit 0' TERM\n"
        "note start\n"
        f"{body}\n"
        "while true; do sleep 0.1; done\n",
    ]


def events(path: Path) -> list[tuple[float, str]]:
    """(time, event) in the order written."""
    if not path.exists():
        return []
    lines = [line.split(" ", 1) for line in path.read_text().splitlines() if line]
    return [(float(stamp), what) for stamp, what in lines]


def names(path: Path) -> list[str]:
    return [what for _, what in events(path)]


def apply(plane: LocalKube, manifest: dict[str, Any]) -> None:
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(manifest))


def pod_status(plane: LocalKube, name: str, ns: str) -> dict[str, Any]:
    status: dict[str, Any] = get_json(plane, "pod", name, "-n", ns).get("status", {})
    return status


def container(status: dict[str, Any], name: str) -> dict[str, Any]:
    for key in ("initContainerStatuses", "containerStatuses"):
        for item in status.get(key, []):
            if item["name"] == name:
                return dict(item)
    return {}


def condition(status: dict[str, Any], kind: str) -> str:
    for item in status.get("conditions", []):
        if item["type"] == kind:
            return str(item["status"])
    return ""


def test_sidecars_start_in_order_gate_readiness_restart_and_stop_last(
    localkube: LocalKube, tmp_path: Path
) -> None:
    plane, ns = localkube, "sidecars"
    create_namespace(plane, ns)
    log = tmp_path / "events"
    up, ready = tmp_path / "svc-up", tmp_path / "svc-ready"
    probe = {"periodSeconds": 1, "failureThreshold": 1000}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "served", "namespace": ns},
        "spec": {
            "terminationGracePeriodSeconds": 20,
            "initContainers": [
                # A regular init container: runs to completion first.
                {
                    "name": "setup",
                    "image": "shoal:dev",
                    "command": ["sh", "-c", f'sleep 1; echo "$(date +%s.%N) setup-done" >> {log}'],
                },
                # The service: started once the file the test creates appears.
                {
                    "name": "svc",
                    "image": "shoal:dev",
                    "restartPolicy": "Always",
                    "command": script("svc", log),
                    "startupProbe": {"exec": {"command": ["test", "-f", str(up)]}, **probe},
                    "readinessProbe": {"exec": {"command": ["test", "-f", str(ready)]}, **probe},
                },
                # A second sidecar without probes: started as soon as it runs.
                {
                    "name": "agent",
                    "image": "shoal:dev",
                    "restartPolicy": "Always",
                    "command": script("agent", log),
                },
            ],
            "containers": [
                # Takes 2 s to stop: the sidecars must still be there meanwhile.
                {
                    "name": "main",
                    "image": "shoal:dev",
                    "command": script("main", log, on_term="sleep 2;"),
                }
            ],
        },
    }
    apply(plane, pod)

    wait_until(lambda: "svc-start" in names(log), 60, "the svc sidecar to start")
    assert names(log)[:2] == ["setup-done", "svc-start"]
    # Its startup probe fails: nothing after it starts, the pod is still initializing.
    time.sleep(3)
    assert names(log) == ["setup-done", "svc-start"]
    status = pod_status(plane, "served", ns)
    assert status["phase"] == "Pending"
    assert condition(status, "Initialized") == "False"
    assert container(status, "setup")["state"]["terminated"]["reason"] == "Completed"
    svc = container(status, "svc")
    assert "running" in svc["state"] and svc["started"] is False and svc["ready"] is False
    assert container(status, "agent")["state"]["waiting"]["reason"] == "PodInitializing"
    assert container(status, "main")["state"]["waiting"]["reason"] == "PodInitializing"

    up.touch()
    opened = time.time()
    wait_until(lambda: "main-start" in names(log), 30, "the main container to start")
    wait_until(lambda: "agent-start" in names(log), 10, "the agent's first line")
    # agent has no startup probe: it counts as started once its process runs, so main
    # starts right after it, and their first lines may come in either order (as on a
    # real node).
    assert names(log)[:2] == ["setup-done", "svc-start"]
    assert sorted(names(log)[2:]) == ["agent-start", "main-start"]
    stamps = dict((what, stamp) for stamp, what in events(log))
    # Only after the startup probe saw the file.
    assert min(stamps["agent-start"], stamps["main-start"]) >= opened - 0.5
    status = wait_until(
        lambda: (s := pod_status(plane, "served", ns))["phase"] == "Running" and s,
        30,
        "the pod to run",
    )
    assert condition(status, "Initialized") == "True"
    # Running and started, but its readiness probe fails: the pod is not ready.
    time.sleep(2)
    status = pod_status(plane, "served", ns)
    assert container(status, "svc")["started"] is True
    assert container(status, "svc")["ready"] is False
    assert container(status, "main")["ready"] is True
    assert condition(status, "Ready") == "False"
    ready.touch()
    wait_until(
        lambda: condition(pod_status(plane, "served", ns), "Ready") == "True",
        30,
        "the pod to become ready with its sidecar",
    )

    # A sidecar that dies is restarted; the main container is left alone.
    agent = container(pod_status(plane, "served", ns), "agent")
    os.killpg(int(agent["containerID"].removeprefix("process://")), signal.SIGKILL)
    wait_until(
        lambda: (
            (a := container(pod_status(plane, "served", ns), "agent")).get("restartCount") == 1
            and "running" in a["state"]
        ),
        30,
        "the agent sidecar to be restarted",
    )
    assert names(log).count("agent-start") == 2
    assert container(pod_status(plane, "served", ns), "main")["restartCount"] == 0

    # Deletion: main first (it takes 2 s), then agent, then svc (reverse order).
    log.write_text("")
    started = time.monotonic()
    plane.kubectl("delete", "pod", "served", "-n", ns, "--wait=true", "--timeout=60s")
    took = time.monotonic() - started
    order = names(log)
    assert order == [
        "main-term",
        "main-exit",
        "agent-term",
        "agent-exit",
        "svc-term",
        "svc-exit",
    ], order
    stamps = dict((what, stamp) for stamp, what in events(log))
    assert stamps["main-exit"] - stamps["main-term"] >= 1.9
    # Well within the grace period: nobody was killed.
    assert took < 15, took


def test_finished_pods_stop_their_sidecars_and_startup_probes_restart(
    localkube: LocalKube, tmp_path: Path
) -> None:
    """restartPolicy Never: once the main container is done, the sidecar is stopped and
    the pod Succeeded (a sidecar never keeps a pod alive); a regular init container that
    fails fails the pod, and nothing after it runs; a sidecar that keeps failing its
    startup probe is killed and restarted, and holds back everything after it."""
    plane, ns = localkube, "sidecars-finish"
    create_namespace(plane, ns)
    log = tmp_path / "events"

    def pod(name: str, init: list[dict[str, Any]], main: list[str]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 10,
                "initContainers": init,
                "containers": [{"name": "main", "image": "shoal:dev", "command": main}],
            },
        }

    def sidecar(name: str, **extra: Any) -> dict[str, Any]:
        return {
            "name": name,
            "image": "shoal:dev",
            "restartPolicy": "Always",
            "command": script(name, log),
            **extra,
        }

    apply(plane, pod("job", [sidecar("job-svc")], ["sh", "-c", "sleep 1"]))
    failing = {"name": "fails", "image": "shoal:dev", "command": ["sh", "-c", "exit 3"]}
    apply(plane, pod("broken", [sidecar("broken-svc"), failing], ["true"]))
    never = {"exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 2}
    apply(plane, pod("slow", [sidecar("slow-svc", startupProbe=never)], ["true"]))

    def phase(name: str) -> str:
        return str(pod_status(plane, name, ns).get("phase"))

    wait_until(lambda: phase("job") == "Succeeded", 60, "the job pod to succeed")
    status = pod_status(plane, "job", ns)
    assert container(status, "main")["state"]["terminated"]["exitCode"] == 0
    assert "terminated" in container(status, "job-svc")["state"]
    assert names(log).index("job-svc-term") > names(log).index("job-svc-start")

    wait_until(lambda: phase("broken") == "Failed", 60, "the broken pod to fail")
    status = pod_status(plane, "broken", ns)
    assert container(status, "fails")["state"]["terminated"]["exitCode"] == 3
    assert container(status, "fails")["restartCount"] == 0
    assert "main" not in {c["name"] for c in status.get("containerStatuses", [])} or (
        "waiting" in container(status, "main")["state"]
    )
    assert "terminated" in container(status, "broken-svc")["state"]
    assert "broken-svc-term" in names(log)

    slow = wait_until(
        lambda: (
            (c := container(pod_status(plane, "slow", ns), "slow-svc")).get("restartCount", 0) >= 1
            and c
        ),
        60,
        "the sidecar failing its startup probe to be restarted",
    )
    assert slow["started"] is False
    status = pod_status(plane, "slow", ns)
    assert status["phase"] == "Pending"
    assert container(status, "main")["state"]["waiting"]["reason"] == "PodInitializing"
    assert names(log).count("slow-svc-start") >= 2


def test_a_zero_grace_period_still_gives_a_sidecar_two_seconds(
    localkube: LocalKube, tmp_path: Path
) -> None:
    """terminationGracePeriodSeconds 0 is not "30" (nor "at once"): once the main
    container is done, a sidecar ignoring SIGTERM is killed 2 s after it (the least
    a container gets), and the pod Succeeds."""
    plane, ns = localkube, "sidecars-zero"
    create_namespace(plane, ns)
    log = tmp_path / "events"
    sidecar = {
        "name": "stubborn",
        "image": "shoal:dev",
        "restartPolicy": "Always",
        # Notes SIGTERM, and runs on.
        "command": [
            "sh",
            "-c",
            f"trap 'echo \"$(date +%s.%N) stubborn-term\" >> {log}' TERM\n"
            f'echo "$(date +%s.%N) stubborn-start" >> {log}\n'
            "while true; do sleep 0.1; done\n",
        ],
    }
    apply(
        plane,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "zero", "namespace": ns},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 0,
                "initContainers": [sidecar],
                "containers": [{"name": "main", "image": "shoal:dev", "command": ["sleep", "1"]}],
            },
        },
    )
    try:
        wait_until(lambda: "stubborn-start" in names(log), 60, "the sidecar to start")
        wait_until(
            lambda: pod_status(plane, "zero", ns).get("phase") == "Succeeded",
            20,
            "the pod to succeed",
        )
        stamps = dict((what, stamp) for stamp, what in events(log))
        assert "stubborn-term" in stamps, names(log)
        status = pod_status(plane, "zero", ns)
        killed = container(status, "stubborn")["state"]["terminated"]
        assert (killed["exitCode"], killed["reason"]) == (137, "Error"), killed
    finally:
        plane.kubectl("delete", "namespace", ns, "--wait=false")
