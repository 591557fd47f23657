"""The chart's values for the operator's own NATS TLS and credentials, on the local plane.

A release whose operator reaches a nats-server that requires TLS with client
certificates and a password (harness.natssecurity) only through its chart values:
nats.url, nats.tlsSecret (the CA, a client certificate) and nats.credentialsSecret with
credentialsType userPassword, Secrets in the release's namespace that the process kubelet
mounts into the operator Pod (and passes the password as env from the Secret). A group
with no NATS Secrets of its own and no pods (replicas 0) gets its stream and durables
from the operator all the same: made with the chart's settings, nothing else.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
import yaml
from nats.js.errors import NotFoundError

from harness.kubetest import apply_secret, get_json, wait_until
from harness.localkube.plane import LocalKube
from harness.securenats import NatsUser, SecureNats, secure_nats_server
from harness.servers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "shoal"
RELEASE, RELEASE_NS, DEMO_NS = "shoal-nats", "shoal-nats-system", "helm-nats-demo"
OPERATOR, ADMIN = "shoal-operator", "admin"
PASSWORDS = {OPERATOR: secrets.token_hex(8), ADMIN: secrets.token_hex(8)}
PARTITIONS = 8


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureNats]:
    users = [NatsUser(name, password) for name, password in PASSWORDS.items()]
    server = secure_nats_server(tmp_path_factory.mktemp("helm-nats"), users)
    with server.server:
        yield server


def kubectl(plane: LocalKube, *args: str, check: bool = True) -> str:
    return plane.kubectl(*args, check=check).stdout


def helm(plane: LocalKube, *args: str, check: bool = True) -> None:
    """helm with the plane's environment (KUBECONFIG, PATH to the tools)."""
    result = subprocess.run(
        ["helm", *args],
        env={**os.environ, **plane.env()},
        capture_output=True,
        text=True,
        timeout=200,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)}: {result.stdout}\n{result.stderr}")


def ensure_namespace(plane: LocalKube, name: str) -> None:
    if plane.kubectl("get", "namespace", name, check=False).returncode != 0:
        plane.kubectl("create", "namespace", name)
    wait_until(
        lambda: plane.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
        30,
        f"the default service account of {name}",
    )


def durables(secure: SecureNats, stream: str) -> list[str]:
    admin = secure.client(ADMIN)

    async def go() -> list[str]:
        nc = await nats.connect(secure.url, **admin.connect_options())
        try:
            return [c.name for c in await nc.jetstream().consumers_info(stream) if c.name]
        except NotFoundError:  # the operator has not made the stream yet
            return []
        finally:
            await nc.close()

    return asyncio.run(go())


def checkout_python_path() -> list[str]:
    """Helm arguments that make the operator Pod run this checkout's code when the tests
    do (PYTHONPATH set, e.g. in a git worktree): the process kubelet starts pods from the
    virtualenv, whose editable install may be another checkout's."""
    path = os.environ.get("PYTHONPATH")
    if not path:
        return []
    env = [{"name": "PYTHONPATH", "value": path}]
    return ["--set-json", f"extraEnv={json.dumps(env)}"]


def diagnostics(plane: LocalKube) -> str:
    """The group's status and the operator's log, when the release misbehaves."""
    parts = [kubectl(plane, "get", "cg", "-n", DEMO_NS, "-o", "yaml", check=False)]
    for log in sorted((plane.root / "logs" / "pods").glob(f"{RELEASE_NS}_*.log")):
        parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-6000:]}")
    return "\n".join(parts)


def test_the_operator_reaches_tls_nats_with_its_chart_credentials(
    localkube: LocalKube, secure: SecureNats
) -> None:
    plane = localkube
    for ns in (RELEASE_NS, DEMO_NS):
        ensure_namespace(plane, ns)
    try:
        apply_secret(plane, RELEASE_NS, "operator-nats-tls", secure.tls_files())
        apply_secret(
            plane, RELEASE_NS, "operator-nats", user=OPERATOR, password=PASSWORDS[OPERATOR]
        )
        # The CRD as the other suites apply it; this release leaves it alone, and the
        # consumer-pod policy to test_helm.py.
        plane.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "consumergroup.yaml"))
        started = time.monotonic()
        helm(
            plane,
            "install",
            RELEASE,
            str(CHART),
            "-n",
            RELEASE_NS,
            "-f",
            str(plane.root / "values.yaml"),
            "--set",
            "crds.enabled=false",
            "--set",
            "consumerPodPolicy.enabled=false",
            "--set",
            f"watchNamespaces={{{DEMO_NS}}}",
            "--set",
            f"livenessProbe.port={free_port()}",
            "--set",
            f"nats.url={secure.url}",
            "--set",
            "nats.tlsSecret=operator-nats-tls",
            "--set",
            "nats.credentialsSecret=operator-nats",
            "--set",
            "nats.credentialsType=userPassword",
            *checkout_python_path(),
            "--wait",
            "--timeout",
            "120s",
        )
        print(f"helm install --wait took {time.monotonic() - started:.1f} s")
        deployment = get_json(plane, "deployment", f"{RELEASE}-operator", "-n", RELEASE_NS)
        pod_template = json.dumps(deployment["spec"]["template"])
        assert PASSWORDS[OPERATOR] not in pod_template

        group = yaml.safe_load((REPO / "examples" / "consumergroup.yaml").read_text())
        group["metadata"] = {"name": "orders", "namespace": DEMO_NS}
        group["spec"].update(replicas=0, partitions=PARTITIONS, minReplicas=1, maxReplicas=4)
        plane.kubectl("apply", "-f", "-", input_text=json.dumps(group))
        stream = f"shoal_{DEMO_NS}_orders"
        made = wait_until(
            lambda: len(durables(secure, stream)) == PARTITIONS,
            90,
            "the operator to make the stream and durables on the secured NATS",
        )
        assert made
        cg = get_json(plane, "cg", "orders", "-n", DEMO_NS)
        degraded = [c for c in cg["status"].get("conditions", []) if c["type"] == "Degraded"]
        assert not degraded or degraded[0]["status"] == "False", degraded
        plane.kubectl("delete", "cg", "orders", "-n", DEMO_NS, "--timeout=60s")
    except BaseException:
        print(diagnostics(plane))
        raise
    finally:
        plane.kubectl("delete", "cg", "--all", "-n", DEMO_NS, "--timeout=60s", check=False)
        helm(plane, "uninstall", RELEASE, "-n", RELEASE_NS, "--wait", check=False)
        for ns in (DEMO_NS, RELEASE_NS):
            plane.kubectl("delete", "namespace", ns, "--wait=false", check=False)
