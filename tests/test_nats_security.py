"""NATS over TLS with client certificates and passwords, and what a refusal looks like.

A real nats-server with ``tls { verify: true }`` and users with passwords (certificates
from a generated CA: harness.natssecurity) is started by this module and stopped when it
ends. Each refusal (a wrong password, a server certificate from an unknown CA, an
expired or a missing client certificate) must be one log line naming the reason, no
traceback, and a member that says it is not ready, and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.fleet import Fleet
from harness.localkube.pki import ensure_pki
from harness.natssecurity import NatsServerSecurity, NatsUser, issue_client_cert
from harness.servers import NatsServer, free_port
from harness.waiting import eventually
from shoal.clients.nats import HEALTH_SUBJECT, connect
from shoal.clients.natsauth import (
    NatsConfigError,
    NatsRefused,
    NatsSecurity,
    refusal,
)
from shoal.consumer import ready as readiness
from shoal.consumer.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PASSWORD = "member-secret"


@dataclasses.dataclass(frozen=True)
class Secured:
    server: NatsServer
    security: NatsServerSecurity
    other_ca: Path  # a CA that signed neither the server's nor the clients' certificates
    expired: tuple[Path, Path]  # a client certificate from the right CA, expired

    def client(self, **changes: str | None) -> NatsSecurity:
        """A member's settings that work, with `changes` applied."""
        return dataclasses.replace(self.security.client("member"), **changes)

    def env_but_password(self) -> dict[str, str]:
        """A member's working NATS_* settings but NATS_PASSWORD: the test adds one."""
        env = self.security.client_env("member")
        del env["NATS_PASSWORD"]
        return env


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    root = tmp_path_factory.mktemp("nats-secured")
    security = NatsServerSecurity.generate(root / "pki", [NatsUser("member", PASSWORD)])
    other = ensure_pki(root / "other-pki", {})
    expired = issue_client_cert(security.ca_file, root / "expired", "expired", expired=True)
    server = NatsServer(root / "nats", security=security)
    try:
        server.start()
        yield Secured(server, security, other.ca_cert, expired)
    finally:
        server.stop()


def refused_settings(secured: Secured) -> dict[str, tuple[NatsSecurity, str, str]]:
    """case -> (settings, reason, what the line must say)."""
    cert, key = secured.expired
    return {
        "wrong password": (secured.client(password="wrong"), "NatsAuthFailed", "Authorization"),
        "unknown CA": (
            secured.client(ca_file=str(secured.other_ca)),
            "NatsTLSFailed",
            "server's certificate was not accepted",
        ),
        "expired client certificate": (
            secured.client(cert_file=str(cert), key_file=str(key)),
            "NatsTLSFailed",
            "it has expired",
        ),
        "no client certificate": (
            secured.client(cert_file=None, key_file=None),
            "NatsTLSFailed",
            "requires a client certificate",
        ),
    }


CASES = ["wrong password", "unknown CA", "expired client certificate", "no client certificate"]


async def test_without_a_ca_file_the_system_cas_are_trusted(secured: Secured) -> None:
    # A tls:// URL and a client certificate, no NATS_CA_FILE: the system's CAs, which
    # do not know this test's CA.
    with pytest.raises(NatsRefused, match="unable to get local issuer certificate"):
        await connect(
            secured.server.url, name="t", attempts=1, security=secured.client(ca_file=None)
        )
    # And a plain nats:// URL still gets TLS from a server that requires it.
    plain = secured.server.url.replace("tls://", "nats://")
    nc = await connect(plain, name="t", attempts=1, security=secured.client())
    await nc.close()


async def test_connects_with_client_certificate_and_password(secured: Secured) -> None:
    assert secured.server.url.startswith("tls://")
    nc = await connect(secured.server.url, name="t", attempts=2, security=secured.client())
    try:
        # Round trips work (the health request is answered "no responders" by the server).
        with pytest.raises(Exception, match="no responders"):
            await nc.request(HEALTH_SUBJECT, b"", timeout=2)
        info = await nc.jetstream().account_info()
        assert info is not None
    finally:
        await nc.close()


@pytest.mark.parametrize("case", CASES)
async def test_a_refusal_names_its_reason(
    secured: Secured, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings, reason, says = refused_settings(secured)[case]
    started = time.monotonic()
    with pytest.raises(NatsRefused) as raised:
        await connect(secured.server.url, name="t", attempts=3, security=settings)
    # A refusal is not retried by one-shot callers: a person must act first.
    assert time.monotonic() - started < 3
    assert raised.value.why.reason == reason
    assert says in str(raised.value)
    assert "\n" not in str(raised.value)


async def listener_without_tls(seen: list[bytes]) -> asyncio.Server:
    """What answers on a NATS address without asking for TLS (a server set to
    allow_non_tls, the wrong Service, an impostor): its INFO, then it records every line
    the client writes."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = b'{"server_id":"x","version":"2.12.0","proto":1,"max_payload":1048576,'
        writer.write(b"INFO " + info + b'"headers":true,"auth_required":true}\r\n')
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            while line := await reader.readline():
                seen.append(line)
                if line.startswith(b"PING"):
                    writer.write(b"PONG\r\n")
                    await writer.drain()
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


@pytest.mark.parametrize("scheme", ["tls", "nats"])
async def test_credentials_never_go_to_a_server_without_tls(
    secured: Secured, tmp_path: Path, scheme: str
) -> None:
    """NATS_CA_FILE (or a tls:// URL) and a server whose INFO does not ask for TLS:
    refused before CONNECT is written, as NatsTLSFailed. Before, nats-py upgraded only
    when the server asked, and sent CONNECT with the password in the clear, twice (the
    probe, then the connection). The same against a real nats-server without TLS."""
    seen: list[bytes] = []
    listener = await listener_without_tls(seen)
    port = listener.sockets[0].getsockname()[1]
    plain = NatsServer(tmp_path / "plain")
    plain.start()
    try:
        for url in (f"{scheme}://127.0.0.1:{port}", plain.url.replace("nats://", f"{scheme}://")):
            with pytest.raises(NatsRefused) as raised:
                await connect(url, name="t", attempts=1, security=secured.client())
            assert raised.value.why.reason == "NatsTLSFailed", raised.value
            assert "does not offer TLS" in str(raised.value), raised.value
    finally:
        listener.close()
        plain.stop()
    assert seen == [], seen  # not a byte written, least of all the password


def nkey_user() -> tuple[str, str]:
    """(seed SU..., public key U...) of a new nkey user, as `nk -gen user -pubout` writes
    them: base32 of a two-byte prefix (seed, user) or one (user), the key, and a CRC16."""
    import base64
    import binascii

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    def encoded(raw: bytes) -> str:
        crc = binascii.crc_hqx(raw, 0).to_bytes(2, "little")
        return base64.b32encode(raw + crc).decode().rstrip("=")

    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    seed_prefix, user_prefix = 18 << 3, 20 << 3
    prefix = bytes([seed_prefix | (user_prefix >> 5), (user_prefix & 31) << 3])
    return encoded(prefix + seed), encoded(bytes([user_prefix]) + public)


async def test_an_nkey_seed_connects(tmp_path: Path) -> None:
    """NATS_NKEY_SEED_FILE against a real server with an nkey user. Before, nats-py's
    `nkeys` extra was not a dependency: every connect failed with ModuleNotFoundError,
    reported as "NATS ... unreachable" and retried for good (the chart's default
    credentialsType creds too, which signs the same way)."""
    seed, public = nkey_user()
    (tmp_path / "seed").write_text(seed + "\n")
    users = tmp_path / "users.conf"
    users.write_text(f'authorization {{ users = [ {{ nkey: "{public}" }} ] }}\n')
    server = NatsServer(tmp_path / "nats", extra_args=["-c", str(users)])
    server.start()
    try:
        nkey = NatsSecurity(nkey_seed_file=str(tmp_path / "seed"))
        nc = await connect(server.url, name="t", attempts=2, security=nkey)
        try:
            assert nc.is_connected
        finally:
            await nc.close()
        with pytest.raises(NatsRefused) as raised:  # and the server does check it
            await connect(server.url, name="t", attempts=2, security=NatsSecurity())
        assert raised.value.why.reason == "NatsAuthFailed"
    finally:
        server.stop()


async def test_a_password_in_the_url_is_in_no_log_or_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """nats-py takes nats://user:password@host (and nats://token@host); the password
    went verbatim into the logs, the errors, and from there the operator's status and
    Events ("JetStream at nats://u:pw@...")."""
    from shoal.clients.natsauth import redacted
    from shoal.consumer.cli_options import jetstream_refused, no_answer

    caplog.set_level(logging.INFO)
    url = f"nats://member:topsecret-pw@127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError) as raised:
        await connect(url, name="t", attempts=2)
    assert "topsecret-pw" not in str(raised.value) and "nats://***@127.0.0.1" in str(raised.value)
    assert "topsecret-pw" not in caplog.text
    assert redacted("tls://a:b@h1:4222,nats://tok@h2,h3:4222") == (
        "tls://***@h1:4222,nats://***@h2,h3:4222"
    )
    assert redacted("nats://h:4222") == "nats://h:4222"
    assert "topsecret" not in no_answer(url) + jetstream_refused(TimeoutError(), url)


async def test_a_member_retries_a_refusal_quietly(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    settings, _, _ = refused_settings(secured)["wrong password"]
    seen: list[str] = []
    task = asyncio.create_task(
        connect(
            secured.server.url,
            name="t",
            security=settings,
            on_refusal=lambda why: seen.append(str(why)),
        )
    )
    await asyncio.sleep(4)  # several attempts with backoff
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    lines = [r for r in caplog.records if "NatsAuthFailed" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert lines[0].exc_info is None
    assert len(seen) >= 3 and all(s.startswith("NatsAuthFailed: ") for s in seen)


def test_a_member_whose_login_is_dropped_exits_with_one_line(
    tmp_path: Path, etcd_endpoint: str, group: str
) -> None:
    """The server drops a connected member's login (its password rotated). nats-py then
    closes the connection for good instead of reconnecting (last_error: its
    AuthorizationError), so the member leaves its group and exits 1 with one line; the
    pod's restart connects again, with the secret as it is then."""
    security = NatsServerSecurity.generate(tmp_path / "pki", [NatsUser("member", PASSWORD)])
    server = NatsServer(tmp_path / "nats", security=security)
    ready_file = tmp_path / "ready.json"
    client = security.client("member")
    try:
        server.start()
        with member_fleet(
            tmp_path, server.url, etcd_endpoint, group, member_env(client, ready_file)
        ) as fleet:
            member = fleet.start("m-0")
            eventually(
                lambda: readiness.check(str(ready_file)),
                30,
                "the member to be ready",
                until=lambda result: result[0],
                interval=0.2,
            )
            rotated = dataclasses.replace(security, users=(NatsUser("member", "rotated"),))
            server.reload(rotated)
            assert fleet.wait_exit("m-0", 30) == 1
            text = member.log_text()
    finally:
        server.stop()
    lines = [line for line in text.splitlines() if "NatsAuthFailed" in line]
    assert len(lines) == 1, text
    assert "NATS closed this member's connection for good" in lines[0], text
    assert "Left group" in text, text
    assert "Traceback" not in text, text


def member_fleet(
    tmp_path: Path, nats_url: str, etcd_endpoint: str, group: str, env: dict[str, str]
) -> Fleet:
    """A member process of `group` (8 partitions) per `start`, with these NATS settings."""
    return Fleet(
        tmp_path / "members",
        nats_url=nats_url,
        etcd_endpoint=etcd_endpoint,
        namespace="test",
        group=group,
        partitions=8,
        env=env,
    )


def member_env(settings: NatsSecurity, ready_file: Path) -> dict[str, str]:
    env = {
        "NATS_CA_FILE": settings.ca_file or "",
        "NATS_CERT_FILE": settings.cert_file or "",
        "NATS_KEY_FILE": settings.key_file or "",
        "NATS_USER": settings.user or "",
        "NATS_PASSWORD": settings.password or "",
        "SHOAL_READY_FILE": str(ready_file),
    }
    return env


@pytest.mark.parametrize("case", CASES)
def test_a_refused_member_logs_one_line_and_is_not_ready(
    secured: Secured, etcd_endpoint: str, tmp_path: Path, group: str, case: str
) -> None:
    settings, reason, says = refused_settings(secured)[case]
    ready_file = tmp_path / "ready.json"
    env = member_env(settings, ready_file)
    with member_fleet(tmp_path, secured.server.url, etcd_endpoint, group, env) as fleet:
        member = fleet.start("m-0")
        message = eventually(
            lambda: readiness.check(str(ready_file))[1],
            30,
            "the member to say why it is not ready",
            until=lambda line: reason in line,
            interval=0.2,
        )
        assert message.startswith("not ready: member m-0: " + reason), message
        assert says in message
        time.sleep(4)  # more attempts, with backoff: still one line
        assert readiness.check(str(ready_file))[0] is False
        fleet.term("m-0")
        assert fleet.wait_exit("m-0", 20) == 0
        text = member.log_text()
    lines = [line for line in text.splitlines() if reason in line]
    assert len(lines) == 1, text
    assert says in lines[0] and "retrying" in lines[0], lines[0]
    assert "Traceback" not in text, text
    # Every attempt was seen as the refusal it is, none as an unreachable server.
    assert "unreachable" not in text, text


def test_unusable_settings_stop_the_member_at_once(
    secured: Secured, etcd_endpoint: str, tmp_path: Path, group: str
) -> None:
    settings = secured.client(key_file=None)  # a certificate without its key
    env = member_env(settings, tmp_path / "ready.json")
    with member_fleet(tmp_path, secured.server.url, etcd_endpoint, group, env) as fleet:
        member = fleet.start("m-0")
        assert fleet.wait_exit("m-0", 20) == 1
        text = member.log_text()
    assert "Error: NATS client certificate and key go together" in text, text
    assert "Traceback" not in text, text


def test_produce_takes_the_same_settings(secured: Secured) -> None:
    env = secured.env_but_password()
    args = ["produce", "-g", "sec", "--nats", secured.server.url, "-m", "0"]
    # Connected (TLS and password accepted): JetStream says the group has no stream.
    ok = CliRunner().invoke(main, args, env={**env, "NATS_PASSWORD": PASSWORD})
    assert ok.exit_code == 2 and "unknown group default/sec" in ok.output, ok.output
    assert "NatsAuthFailed" not in ok.output, ok.output
    refused = CliRunner().invoke(main, args, env={**env, "NATS_PASSWORD": "wrong"})
    assert refused.exit_code == 1
    assert "Error: NatsAuthFailed: NATS refused the credentials" in refused.output
    assert "Traceback" not in refused.output


def test_the_export_takes_the_same_settings(secured: Secured, tmp_path: Path) -> None:
    from shoal.analytics.cli import main as analytics

    env = secured.env_but_password()
    args = ["export", "-g", "nosuch", "--nats-url", secured.server.url, "-o", str(tmp_path)]
    # Connected (TLS and password accepted); the group has no log stream.
    ok = CliRunner().invoke(analytics, args, env={**env, "NATS_PASSWORD": PASSWORD})
    assert ok.exit_code == 1 and "NatsAuthFailed" not in ok.output, ok.output
    assert "nosuch" in ok.output, ok.output
    refused = CliRunner().invoke(analytics, args, env={**env, "NATS_PASSWORD": "wrong"})
    assert refused.exit_code == 1
    assert "Error: NatsAuthFailed: NATS refused the credentials" in refused.output
    assert "Traceback" not in refused.output


def test_settings_are_checked_before_connecting(tmp_path: Path) -> None:
    with pytest.raises(NatsConfigError, match="user and password go together"):
        NatsSecurity(user="u").check()
    with pytest.raises(NatsConfigError, match="one of a credentials file"):
        NatsSecurity(user="u", password="p", creds_file=__file__).check()
    with pytest.raises(NatsConfigError, match=r"CA file .* is not readable"):
        NatsSecurity(ca_file=str(tmp_path / "missing.crt")).check()
    (tmp_path / "junk.crt").write_text("not a certificate")
    with pytest.raises(NatsConfigError, match="TLS files cannot be used"):
        NatsSecurity(ca_file=str(tmp_path / "junk.crt")).check()
    with pytest.raises(NatsConfigError, match="inbox prefix"):
        NatsSecurity(inbox_prefix="_INBOX.>").check()
    assert "***" in repr(NatsSecurity(user="u", password="secret"))
    assert "secret" not in repr(NatsSecurity(user="u", password="secret"))


def test_refusal_reads_what_nats_py_raises() -> None:
    from nats import errors

    auth = refusal(errors.Error("nats: 'Authorization Violation'"))
    assert auth is not None and auth.reason == "NatsAuthFailed"
    assert refusal(ConnectionRefusedError(111, "refused")) is None
    wrapped = RuntimeError("connect failed")
    wrapped.__cause__ = ssl.SSLError(1, "[SSL: SSLV3_ALERT_CERTIFICATE_EXPIRED]")
    assert refusal(wrapped) is not None
