"""The admin role (`permissions.admin_permissions`) on a nats-server that enforces it.

The server requires TLS with client certificates and a password, as in
tests/test_nats_permissions.py. As the admin of group A, every `dlq` command (list,
show, purge of a selection, redrive, purge of all) and `reset` work, through the real
CLI, with no permissions violation; the same user is refused group B's.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.natssecurity import NatsServerSecurity, NatsUser
from harness.securegroup import operator_made_config
from harness.servers import NatsServer
from shoal.clients.etcd import Etcd
from shoal.clients.nats import connect
from shoal.consumer.deadletter import dead_letter_headers
from shoal.consumer.permissions import (
    Permissions,
    admin_permissions,
    default_admin_inbox_prefix,
    operator_permissions,
)
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import (
    MSG_ID_HEADER,
    PROJECT_HEADER,
    SEQ_HEADER,
    dlq_subject,
    partition_for,
    partition_subject,
)
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

P = 8


def union(*perms: Permissions) -> Permissions:
    return Permissions(
        tuple(dict.fromkeys(s for p in perms for s in p.publish)),
        tuple(dict.fromkeys(s for p in perms for s in p.subscribe)),
    )


@dataclass
class Setup:
    server: NatsServer
    security: NatsServerSecurity
    a: GroupConfig
    b: GroupConfig


@pytest.fixture
def setup(tmp_path: Path, etcd_endpoint: str, group: str) -> Iterator[Setup]:
    a, b = (
        operator_made_config(f"{group}{x}", etcd_endpoint, P).model_copy(
            update={"retention": "limits"}
        )
        for x in "ab"
    )
    ops = union(operator_permissions(a), operator_permissions(b))
    users = [
        NatsUser("admin", "admin-pw"),  # the test's own writes: no permissions set
        NatsUser("operator", "operator-pw", ops.publish, ops.subscribe),
        NatsUser("shoal-admin", "sa-pw", *_lists(admin_permissions(a))),
    ]
    security = NatsServerSecurity.generate(tmp_path / "pki", users)
    server = NatsServer(tmp_path / "nats", security=security)
    try:
        server.start()
        url = server.url
        yield Setup(
            server,
            security,
            a.model_copy(update={"nats_url": url}),
            b.model_copy(update={"nats_url": url}),
        )
    finally:
        server.stop()


def _lists(perms: Permissions) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return perms.publish, perms.subscribe


async def as_admin(setup: Setup, config: GroupConfig, *args: str) -> tuple[int, str]:
    """`shoal-consumer <args>` for `config`'s group, as the admin user (group A's)."""
    env = {
        **os.environ,
        **setup.security.client_env("shoal-admin", default_admin_inbox_prefix(setup.a)),
    }
    where = ["-g", config.group, "-n", config.namespace, "--nats", config.nats_url]
    if args[0] == "reset":
        where += ["--etcd", config.etcd_endpoints]
    command, rest = (args[:2], args[2:]) if args[0] == "dlq" else (args[:1], args[1:])
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shoal.consumer",
        *command,
        *where,
        *rest,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(60):
            out, _ = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode()


async def dead_letters(js: Any, config: GroupConfig, projects: list[str]) -> None:
    """Two dead letters of each project, as a member writes them."""
    for project in projects:
        for seq in range(2):
            p = partition_for(project, config.partitions)
            original = {PROJECT_HEADER: project, MSG_ID_HEADER: f"{project}-{seq}"}
            headers = dead_letter_headers(
                {**original, SEQ_HEADER: str(seq)},
                partition_subject(config.subject_prefix, p),
                "permanent error: x",
                "m-0",
            )
            await js.publish(dlq_subject(config.subject_prefix, p), b"d", headers=headers)


async def test_the_admin_runs_dlq_and_reset_on_its_group_only(setup: Setup, etcd: Etcd) -> None:
    a, b = setup.a, setup.b
    url = setup.server.url
    op = await connect(url, name="operator", attempts=3, security=setup.security.client("operator"))
    try:
        await ensure_group(op.jetstream(), a)
        await ensure_group(op.jetstream(), b)
    finally:
        await op.close()
    admin = await connect(url, name="admin", attempts=3, security=setup.security.client("admin"))
    try:
        js = admin.jetstream()
        for config in (a, b):
            items = [Outgoing(f"project-{i % 5}", b"x", f"m-{i}") for i in range(40)]
            await Producer(js, config.subject_prefix, P).publish_many(items)
            await dead_letters(js, config, ["p0", "p1", "p2"])
    finally:
        await admin.close()

    for args, said in [
        (("dlq", "list"), "6 dead letters"),
        (("dlq", "show", "--project", "p2"), "project 'p2'"),
        (("dlq", "purge", "--project", "p0", "--yes"), "purged 2 dead letters"),
        (("dlq", "redrive", "--project", "p1"), "moved 2 of 2 dead letters"),
        (("dlq", "purge", "--yes"), "purged 2 dead letters"),
        (("reset", "--to-start", "--yes"), f"{P} durables at the start of the stream"),
    ]:
        code, out = await as_admin(setup, a, *args)
        assert code == 0 and said in out, (args, out[-3000:])
    assert setup.server.violations("shoal-admin") == [], setup.server.violations("shoal-admin")

    # Group B's position and dead letters are not the admin of A's.
    for args in (("reset", "--to-start", "--yes"), ("dlq", "list")):
        code, out = await as_admin(setup, b, *args)
        assert code != 0, (args, out[-3000:])
        last = out.strip().splitlines()[-1]
        assert last.startswith("Error: NATS at ") and "Permissions Violation" in last, out
        assert "Traceback" not in out, out
    assert setup.server.violations("shoal-admin")


async def test_the_admin_may_ask_whether_more_dead_letters_wait(setup: Setup) -> None:
    """A reader of the dead letters whose fetch comes back empty asks its consumer's info
    (is more pending?), as when another admin purges or redrives them meanwhile. The
    printed admin permissions lacked CONSUMER.INFO on the dead-letter stream: refused, the
    request timed out, and `dlq list` failed "NATS stopped answering ... incomplete"."""
    from shoal.group import deadletters

    config = setup.a
    root = await connect(
        config.nats_url, name="t", attempts=3, security=setup.security.client("admin")
    )
    admin = None
    try:
        rjs = root.jetstream()
        await ensure_group(rjs, config)
        await dead_letters(rjs, config, ["p-1", "p-2"])
        admin = await connect(
            config.nats_url,
            name="admin",
            attempts=3,
            security=setup.security.client("shoal-admin", default_admin_inbox_prefix(config)),
        )
        js = admin.jetstream()
        bind = js.pull_subscribe_bind

        async def purged_meanwhile(*args: Any, **kwargs: Any) -> Any:
            await rjs.purge_stream(config.dlq_stream)
            return await bind(*args, **kwargs)

        js.pull_subscribe_bind = purged_meanwhile
        read = [letters async for letters in deadletters.read(js, config, fetch_timeout=0.5)]
        assert read == [] and setup.server.violations("shoal-admin") == []
    finally:
        if admin is not None:
            await admin.close()
        await root.close()
