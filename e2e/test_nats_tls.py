"""spec.nats.tlsSecret and spec.nats.credentialsSecret on the local control plane: a group
on a NATS server that requires TLS with client certificates and a password.

This file starts its own nats-server (harness.natssecurity: `tls { verify: true }`, users
with passwords, certificates from a CA of its own); the plane's plain
NATS serves the other suites, and the operator's own default (NATS_URL) stays that plain
server, so a group reaches the secured one only through its spec (url and Secrets). The
operator runs as a local process watching only this file's namespaces (it reads the
Secrets with the plane's admin credentials: the chart's RBAC for Secrets is checked by
test_helm.py) and connects with what it read through the API, written to a private
directory of its own; consumer pods get the Secrets from the process kubelet (mounted
files, and the password as env from the Secret).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml

from harness.kubetest import (
    apply_secret,
    condition,
    get_json,
    group_degraded,
    group_ready,
    namespace_pods,
    operator_watching,
    wait_until,
)
from harness.localkube.plane import LocalKube
from harness.natssecurity import NatsServerSecurity
from harness.securenats import NatsUser, SecureNats, secure_nats_server
from shoal.operator.builders import NATS_TLS_SECRET_VERSION
from shoal.operator.etcdsecret import data_version
from shoal.operator.reconciler import OBSERVE_INTERVAL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parent.parent
NS, NS_LATE = "nats-tls", "nats-tls-late"
USER, PASSWORD = "orders", secrets.token_hex(8)
ADMIN, ADMIN_PASSWORD = "admin", secrets.token_hex(8)
PARTITIONS = 16


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureNats]:
    users = [NatsUser(USER, PASSWORD), NatsUser(ADMIN, ADMIN_PASSWORD)]
    server = secure_nats_server(tmp_path_factory.mktemp("nats-tls"), users)
    with server.server:
        yield server


@pytest.fixture(scope="module")
def operator(
    localkube: LocalKube, secure: SecureNats, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    log_path = tmp_path_factory.mktemp("nats-tls-operator") / "operator.log"
    with operator_watching(localkube, [NS, NS_LATE], log_path):
        yield log_path


def group(ns: str, name: str, replicas: int, nats_spec: dict[str, Any]) -> str:
    manifest = yaml.safe_load((ROOT / "examples" / "consumergroup.yaml").read_text())
    manifest["metadata"] = {"name": name, "namespace": ns}
    manifest["spec"]["replicas"] = replicas
    manifest["spec"]["partitions"] = PARTITIONS
    manifest["spec"]["nats"] = {**manifest["spec"].get("nats", {}), **nats_spec}
    return json.dumps(manifest)


def durables(secure: SecureNats, stream: str) -> list[str]:
    """The stream's durables, read as the admin user (TLS, client certificate, password)."""
    security = secure.client(ADMIN)

    async def go() -> list[str]:
        nc = await nats.connect(secure.url, **security.connect_options())
        try:
            js = nc.jetstream()
            return sorted(c.name for c in await js.consumers_info(stream) if c.name)
        finally:
            await nc.close()

    return asyncio.run(go())


def test_a_group_on_tls_nats_with_a_password_runs_and_rolls_on_rotation(
    localkube: LocalKube, secure: SecureNats, operator: Path
) -> None:
    plane, name = localkube, "orders"
    apply_secret(plane, NS, "nats-tls", secure.tls_files())
    apply_secret(plane, NS, "nats-auth", user=USER, password=PASSWORD)
    started = time.monotonic()
    spec = {"url": secure.url, "tlsSecret": "nats-tls", "credentialsSecret": "nats-auth"}
    plane.kubectl("apply", "-f", "-", input_text=group(NS, name, 2, spec))
    cg = wait_until(lambda: group_ready(plane, NS, name), 120, "the group to become Ready")
    print(f"Ready on TLS + password NATS in {time.monotonic() - started:.1f} s")
    assert cg["status"]["members"] == 2
    assert condition(cg, "Degraded")["status"] == "False"

    # The operator made the stream and one durable per partition on the secured server.
    assert len(durables(secure, f"shoal_{NS}_{name}")) == PARTITIONS
    # ...with what it read through the API: its own log never names the pods' paths.
    assert "/etc/shoal/nats" not in operator.read_text()

    # How the pods got it: the TLS Secret mounted read-only, the password from the Secret.
    template = get_json(plane, "deployment", f"{name}-consumer", "-n", NS)["spec"]["template"]
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "nats-tls"]
    assert volume["secret"]["secretName"] == "nats-tls"
    env = {var["name"]: var for var in template["spec"]["containers"][0]["env"]}
    assert env["NATS_CA_FILE"]["value"] == "/etc/shoal/nats-tls/ca.crt"
    assert env["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "nats-auth",
        "key": "password",
    }
    assert PASSWORD not in json.dumps(template)

    # An annotation on the Secret is no rotation (it rolled the pods while the version
    # was the Secret's resourceVersion): three status ticks, nothing moves.
    before = {p["metadata"]["name"] for p in namespace_pods(plane, NS)}
    plane.kubectl("annotate", "secret", "nats-tls", "-n", NS, "copied-by=reflector")
    time.sleep(3 * OBSERVE_INTERVAL)
    assert {p["metadata"]["name"] for p in namespace_pods(plane, NS)} == before

    # A rotated TLS Secret rolls the pods, one at a time (maxUnavailable 0, maxSurge 1).
    apply_secret(plane, NS, "nats-tls", secure.tls_files(), rotated="1")
    version = data_version(get_json(plane, "secret", "nats-tls", "-n", NS)["data"])
    most_at_once = 0

    def rolled() -> Any:
        nonlocal most_at_once
        dep = get_json(plane, "deployment", f"{name}-consumer", "-n", NS)
        annotations = dep["spec"]["template"]["metadata"].get("annotations") or {}
        listed = namespace_pods(plane, NS)
        pods = {p["metadata"]["name"] for p in listed}
        # Pods draining (terminating) are not counted by the Deployment either.
        running = [p for p in listed if not p["metadata"].get("deletionTimestamp")]
        most_at_once = max(most_at_once, len(running))
        cg = group_ready(plane, NS, name)
        fresh = pods and not pods & before and len(pods) == 2
        settled = cg and cg["status"]["members"] == 2  # the old members have left
        return annotations.get(NATS_TLS_SECRET_VERSION) == version and fresh and settled

    wait_until(rolled, 150, "the pods to roll onto the rotated Secret")
    assert most_at_once <= 3  # never more than one pod beyond the group's two
    assert "NatsSecretRotated" in plane.kubectl("describe", "cg", name, "-n", NS).stdout

    plane.kubectl("delete", "cg", name, "-n", NS, "--timeout=120s")
    assert not [p for p in namespace_pods(plane, NS) if p["metadata"]["name"].startswith(name)]


def test_a_missing_secret_a_wrong_password_and_ca_degrade_until_fixed(
    localkube: LocalKube, secure: SecureNats, operator: Path, tmp_path: Path
) -> None:
    plane, name = localkube, "late"
    apply_secret(plane, NS_LATE, "nats-tls", secure.tls_files())
    spec = {"url": secure.url, "tlsSecret": "nats-tls", "credentialsSecret": "nats-late"}
    plane.kubectl("apply", "-f", "-", input_text=group(NS_LATE, name, 1, spec))

    missing = wait_until(lambda: group_degraded(plane, NS_LATE, name), 60, "NatsSecretMissing")
    assert missing["reason"] == "NatsSecretMissing", missing
    assert missing["message"] == (
        f"Secret {NS_LATE}/nats-late (spec.nats.credentialsSecret) not found"
    )
    # Nothing runs for it yet.
    assert (
        plane.kubectl(
            "get", "deployment", f"{name}-consumer", "-n", NS_LATE, check=False
        ).returncode
        != 0
    )

    # A wrong password: NATS refuses it, and the group says so, naming the Secret.
    apply_secret(plane, NS_LATE, "nats-late", user=USER, password="not-" + PASSWORD)
    refused = wait_until(
        lambda: (d := group_degraded(plane, NS_LATE, name)).get("reason") == "NatsAuthFailed" and d,
        90,
        "NatsAuthFailed",
    )
    assert f"Secret {NS_LATE}/nats-late (spec.nats.credentialsSecret)" in refused["message"]
    described = plane.kubectl("describe", "cg", name, "-n", NS_LATE).stdout
    assert "NatsAuthFailed" in described
    assert "not-" + PASSWORD not in described

    # The right password, but a CA that did not sign the server's certificate.
    apply_secret(plane, NS_LATE, "nats-late", user=USER, password=PASSWORD)
    other = NatsServerSecurity.generate(tmp_path / "other-ca", [])
    apply_secret(plane, NS_LATE, "nats-tls", {**secure.tls_files(), "ca.crt": other.ca_file})
    untrusted = wait_until(
        lambda: (d := group_degraded(plane, NS_LATE, name)).get("reason") == "NatsTLSFailed" and d,
        90,
        "NatsTLSFailed",
    )
    assert f"Secret {NS_LATE}/nats-tls (spec.nats.tlsSecret)" in untrusted["message"]
    assert "certificate" in untrusted["message"]

    # Fixed: the group recovers by itself (retry with backoff).
    started = time.monotonic()
    apply_secret(plane, NS_LATE, "nats-tls", secure.tls_files())
    wait_until(lambda: group_ready(plane, NS_LATE, name), 150, "the group to recover")
    print(f"recovered {time.monotonic() - started:.1f} s after the Secret was fixed")
    assert group_degraded(plane, NS_LATE, name) == {}
    plane.kubectl("delete", "cg", name, "-n", NS_LATE, "--timeout=120s")
