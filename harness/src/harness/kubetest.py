"""Small helpers the full-stack tests share: waiting, reading objects, conditions."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness import REPO_ROOT
from harness.children import spawn
from harness.localkube.plane import LocalKube
from harness.servers import free_port
from harness.waiting import eventually

ROOT = REPO_ROOT


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


@contextlib.contextmanager
def operator_process(
    plane: LocalKube,
    namespaces: Sequence[str],
    log_path: Path,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """`shoal-operator` as a local process watching `namespaces`, stopped on exit.

    The CRD is applied first. Suites that run an operator each watch their own namespaces,
    so they can share the session's plane.
    """
    plane.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "consumergroup.yaml"))
    plane.kubectl(
        "wait", "--for=condition=Established", "crd/consumergroups.shoal.dev", "--timeout=60s"
    )
    env = {
        **os.environ,
        **plane.env(),
        "SHOAL_OPERATOR_IMAGE": "shoal:dev",
        "NATS_URL": plane.state.nats_url,
        "ETCD_ENDPOINTS": plane.state.etcd_endpoint,
        **(extra_env or {}),
    }
    args = [a for ns in namespaces for a in ("--namespace", ns)]
    with log_path.open("wb") as out:
        process = spawn(
            [
                sys.executable,
                "-m",
                "shoal.operator",
                *args,
                "--liveness",
                f"http://127.0.0.1:{free_port()}/healthz",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


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
