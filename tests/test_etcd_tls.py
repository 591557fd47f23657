"""The consumer's etcd client over TLS, with client certificates and with a username.

A real etcd with client TLS (`--client-cert-auth`, certificates from the local plane's
PKI code) is started by this module and stopped when it ends, whatever happened; the
tests that use it are marked e2e (`make test-fast` runs only the others).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

import etcd3
import pytest
from click.testing import CliRunner
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from harness.localkube.pki import Pki, ensure_pki, ensure_serving_cert
from harness.proxy import TcpProxy
from harness.servers import EtcdServer, EtcdTLS
from shoal.clients.etcd import (
    TRANSIENT_ERRORS,
    Etcd,
    EtcdAuthError,
    EtcdConfigError,
    EtcdUnavailable,
    check_security,
    prefix_end,
)
from shoal.consumer.cli import main
from shoal.contracts.names import Keys
from shoal.contracts.values import MemberStats
from shoal.group import view as view_module
from shoal.group.config import config_from_env
from shoal.group.view import GroupView
from shoal.operator.etcdsecret import EtcdClients, EtcdSecretProblem, SecretData

pytestmark = pytest.mark.timeout(120)

CLIENT = "etcd-client"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return ensure_pki(tmp_path_factory.mktemp("etcd-pki"), {CLIENT: "shoal-consumer"})


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[EtcdServer]:
    cert, key = ensure_serving_cert(pki, "etcd-server")
    server = EtcdServer(tmp_path_factory.mktemp("etcd-tls"), tls=EtcdTLS(cert, key, pki.ca_cert))
    try:
        server.start()
        yield server
    finally:
        server.stop()


class TlsOptions(TypedDict, total=False):
    """Etcd's TLS keyword arguments."""

    ca_file: str
    cert_file: str
    key_file: str


def tls_options(pki: Pki) -> TlsOptions:
    cert, key = pki.client(CLIENT)
    return {"ca_file": str(pki.ca_cert), "cert_file": str(cert), "key_file": str(key)}


@pytest.mark.e2e
async def test_connects_with_the_client_certificate(tls_etcd: EtcdServer, pki: Pki) -> None:
    etcd = Etcd(tls_etcd.endpoint, **tls_options(pki))
    try:
        await etcd.connect(attempts=3)
        await etcd.put("/shoal/tls/probe", b"hello")
        _, kvs = await etcd.get_prefix("/shoal/tls/")
        assert kvs["/shoal/tls/probe"].value == b"hello"
        lease = await etcd.grant_lease(5)
        assert await etcd.refresh_lease(lease) > 0
        await etcd.revoke_lease(lease)
    finally:
        etcd.close()


@pytest.mark.e2e
@pytest.mark.parametrize("without", ["client certificate", "TLS"])
async def test_fails_clearly_without_the_certificate(
    tls_etcd: EtcdServer, pki: Pki, without: str
) -> None:
    options: TlsOptions = {"ca_file": str(pki.ca_cert)} if without == "client certificate" else {}
    etcd = Etcd(tls_etcd.endpoint, **options)
    try:
        with pytest.raises(EtcdUnavailable) as info:
            await etcd.connect(attempts=2, max_delay=0.2)
    finally:
        etcd.close()
    message = str(info.value)
    assert f"etcd at {tls_etcd.endpoint} unreachable after 2 attempts" in message
    assert "\n" not in message
    if without == "client certificate":
        assert "TLS problem?" in message  # what gRPC said, and what to check


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ca_file": "/nonexistent/ca.crt"}, "etcd CA file /nonexistent/ca.crt is not readable"),
        (
            {"ca_file": "CA", "cert_file": "/nonexistent/tls.crt", "key_file": "KEY"},
            "etcd client certificate file /nonexistent/tls.crt is not readable",
        ),
        ({"ca_file": "CA", "cert_file": "CERT"}, "certificate and key go together"),
        ({"key_file": "KEY", "cert_file": "CERT"}, "needs the CA file"),
        ({"ca_file": "CA", "username": "u"}, "username and password go together"),
        ({"username": "u", "password": "p"}, "need TLS"),
    ],
)
def test_bad_settings_are_one_clear_line(pki: Pki, options: dict[str, str], message: str) -> None:
    real = tls_options(pki)
    resolved = {
        k: {"CA": real["ca_file"], "CERT": real["cert_file"], "KEY": real["key_file"]}.get(v, v)
        for k, v in options.items()
    }
    with pytest.raises(EtcdConfigError, match=message) as info:
        check_security(
            resolved.get("ca_file"),
            resolved.get("cert_file"),
            resolved.get("key_file"),
            resolved.get("username"),
            resolved.get("password"),
        )
    assert "\n" not in str(info.value)
    with pytest.raises(EtcdConfigError, match=message):
        Etcd("127.0.0.1:1", **resolved)  # type: ignore[arg-type]


def test_an_unreadable_file_stops_the_consumer_with_one_line(tmp_path: Path) -> None:
    unreadable = tmp_path / "ca.crt"
    unreadable.write_text("x")
    unreadable.chmod(0)
    path = unreadable if os.geteuid() != 0 else tmp_path / "missing.crt"  # root reads all
    result = CliRunner().invoke(
        main,
        ["run", "--group", "g", "--etcd", "127.0.0.1:1"],
        env={"ETCD_CA_FILE": str(path), "SHOAL_MEMBER_ID": "m"},
    )
    assert result.exit_code == 1, result.output
    assert result.output.strip() == f"Error: etcd CA file {path} is not readable: " + (
        "Permission denied" if path == unreadable else "No such file or directory"
    )


def test_the_config_reads_the_settings_from_the_environment() -> None:
    config = config_from_env(
        {
            "SHOAL_GROUP": "g",
            "SHOAL_MEMBER_ID": "m",
            "ETCD_CA_FILE": "/etc/shoal/etcd/ca.crt",
            "ETCD_CERT_FILE": "/etc/shoal/etcd/tls.crt",
            "ETCD_KEY_FILE": "/etc/shoal/etcd/tls.key",
            "ETCD_USERNAME": "shoal",
            "ETCD_PASSWORD": "s3cret",
        }
    )
    assert config.etcd_options() == {
        "ca_file": "/etc/shoal/etcd/ca.crt",
        "cert_file": "/etc/shoal/etcd/tls.crt",
        "key_file": "/etc/shoal/etcd/tls.key",
        "username": "shoal",
        "password": "s3cret",
    }
    assert "s3cret" not in repr(config) and "s3cret" not in str(config.model_dump())
    plain = config_from_env({"SHOAL_GROUP": "g", "SHOAL_MEMBER_ID": "m"}).etcd_options()
    assert set(plain.values()) == {None}


# -- a username and password on top of TLS ---------------------------------------------------


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[EtcdServer]:
    """A TLS etcd with authentication on: user `shoal` may read and write /shoal/ only."""
    cert, key = ensure_serving_cert(pki, "etcd-server")
    server = EtcdServer(tmp_path_factory.mktemp("etcd-auth"), tls=EtcdTLS(cert, key, pki.ca_cert))
    try:
        server.start()
        host, port = server.endpoint.rsplit(":", 1)
        options = tls_options(pki)
        admin = etcd3.client(
            host=host,
            port=int(port),
            ca_cert=options["ca_file"],
            cert_cert=options["cert_file"],
            cert_key=options["key_file"],
            timeout=5,
        )
        try:
            auth = etcdrpc.AuthStub(admin.channel)
            for user, password, role in (("root", "rootpw", "root"), ("shoal", "pw", "shoal")):
                auth.UserAdd(etcdrpc.AuthUserAddRequest(name=user, password=password))
                auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name=role))
                auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=user, role=role))
            readwrite = auth_pb2.Permission(
                permType=auth_pb2.Permission.READWRITE, key=b"/shoal/", range_end=b"/shoal0"
            )
            auth.RoleGrantPermission(
                etcdrpc.AuthRoleGrantPermissionRequest(name="shoal", perm=readwrite)
            )
            auth.AuthEnable(etcdrpc.AuthEnableRequest())
        finally:
            admin.close()
        yield server
    finally:
        server.stop()


def as_root(server: EtcdServer, pki: Pki, requests: list[tuple[str, object]]) -> None:
    """Send auth requests (the AuthStub method's name, its request) as etcd's root."""
    host, port = server.endpoint.rsplit(":", 1)
    options = tls_options(pki)
    root = etcd3.client(
        host=host,
        port=int(port),
        ca_cert=options["ca_file"],
        cert_cert=options["cert_file"],
        cert_key=options["key_file"],
        user="root",
        password="rootpw",
        timeout=5,
    )
    try:
        auth = etcdrpc.AuthStub(root.channel)
        for method, request in requests:
            getattr(auth, method)(request, 5, credentials=root.call_credentials)
    finally:
        root.close()


def set_password(server: EtcdServer, pki: Pki, user: str, password: str) -> None:
    request = etcdrpc.AuthUserChangePasswordRequest(name=user, password=password)
    as_root(server, pki, [("UserChangePassword", request)])


def grant(server: EtcdServer, pki: Pki, role: str, start: str, end: str) -> None:
    """Let `role` read and write the keys from `start` to `end` (excluded)."""
    perm = auth_pb2.Permission(
        permType=auth_pb2.Permission.READWRITE, key=start.encode(), range_end=end.encode()
    )
    request = etcdrpc.AuthRoleGrantPermissionRequest(name=role, perm=perm)
    as_root(server, pki, [("RoleGrantPermission", request)])


@pytest.mark.e2e
async def test_a_username_and_password_over_tls(auth_etcd: EtcdServer, pki: Pki) -> None:
    etcd = Etcd(auth_etcd.endpoint, username="shoal", password="pw", **tls_options(pki))
    try:
        await etcd.connect(attempts=3)
        await etcd.put("/shoal/auth/a", b"1")
        assert "/shoal/auth/a" in (await etcd.get_prefix("/shoal/auth/"))[1]
        lease = await etcd.grant_lease(5)
        assert await etcd.refresh_lease(lease) > 0
        # Outside its permissions: one clear error, not a gRPC dump.
        with pytest.raises(EtcdAuthError, match="refused user 'shoal': etcdserver: permission"):
            await etcd.put("/elsewhere", b"1")

        # etcd forgets the user's tokens when its password is set (here: to the same one):
        # the next call is refused, transiently, and the one after runs on a new token.
        set_password(auth_etcd, pki, "shoal", "pw")
        refused = 0
        for _ in range(3):
            try:
                await etcd.put("/shoal/auth/b", b"2")
                break
            except etcd3.exceptions.ConnectionFailedError:
                refused += 1
        assert refused == 1
        assert (await etcd.get_prefix("/shoal/auth/"))[1]["/shoal/auth/b"].value == b"2"
    finally:
        etcd.close()


@pytest.mark.e2e
async def test_a_wrong_password_is_not_retried(auth_etcd: EtcdServer, pki: Pki) -> None:
    etcd = Etcd(auth_etcd.endpoint, username="shoal", password="wrong", **tls_options(pki))
    try:
        with pytest.raises(EtcdAuthError, match=r"refused user 'shoal'.*invalid user ID"):
            await etcd.connect(attempts=5)
    finally:
        etcd.close()


@pytest.mark.e2e
async def test_auth_enabled_but_no_credentials_is_clear(auth_etcd: EtcdServer, pki: Pki) -> None:
    # No token: etcd takes the client certificate's CN as the user, who does not exist.
    etcd = Etcd(auth_etcd.endpoint, **tls_options(pki))
    try:
        await etcd.connect(attempts=2, max_delay=0.2)
        with pytest.raises(EtcdAuthError, match="refused an anonymous client"):
            await etcd.put("/shoal/auth/c", b"3")
    finally:
        etcd.close()


@pytest.mark.e2e
async def test_the_leaders_stats_poll_outlives_a_refusal(
    auth_etcd: EtcdServer,
    pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The leader's poll of stats/ (GroupView.follow_stats) met an error etcd3 does not
    map to a retryable one (here etcd's RBAC refusing the range: a role granted the
    group's keys before stats/ existed) and ended for good, silently: the leader then
    read every member's routine stats as they were, they went stale, and the autoscaler
    never scaled down again. It must say so and keep trying, as the group's watch does."""
    monkeypatch.setattr(view_module, "STATS_POLL_SECONDS", 0.1)
    keys = Keys("tls", "stats-poll")
    as_root(
        auth_etcd,
        pki,
        [
            ("UserAdd", etcdrpc.AuthUserAddRequest(name="leader", password="lpw")),
            ("RoleAdd", etcdrpc.AuthRoleAddRequest(name="leader")),
            ("UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user="leader", role="leader")),
        ],
    )
    grant(auth_etcd, pki, "leader", keys.prefix, keys.stats)  # everything but stats/
    writer = Etcd(auth_etcd.endpoint, username="shoal", password="pw", **tls_options(pki))
    etcd = Etcd(auth_etcd.endpoint, username="leader", password="lpw", **tls_options(pki))
    view = GroupView(etcd, keys, 8)
    task = asyncio.create_task(view.run())
    try:
        await writer.connect(attempts=2)
        await etcd.connect(attempts=2)
        stats = MemberStats(ts=time.time(), cpu=12.5).to_json()
        await writer.put(keys.member("m-a"), stats)
        await writer.put(keys.member_stats("m-a"), stats)
        async with asyncio.timeout(10):
            await view.synced.wait()
        caplog.set_level(logging.WARNING, logger="shoal.group.view")
        view.follow_stats(True)
        await asyncio.sleep(0.5)
        assert not view.stats_synced.is_set()
        assert "Could not read members' stats" in caplog.text
        assert "refused user 'leader'" in caplog.text

        grant(auth_etcd, pki, "leader", keys.stats, prefix_end(keys.stats))
        # (The backoff after a failure starts at the poll interval and doubles.)
        async with asyncio.timeout(10):
            await view.stats_synced.wait()
        assert keys.member_stats("m-a") in view.stats_kvs
    finally:
        view.follow_stats(False)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        etcd.close()
        writer.close()


# -- the operator's clients, from a Secret -----------------------------------------------------


class Secrets:
    def __init__(self) -> None:
        self.secrets: dict[tuple[str, str], SecretData] = {}

    async def read_secret(self, namespace: str, name: str) -> SecretData | None:
        return self.secrets.get((namespace, name))


def secret_data(pki: Pki, version: str) -> SecretData:
    cert, key = pki.client(CLIENT)
    files = {"ca.crt": pki.ca_cert, "tls.crt": cert, "tls.key": key}
    return SecretData(
        version, {k: base64.b64encode(path.read_bytes()).decode() for k, path in files.items()}
    )


@pytest.mark.e2e
async def test_the_operator_connects_with_the_groups_secret(
    tls_etcd: EtcdServer, pki: Pki, tmp_path: Path
) -> None:
    secrets = Secrets()
    clients = EtcdClients(secrets, tmp_path / "operator")
    try:
        with pytest.raises(EtcdSecretProblem, match="not found"):
            await clients.get(tls_etcd.endpoint, "prod", "etcd-client")
        secrets.secrets["prod", "etcd-client"] = secret_data(pki, "1")
        etcd = await clients.get(tls_etcd.endpoint, "prod", "etcd-client")
        await etcd.put("/shoal/prod/op/x", b"1")
        assert await clients.get(tls_etcd.endpoint, "prod", "etcd-client") is etcd
        # Without the Secret, the same endpoint is another (plain) client, which fails.
        with pytest.raises(EtcdUnavailable):
            await clients.get(tls_etcd.endpoint)

        # A new version of the Secret: a new client; the old one and its files are gone.
        old_dir = Path(str(etcd.ca_file)).parent
        secrets.secrets["prod", "etcd-client"] = secret_data(pki, "2")
        fresh = await clients.get(tls_etcd.endpoint, "prod", "etcd-client")
        assert fresh is not etcd and not old_dir.exists()
        _, kvs = await fresh.get_prefix("/shoal/prod/op/")
        assert set(kvs) == {"/shoal/prod/op/x"}
    finally:
        clients.close()
    assert not (tmp_path / "operator").exists()


async def longest_stall(stop: asyncio.Event, tick: float = 0.01) -> float:
    """How much later than asked the event loop woke a sleeper, at worst, until `stop`."""
    worst = 0.0
    while not stop.is_set():
        asked = time.monotonic()
        await asyncio.sleep(tick)
        worst = max(worst, time.monotonic() - asked - tick)
    return worst


@pytest.mark.e2e
async def test_an_outage_with_auth_never_blocks_the_event_loop(
    auth_etcd: EtcdServer, pki: Pki
) -> None:
    """With a username, building a client is an Authenticate RPC. During an outage (both
    endpoints silent) each fail-over builds one, and each must run in a worker thread: on
    the event loop it stalled everything (keep-alives, in-progress acks, probes) for up
    to the whole timeout, again and again."""
    timeout = 2.0
    with (
        TcpProxy(auth_etcd.endpoint, name="etcd-a") as a,
        TcpProxy(auth_etcd.endpoint, name="etcd-b") as b,
    ):
        etcd = Etcd(
            f"{a.address},{b.address}",
            timeout=timeout,
            username="shoal",
            password="pw",
            **tls_options(pki),
        )
        stop = asyncio.Event()
        monitor: asyncio.Task[float] | None = None
        try:
            await etcd.connect(attempts=3)
            await etcd.put("/shoal/stall/a", b"1")
            a.blackhole()
            b.blackhole()
            monitor = asyncio.create_task(longest_stall(stop))
            failures = 0
            deadline = time.monotonic() + 4 * timeout
            while time.monotonic() < deadline:
                try:
                    await etcd.put("/shoal/stall/a", b"2")
                except TRANSIENT_ERRORS:
                    failures += 1
                await asyncio.sleep(0.05)
            stop.set()
            stall = await monitor
            print(f"longest event-loop stall during the outage: {stall:.3f} s")
            assert failures >= 2
            assert stall < 0.5, f"the event loop stalled {stall:.2f} s"
            # And back to normal after it.
            a.pass_through()
            b.pass_through()
            for _ in range(10):
                try:
                    await etcd.put("/shoal/stall/a", b"3")
                    break
                except TRANSIENT_ERRORS:
                    await asyncio.sleep(0.5)
            assert (await etcd.get_prefix("/shoal/stall/"))[1]["/shoal/stall/a"].value == b"3"
        finally:
            stop.set()
            if monitor is not None:
                await asyncio.gather(monitor, return_exceptions=True)
            etcd.close()
