"""A member NATS refuses says so in etcd (Keys.problems), and `shoal-consumer status` shows it.

Real etcd (the session's) and, for the member processes, a real nats-server with TLS and
passwords (harness.natssecurity) started by each test, so that one can change its users.

1. RefusalReporter alone: one write per refusal however often it is reported, kept alive
   past its TTL, gone when NATS accepts the member or it closes; garbage in the view.
2. A member process with a wrong password: listed by `shoal-consumer status` (text and
   --json) with NatsAuthFailed though it never joined; the server then accepts its password
   (a config reload) and the key goes, the member joins. A refused member that is stopped
   takes its key with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.fleet import Fleet
from harness.natssecurity import NatsServerSecurity, NatsUser
from harness.servers import NatsServer
from harness.waiting import eventually, eventually_async
from shoal.clients.etcd import Etcd
from shoal.clients.natsauth import NatsRefusal
from shoal.contracts.names import Keys
from shoal.group.problems import RefusalReporter
from shoal.group.status import status_from_view
from shoal.group.view import GroupView

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PASSWORD = "member-secret"
AUTH = NatsRefusal("NatsAuthFailed", "NATS refused the credentials (Authorization Violation)")


async def test_the_reporter_writes_once_keeps_alive_and_removes(
    etcd: Etcd, namespace: str, group: str
) -> None:
    keys = Keys(namespace, group)
    key = keys.problem("m-0")
    reporter = RefusalReporter(etcd, key, ttl=2, keepalive=0.5)

    async def value() -> Any:
        _, kvs = await etcd.get_prefix(keys.problems)
        return kvs.get(key)

    before = time.time()
    reporter.report(AUTH)
    kv = await eventually_async(value, 10, "the refusal in etcd", interval=0.05)
    data = json.loads(kv.value)
    assert (data["reason"], data["message"]) == (AUTH.reason, AUTH.message)
    assert before - 1 <= data["since"] <= time.time() + 1
    for _ in range(20):  # a refusal at every retry: nothing new to write
        reporter.report(AUTH)
    await asyncio.sleep(3)  # longer than the TTL: the lease is kept alive
    still = await value()
    assert still is not None and still.mod_revision == kv.mod_revision

    # Another reason: written again, the episode keeps its start.
    reporter.report(NatsRefusal("NatsTLSFailed", "the server's certificate was not accepted"))
    changed = await eventually_async(
        value, 10, "the new reason", until=lambda kv: b"NatsTLSFailed" in kv.value
    )
    assert json.loads(changed.value)["since"] == data["since"]

    reporter.report(None)  # NATS accepts the member
    await eventually_async(value, 10, "the key to go", until=lambda kv: kv is None)

    reporter.report(AUTH)  # refused again (a new episode), then the member exits
    await eventually_async(value, 10, "the refusal again", interval=0.05)
    await reporter.close()
    assert await value() is None


async def test_the_view_ignores_garbage_problems(
    etcd: Etcd, namespace: str, group: str, caplog: pytest.LogCaptureFixture
) -> None:
    keys = Keys(namespace, group)
    good = {"reason": "NatsTLSFailed", "message": "expired", "since": 1700000000.5}
    await etcd.put(keys.problem("m-good"), json.dumps(good).encode())
    await etcd.put(keys.problem("m-text"), b"not json")
    await etcd.put(keys.problem("m-list"), b"[1, 2]")
    await etcd.put(keys.problem("m-noreason"), json.dumps({**good, "reason": ""}).encode())
    await etcd.put(keys.problem("m-since"), json.dumps({**good, "since": "yesterday"}).encode())
    await etcd.put(keys.problem("m-bool"), json.dumps({**good, "since": True}).encode())
    view = GroupView(etcd, keys, 8)
    view.load(*await etcd.get_prefix(keys.prefix))
    for _ in range(2):  # garbage is logged once by a view, not at every read
        status = status_from_view(view, namespace, group)
    assert list(status.problems) == ["m-good"]
    assert status.problems["m-good"].reason == "NatsTLSFailed"
    assert status.members == {}  # a problem is no member: the leader gives it nothing
    assert status.as_dict()["problems"] == {"m-good": good}
    ignored = [r.getMessage() for r in caplog.records if "Ignored etcd key" in r.getMessage()]
    assert len(ignored) == 5, ignored


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[NatsServer, NatsServerSecurity]]:
    security = NatsServerSecurity.generate(tmp_path / "pki", [NatsUser("member", PASSWORD)])
    server = NatsServer(tmp_path / "nats", security=security)
    try:
        server.start()
        yield server, security
    finally:
        server.stop()


def refused_fleet(
    secured: tuple[NatsServer, NatsServerSecurity], etcd_endpoint: str, tmp_path: Path, group: str
) -> Fleet:
    """Members of `group` on the secured server, with a password it refuses ("wrong")."""
    server, security = secured
    return Fleet(
        tmp_path / "members",
        nats_url=server.url,
        etcd_endpoint=etcd_endpoint,
        namespace="test",
        group=group,
        partitions=8,
        env={**security.client_env("member"), "NATS_PASSWORD": "wrong"},
    )


def status(etcd_endpoint: str, group: str, *extra: str) -> str:
    env = {**os.environ, "ETCD_ENDPOINTS": etcd_endpoint}
    command = [sys.executable, "-m", "shoal.consumer", "status", "-g", group, "-n", "test"]
    shown = subprocess.run(
        [*command, "-p", "8", *extra], env=env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def test_a_refused_member_shows_in_status_until_nats_accepts_it(
    secured: tuple[NatsServer, NatsServerSecurity],
    etcd_endpoint: str,
    tmp_path: Path,
    group: str,
) -> None:
    server, security = secured
    with refused_fleet(secured, etcd_endpoint, tmp_path, group) as fleet:
        member = fleet.start("m-0")
        text = eventually(
            lambda: status(etcd_endpoint, group),
            30,
            "status to list the refused member",
            until=lambda out: "NatsAuthFailed" in out,
            interval=0.5,
        )
        line = next(x for x in text.splitlines() if "NatsAuthFailed" in x)
        assert line.strip().startswith("m-0 "), text
        assert "cannot connect to NATS since " in line and "Authorization Violation" in line
        assert f"group test/{group}: 0 members" in text, text  # it never joined
        shown = json.loads(status(etcd_endpoint, group, "--json"))
        assert shown["members"] == {}
        assert shown["problems"]["m-0"]["reason"] == "NatsAuthFailed"

        # The server now takes the member's password: it connects, joins, and the
        # refusal goes from etcd.
        server.reload(dataclasses.replace(security, users=(NatsUser("member", "wrong"),)))
        eventually(
            lambda: json.loads(status(etcd_endpoint, group, "--json")),
            40,
            "the member to join and its refusal to go",
            until=lambda st: "m-0" in st["members"] and not st["problems"],
            interval=0.5,
        )
        fleet.term("m-0")
        assert fleet.wait_exit("m-0", 30) == 0
        log_text = member.log_text()
    assert "Reported the NATS refusal in etcd" in log_text, log_text
    assert "its refusal is gone from etcd" in log_text, log_text
    assert "Traceback" not in log_text, log_text


def test_a_refused_member_that_stops_takes_its_refusal_with_it(
    secured: tuple[NatsServer, NatsServerSecurity],
    etcd_endpoint: str,
    tmp_path: Path,
    group: str,
) -> None:
    with refused_fleet(secured, etcd_endpoint, tmp_path, group) as fleet:
        fleet.start("m-0")
        eventually(
            lambda: json.loads(status(etcd_endpoint, group, "--json"))["problems"],
            30,
            "the refusal in etcd",
            until=lambda problems: "m-0" in problems,
            interval=0.5,
        )
        fleet.term("m-0")
        assert fleet.wait_exit("m-0", 20) == 0
        # At once, not after the lease's TTL: the member revoked it on its way out.
        assert json.loads(status(etcd_endpoint, group, "--json"))["problems"] == {}
