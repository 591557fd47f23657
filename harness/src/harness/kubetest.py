"""Small helpers the full-stack tests share: a plane and an operator for a module,
waiting, reading objects, conditions, the nodes of a plane."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness import REPO_ROOT
from harness.children import spawn
from harness.localkube.plane import NODE_MONITOR_GRACE, LocalKube, State
from harness.servers import free_port
from harness.waiting import eventually

ROOT = REPO_ROOT
# The label the plane's nodes carry their zone in (zone-a, zone-b, ...).
ZONE = "topology.kubernetes.io/zone"


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.3) -> Any:
    """`harness.waiting.eventually`, polling every 0.3 s by default: most checks here start
    a kubectl process, and the plane shares two cores with the group under test."""
    return eventually(check, timeout, what, interval=interval)


def get_json(plane: LocalKube, *args: str) -> Any:
    """`kubectl get ARGS -o json`, parsed."""
    return json.loads(plane.kubectl("get", *args, "-o", "json").stdout)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    """The status condition of that type ({} if absent)."""
    for c in obj.get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return dict(c)
    return {}


def apiserver_requests(plane: LocalKube) -> dict[str, float]:
    """apiserver_request_total summed by (verb, resource/subresource), from its /metrics."""
    text = plane.kubectl("get", "--raw", "/metrics").stdout
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.partition("}")[0]))
        key = f"{labels.get('verb')} {labels.get('resource')}"
        if labels.get("subresource"):
            key += "/" + labels["subresource"]
        totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def create_namespace(plane: LocalKube, name: str) -> None:
    """Create a namespace and wait for its default ServiceAccount (pods need it)."""
    plane.kubectl("create", "namespace", name)
    wait_until(
        lambda: (
            plane.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode
            == 0
        ),
        30,
        f"the default service account of {name}",
    )


def wait_established(plane: LocalKube, crd: str, timeout: float = 60.0) -> None:
    """Wait for the CRD's Established condition, trying `kubectl wait` again while it
    fails before `timeout`. CI once had it exit 1 at once on a 3-node plane a second
    old, right after the CRD's apply had succeeded (stop 38; it did not happen in six
    tries since): a retry costs nothing, and if it keeps failing, the error says what
    kubectl said instead of only its exit status."""
    deadline = time.monotonic() + timeout
    while True:
        left = max(1, int(deadline - time.monotonic()))
        done = plane.kubectl(
            "wait", "--for=condition=Established", f"crd/{crd}", f"--timeout={left}s", check=False
        )
        if done.returncode == 0:
            return
        if time.monotonic() >= deadline:
            said = (done.stderr or done.stdout).strip()
            raise RuntimeError(f"CRD {crd} not Established within {timeout:g} s: {said}")
        print(f"kubectl wait for CRD {crd}: exit {done.returncode}: {done.stderr.strip()}")
        time.sleep(1.0)


@contextlib.contextmanager
def operator_process(
    plane: LocalKube,
    namespaces: Sequence[str],
    log_path: Path,
    extra_env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    python_args: Sequence[str] = (),
) -> Iterator[subprocess.Popen[bytes]]:
    """`shoal-operator` as a local process watching `namespaces`, stopped on exit (its
    whole process group; a process the test already killed is only reaped).
    `python_args` go to the interpreter before `-m shoal.operator`, e.g.
    ("-m", "cProfile", "-o", path): cProfile writes its file when the operator exits on
    the SIGTERM this sends.

    The CRD is applied first. Suites that run an operator each watch their own namespaces,
    so they can share the session's plane.
    """
    plane.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "consumergroup.yaml"))
    wait_established(plane, "consumergroups.shoal.dev")
    env = {
        **os.environ,
        **plane.env(),
        "SHOAL_OPERATOR_IMAGE": "shoal:dev",
        "NATS_URL": plane.state.nats_url,
        "ETCD_ENDPOINTS": plane.state.etcd_endpoint,
        # HTTP probes where each pod has a loopback of its own (the chart's default on a
        # real cluster; the plane's values.yaml says the same), exec probes elsewhere.
        **({"SHOAL_CONSUMER_HEALTH_PORT": "8081"} if plane.pod_network else {}),
        **(extra_env or {}),
    }
    args = [a for ns in namespaces for a in ("--namespace", ns)]
    with log_path.open("wb") as out:
        process = spawn(
            [
                sys.executable,
                *python_args,
                "-m",
                "shoal.operator",
                *args,
                "--liveness",
                f"http://127.0.0.1:{free_port()}/healthz",
                *extra_args,
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextlib.contextmanager
def operator_watching(
    plane: LocalKube,
    namespaces: Sequence[str],
    log_path: Path,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[Path]:
    """`operator_process` watching `namespaces`, which are created first; yields its log.

    On the way out, whatever happened: the groups go while the operator still runs (their
    finalizers need it), then the namespaces, and no pod of theirs may outlive the suite.
    """
    with operator_process(plane, namespaces, log_path, extra_env):
        for ns in namespaces:
            create_namespace(plane, ns)
        try:
            yield log_path
        finally:
            for ns in namespaces:
                plane.kubectl("delete", "cg", "--all", "-n", ns, "--timeout=90s", check=False)
                plane.kubectl("delete", "namespace", ns, "--wait=false", check=False)
            wait_until(
                lambda: not any(namespace_pods(plane, ns) for ns in namespaces),
                90,
                "this file's pods to be gone",
            )


def namespace_pods(plane: LocalKube, namespace: str) -> list[Any]:
    """The namespace's pods ([] if it cannot be listed, e.g. the namespace is gone)."""
    found = plane.kubectl("get", "pods", "-n", namespace, "-o", "json", check=False)
    return list(json.loads(found.stdout)["items"]) if found.returncode == 0 else []


def apply_secret(
    plane: LocalKube,
    namespace: str,
    name: str,
    files: Mapping[str, Path] | None = None,
    **literals: str,
) -> None:
    """Create or replace a generic Secret: a key per file (key -> path) and per literal.
    Applied, not created, so that a test can rotate it in place."""
    args = [f"--from-file={key}={path}" for key, path in (files or {}).items()]
    args += [f"--from-literal={key}={value}" for key, value in literals.items()]
    create = ("create", "secret", "generic", name, "-n", namespace, *args)
    manifest = plane.kubectl(*create, "--dry-run=client", "-o", "yaml").stdout
    plane.kubectl("apply", "-f", "-", input_text=manifest)


def group_ready(plane: LocalKube, namespace: str, name: str) -> dict[str, Any] | None:
    """The ConsumerGroup if its Ready condition is True, else None (for `wait_until`)."""
    cg = get_json(plane, "cg", name, "-n", namespace)
    return cg if condition(cg, "Ready").get("status") == "True" else None


def group_degraded(plane: LocalKube, namespace: str, name: str) -> dict[str, Any]:
    """The ConsumerGroup's Degraded condition if it is True, else {}."""
    found = condition(get_json(plane, "cg", name, "-n", namespace), "Degraded")
    return found if found.get("status") == "True" else {}


def adopt_crd_for_helm(plane: LocalKube, release: str, namespace: str) -> None:
    """Let a Helm release take over the ConsumerGroup CRD if it already exists.

    Other suites on the session's plane apply the CRD with kubectl, and Helm refuses to
    install over an object it does not own ("invalid ownership metadata"). These are the
    label and annotations Helm checks: the same step a cluster upgrading from a chart that
    shipped the CRD in crds/ needs (README, "Upgrading").
    """
    crd = "crd/consumergroups.shoal.dev"
    if plane.kubectl("get", crd, check=False).returncode != 0:
        return
    plane.kubectl("label", "--overwrite", crd, "app.kubernetes.io/managed-by=Helm")
    plane.kubectl(
        "annotate",
        "--overwrite",
        crd,
        f"meta.helm.sh/release-name={release}",
        f"meta.helm.sh/release-namespace={namespace}",
    )


@contextlib.contextmanager
def running_plane(
    workdir: Path,
    *,
    image: str | None = None,
    pod_network: bool = False,
    nodes: int = 1,
    node_monitor_grace: float = NODE_MONITOR_GRACE,
) -> Iterator[LocalKube]:
    """A plane in `workdir` (LocalKube's options), up; down on the way out, also when
    `up` fails half-way (what it started must not outlive the test)."""
    plane = LocalKube(
        workdir,
        image=image,
        pod_network=pod_network,
        nodes=nodes,
        node_monitor_grace=node_monitor_grace,
    )
    try:
        plane.up()
        yield plane
    finally:
        plane.down()


@contextlib.contextmanager
def three_node_plane(workdir: Path, node_monitor_grace: float) -> Iterator[LocalKube]:
    """running_plane with three nodes (localkube-a, -b, -c in zone-a, -b, -c); says how
    long it took to come up (three kubelets on two cores: worth knowing in a slow run)."""
    started = time.monotonic()
    with running_plane(workdir, nodes=3, node_monitor_grace=node_monitor_grace) as plane:
        print(f"\n3-node plane up in {time.monotonic() - started:.1f} s")
        yield plane


@contextlib.contextmanager
def namespace_operator(plane: LocalKube, namespace: str, workdir: Path) -> Iterator[Path]:
    """`operator_process` watching `namespace`, which it creates; yields the operator's
    log (``workdir/operator.log``)."""
    log_path = workdir / "operator.log"
    with operator_process(plane, [namespace], log_path):
        create_namespace(plane, namespace)
        yield log_path


def zones(plane: LocalKube) -> dict[str, str]:
    """node name -> its zone label."""
    return {
        n["metadata"]["name"]: n["metadata"]["labels"].get(ZONE, "")
        for n in get_json(plane, "nodes")["items"]
    }


def component_of(plane: LocalKube, node: str) -> str:
    """The plane's component (its state and log name) that runs `node`'s kubelet."""
    return next(n.component for n in plane.nodes if n.name == node)


def kubelet_pid(plane: LocalKube, node: str) -> int:
    """The pid of `node`'s kubelet, from the plane's state file."""
    component = component_of(plane, node)
    state = State.load(plane.state_path)
    return next(c.pid for c in state.components if c.name == component)
