"""spec.etcd.tlsSecret on the local control plane: a group on an etcd with client TLS.

This file starts its own etcd with client TLS and client-certificate auth
(`--client-cert-auth`; certificates from harness/src/harness/localkube/pki.py) and with etcd
authentication on. Each namespace's groups can only work one way: user `shoal`, with a
password from the Secret, may use /shoal/etcd-tls/ only; user `shoal-consumer`, the
client certificate's CN (no password: etcd takes the CN as the user), may use
/shoal/etcd-tls-late/ only. The plane's plain etcd serves the
other suites. The operator runs as a local process watching only this file's namespaces
(it reads the Secrets with the plane's admin credentials: the chart's RBAC for Secrets is
checked by test_helm.py); consumer pods get the Secret from the process kubelet, which
writes it to a private per-pod directory and points the pods' env there.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import etcd3
import pytest
import yaml
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

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
from harness.localkube.pki import Pki, ensure_pki, ensure_serving_cert
from harness.localkube.plane import LocalKube
from harness.servers import EtcdServer, EtcdTLS
from shoal.clients.etcd import Etcd
from shoal.contracts.names import Keys
from shoal.group.status import GroupStatus, read_status
from shoal.operator.builders import ETCD_SECRET_VERSION
from shoal.operator.reconciler import OBSERVE_INTERVAL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parent.parent
NS, NS_LATE = "etcd-tls", "etcd-tls-late"
CLIENT_CN = "shoal-consumer"
USER, PASSWORD = "shoal", secrets.token_hex(8)
ROOT_PASSWORD = secrets.token_hex(8)


@dataclass
class TlsEtcd:
    server: EtcdServer
    pki: Pki

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def files(self) -> dict[str, Path]:
        cert, key = self.pki.client("etcd-client")
        return {"ca.crt": self.pki.ca_cert, "tls.crt": cert, "tls.key": key}

    def client(self) -> Etcd:
        """An async client as etcd's root (TLS, certificate and password)."""
        files = self.files()
        return Etcd(
            self.endpoint,
            ca_file=str(files["ca.crt"]),
            cert_file=str(files["tls.crt"]),
            key_file=str(files["tls.key"]),
            username="root",
            password=ROOT_PASSWORD,
        )


def _prefix(ns: str) -> auth_pb2.Permission:
    start = f"/shoal/{ns}/".encode()
    return auth_pb2.Permission(
        permType=auth_pb2.Permission.READWRITE, key=start, range_end=start[:-1] + b"0"
    )


def _enable_auth(server: EtcdServer, files: dict[str, Path]) -> None:
    host, port = server.endpoint.rsplit(":", 1)
    admin = etcd3.client(
        host=host,
        port=int(port),
        ca_cert=str(files["ca.crt"]),
        cert_cert=str(files["tls.crt"]),
        cert_key=str(files["tls.key"]),
        timeout=5,
    )
    try:
        auth = etcdrpc.AuthStub(admin.channel)
        auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"))
        for role, ns in (("password-users", NS), ("certificate-users", NS_LATE)):
            auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name=role))
            auth.RoleGrantPermission(
                etcdrpc.AuthRoleGrantPermissionRequest(name=role, perm=_prefix(ns))
            )
        for user, password, role in (
            ("root", ROOT_PASSWORD, "root"),
            (USER, PASSWORD, "password-users"),
            # Certificate-only clients: its password is never used.
            (CLIENT_CN, secrets.token_hex(8), "certificate-users"),
        ):
            auth.UserAdd(etcdrpc.AuthUserAddRequest(name=user, password=password))
            auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=user, role=role))
        auth.AuthEnable(etcdrpc.AuthEnableRequest())
    finally:
        admin.close()


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsEtcd]:
    workdir = tmp_path_factory.mktemp("etcd-tls")
    pki = ensure_pki(workdir / "pki", {"etcd-client": CLIENT_CN})
    cert, key = ensure_serving_cert(pki, "etcd-server")
    server = EtcdServer(workdir / "etcd", tls=EtcdTLS(cert, key, pki.ca_cert))
    try:
        server.start()
        tls = TlsEtcd(server, pki)
        _enable_auth(server, tls.files())
        yield tls
    finally:
        server.stop()


@pytest.fixture(scope="module")
def operator(
    localkube: LocalKube, tls_etcd: TlsEtcd, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    log_path = tmp_path_factory.mktemp("etcd-tls-operator") / "operator.log"
    with operator_watching(localkube, [NS, NS_LATE], log_path):
        yield log_path


def group(ns: str, name: str, replicas: int, etcd: dict[str, str]) -> str:
    manifest = yaml.safe_load((ROOT / "examples" / "consumergroup.yaml").read_text())
    manifest["metadata"] = {"name": name, "namespace": ns}
    manifest["spec"]["replicas"] = replicas
    manifest["spec"]["etcd"] = etcd
    return json.dumps(manifest)


def warnings(plane: LocalKube, ns: str, reason: str) -> str:
    return plane.kubectl(
        "get", "events", "-n", ns, "--field-selector", f"reason={reason},type=Warning"
    ).stdout


async def read_group(etcd: Etcd, ns: str, name: str) -> GroupStatus:
    await etcd.connect(attempts=5)
    return await read_status(etcd, ns, name, 128)


def tls_status(tls: TlsEtcd, ns: str, name: str) -> GroupStatus:
    etcd = tls.client()
    try:
        return asyncio.run(read_group(etcd, ns, name))
    finally:
        etcd.close()


def keys_under(endpoint_client: Etcd, prefix: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        await endpoint_client.connect(attempts=5)
        return dict((await endpoint_client.get_prefix(prefix))[1])

    try:
        return asyncio.run(go())
    finally:
        endpoint_client.close()


def test_a_group_on_tls_etcd_runs_and_its_finalizer_clears_it(
    localkube: LocalKube, tls_etcd: TlsEtcd, operator: Path
) -> None:
    plane, name = localkube, "orders"
    apply_secret(plane, NS, "etcd-client", tls_etcd.files(), username=USER, password=PASSWORD)
    started = time.monotonic()
    plane.kubectl(
        "apply",
        "-f",
        "-",
        input_text=group(NS, name, 2, {"endpoints": tls_etcd.endpoint, "tlsSecret": "etcd-client"}),
    )
    cg = wait_until(lambda: group_ready(plane, NS, name), 90, "the group to become Ready")
    print(f"Ready on TLS etcd in {time.monotonic() - started:.1f} s")
    status = cg["status"]
    assert status["leader"].startswith(f"{name}-consumer-")
    assert status["members"] == 2 and status["skew"] <= 1
    assert condition(cg, "Degraded")["status"] == "False"

    # The members registered in the TLS etcd, and not in the plane's plain one.
    seen = tls_status(tls_etcd, NS, name)
    assert sorted(seen.members) == sorted(
        p["metadata"]["name"]
        for p in namespace_pods(plane, NS)
        if p["metadata"]["name"].startswith(name)
    )
    assert seen.leader == status["leader"] and not seen.unowned
    prefix = Keys(NS, name).prefix
    assert keys_under(Etcd(plane.state.etcd_endpoint), prefix) == {}

    # How the pods got it: the Secret mounted read-only, the credentials from it.
    template = get_json(plane, "deployment", f"{name}-consumer", "-n", NS)["spec"]["template"]
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "etcd-tls"]
    assert volume["secret"]["secretName"] == "etcd-client"
    env = {var["name"]: var for var in template["spec"]["containers"][0]["env"]}
    assert env["ETCD_CA_FILE"]["value"] == "/etc/shoal/etcd/ca.crt"
    assert env["ETCD_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "etcd-client"

    def secret_version() -> str | None:
        dep = get_json(plane, "deployment", f"{name}-consumer", "-n", NS)
        annotations = dep["spec"]["template"]["metadata"].get("annotations") or {}
        return annotations.get(ETCD_SECRET_VERSION)

    # A change of the Secret's metadata only (a label, as tools that copy or watch
    # Secrets add) is no rotation: the pods would read the same files again. It used to
    # roll them (the version was the Secret's resourceVersion). Three status ticks.
    before = {p["metadata"]["name"] for p in namespace_pods(plane, NS)}
    applied = secret_version()
    assert applied
    plane.kubectl("label", "secret", "etcd-client", "-n", NS, "team=payments")
    time.sleep(3 * OBSERVE_INTERVAL)
    assert secret_version() == applied
    assert {p["metadata"]["name"] for p in namespace_pods(plane, NS)} == before

    # A rotated Secret rolls the pods (they read their certificates at start).
    apply_secret(
        plane, NS, "etcd-client", tls_etcd.files(), username=USER, password=PASSWORD, rotated="1"
    )

    def rolled() -> Any:
        version = secret_version()
        pods = {p["metadata"]["name"] for p in namespace_pods(plane, NS)}
        cg = group_ready(plane, NS, name)
        fresh = pods and not pods & before and len(pods) == 2
        settled = cg and cg["status"]["members"] == 2  # the old members have left
        return version and version != applied and fresh and settled

    wait_until(rolled, 120, "the pods to roll onto the rotated Secret")
    assert "EtcdSecretRotated" in plane.kubectl("describe", "cg", name, "-n", NS).stdout

    plane.kubectl("delete", "cg", name, "-n", NS, "--timeout=120s")
    assert not [p for p in namespace_pods(plane, NS) if p["metadata"]["name"].startswith(name)]
    assert keys_under(tls_etcd.client(), prefix) == {}


def test_a_missing_then_invalid_secret_degrades_until_it_is_fixed(
    localkube: LocalKube, tls_etcd: TlsEtcd, operator: Path
) -> None:
    plane, name = localkube, "late"
    spec = {"endpoints": tls_etcd.endpoint, "tlsSecret": "etcd-late"}
    plane.kubectl("apply", "-f", "-", input_text=group(NS_LATE, name, 1, spec))

    missing = wait_until(lambda: group_degraded(plane, NS_LATE, name), 60, "EtcdSecretMissing")
    assert missing["reason"] == "EtcdSecretMissing", missing
    assert missing["message"] == f"Secret {NS_LATE}/etcd-late (spec.etcd.tlsSecret) not found"
    wait_until(
        lambda: "etcd-late" in warnings(plane, NS_LATE, "EtcdSecretMissing"),
        30,
        "a Warning Event EtcdSecretMissing",
    )
    # Nothing runs for it yet: pods would only wait for a volume that cannot mount.
    assert (
        plane.kubectl(
            "get", "deployment", f"{name}-consumer", "-n", NS_LATE, check=False
        ).returncode
        != 0
    )

    # A Secret without the client certificate: invalid, and it says what is missing.
    files = tls_etcd.files()
    apply_secret(plane, NS_LATE, "etcd-late", {"ca.crt": files["ca.crt"]})
    invalid = wait_until(
        lambda: (
            (d := group_degraded(plane, NS_LATE, name)).get("reason") == "EtcdSecretInvalid" and d
        ),
        60,
        "EtcdSecretInvalid",
    )
    assert "has no tls.crt, tls.key" in invalid["message"]
    wait_until(
        lambda: "tls.crt" in warnings(plane, NS_LATE, "EtcdSecretInvalid"),
        30,
        "a Warning Event EtcdSecretInvalid",
    )

    # Fixed (certificate only, no password: etcd takes the certificate's CN as the user).
    started = time.monotonic()
    apply_secret(plane, NS_LATE, "etcd-late", files)
    wait_until(lambda: group_ready(plane, NS_LATE, name), 120, "the group to recover")
    print(f"recovered {time.monotonic() - started:.1f} s after the Secret was fixed")
    assert group_degraded(plane, NS_LATE, name) == {}
    assert len(tls_status(tls_etcd, NS_LATE, name).members) == 1

    plane.kubectl("delete", "cg", name, "-n", NS_LATE, "--timeout=120s")
    assert keys_under(tls_etcd.client(), Keys(NS_LATE, name).prefix) == {}
