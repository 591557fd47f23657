"""A group on a nats-server that enforces exactly the permissions `permissions.py` gives.

The server requires TLS with client certificates (``verify: true``) and a password, and
has one user per role: the operator (creates the streams and durables), each group's
members, a producer, and an unrestricted admin the test itself reads with. Group A's
members consume a few thousand messages while one joins and one leaves, with nothing
lost and no permission violation anywhere; a member configured for group B is refused
everything that would read group A's messages.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest

from harness.audit import message_ids
from harness.fleet import Fleet, settled, wait_for_status
from harness.natssecurity import NatsServerSecurity, NatsUser
from harness.securegroup import drain_and_audit, operator_made_config, produce_paced
from harness.servers import NatsServer
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.clients.nats import connect
from shoal.clients.natsauth import NatsSecurity
from shoal.consumer.permissions import (
    Permissions,
    default_exporter_inbox_prefix,
    default_inbox_prefix,
    exporter_permissions,
    member_permissions,
    operator_permissions,
    producer_permissions,
)
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import (
    SEQ_HEADER,
    assignments_subject,
    durable_name,
    partition_subject,
)
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

P = 32
PRODUCER_INBOX = "_SHOAL_PRODUCER.test.a"
TTL = 5
FAST_ENV = {"SHOAL_LEASE_TTL": str(TTL), "SHOAL_KEEPALIVE_INTERVAL": "1", "SHOAL_ACK_WAIT": "2"}


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

    def client(self, user: str, inbox_prefix: str | None = None) -> NatsSecurity:
        return self.security.client(user, inbox_prefix)

    def member_env(self, config: GroupConfig, user: str) -> dict[str, str]:
        return {
            **FAST_ENV,
            "SHOAL_ENSURE_JETSTREAM": "false",
            **self.security.client_env(user, default_inbox_prefix(config)),
        }


@pytest.fixture
def setup(tmp_path: Path, etcd_endpoint: str, group: str) -> Iterator[Setup]:
    # As under the operator: it makes the streams and durables, the members do not.
    a = operator_made_config(f"{group}a", etcd_endpoint, P)
    b = operator_made_config(f"{group}b", etcd_endpoint, P)
    users = [
        NatsUser("admin", "admin-pw"),  # the test's own reads: no permissions set
        NatsUser(
            "operator",
            "operator-pw",
            *_lists(union(operator_permissions(a), operator_permissions(b))),
        ),
        NatsUser("member-a", "a-pw", *_lists(member_permissions(a, default_inbox_prefix(a)))),
        NatsUser("member-b", "b-pw", *_lists(member_permissions(b, default_inbox_prefix(b)))),
        NatsUser("producer", "producer-pw", *_lists(producer_permissions(a, PRODUCER_INBOX))),
        NatsUser("exporter", "exporter-pw", *_lists(exporter_permissions(a))),
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


async def test_a_group_runs_with_exactly_its_permissions(
    setup: Setup, etcd: Etcd, tmp_path: Path
) -> None:
    a, b = setup.a, setup.b
    url = setup.server.url
    # The operator's user creates both groups' streams and durables.
    op = await connect(url, name="operator", attempts=3, security=setup.client("operator"))
    try:
        await ensure_group(op.jetstream(), a)
        await ensure_group(op.jetstream(), b)
        await op.jetstream().stream_info(a.stream)  # the status's lag
    finally:
        await op.close()

    producer_nc = await connect(
        url, name="producer", attempts=3, security=setup.client("producer", PRODUCER_INBOX)
    )
    admin = await connect(url, name="admin", attempts=3, security=setup.client("admin"))
    items = [
        Outgoing(f"project-{i % 300}", b"x", f"perm-{i}", {SEQ_HEADER: str(i // 300)})
        for i in range(3000)
    ]
    with Fleet.for_config(tmp_path / "members", a, setup.member_env(a, "member-a")) as fleet:
        try:
            for m in ("c-0", "c-1"):
                fleet.start(m)
            await wait_for_status(etcd, a.namespace, a.group, P, settled({"c-0", "c-1"}), 30)

            producer = Producer(producer_nc.jetstream(), a.subject_prefix, P)
            production = asyncio.create_task(produce_paced(producer, items))
            await asyncio.sleep(2)
            fleet.start("c-2")  # a join mid-stream
            members = {"c-0", "c-1", "c-2"}
            await wait_for_status(etcd, a.namespace, a.group, P, settled(members), 30)
            await asyncio.sleep(1)
            fleet.term("c-0")  # a graceful leave mid-stream
            await wait_for_status(etcd, a.namespace, a.group, P, settled({"c-1", "c-2"}), 30)
            assert fleet.wait_exit("c-0", 30) == 0
            await production

            ids = message_ids(items)
            js = admin.jetstream()
            records = await drain_and_audit(js, a, ids, "group A to drain", fleet.logs)
            assert {r.member for r in records} == {"c-0", "c-1", "c-2"}
            # Exactly enough: nobody was refused anything along the way.
            logs = fleet.logs()
        finally:
            await producer_nc.close()
            await admin.close()
    assert "permissions violation" not in logs.lower(), logs
    for user in ("operator", "member-a", "producer"):
        assert setup.server.violations(user) == [], setup.server.violations(user)


async def test_a_member_of_group_b_cannot_read_group_a(setup: Setup) -> None:
    a, b = setup.a, setup.b
    url = setup.server.url
    op = await connect(url, name="operator", attempts=3, security=setup.client("operator"))
    try:
        await ensure_group(op.jetstream(), a)
    finally:
        await op.close()
    producer_nc = await connect(
        url, name="producer", attempts=3, security=setup.client("producer", PRODUCER_INBOX)
    )
    try:
        await Producer(producer_nc.jetstream(), a.subject_prefix, P).publish_many(
            [Outgoing(f"project-{i}", b"secret", f"s-{i}", {}) for i in range(20)]
        )
    finally:
        await producer_nc.close()

    errors: list[str] = []
    received: list[Any] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    async def on_msg(msg: Any) -> None:
        received.append(msg)

    # Group B's member, with its own settings (its user, its inbox prefix).
    security = setup.client("member-b", default_inbox_prefix(b))
    nc = await nats.connect(url, error_cb=on_error, **security.connect_options())
    try:
        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=on_msg)  # its own inbox: allowed
        # Pull from group A's durable of partition 0, replies to its own inbox.
        a_pull = f"$JS.API.CONSUMER.MSG.NEXT.{a.stream}.{durable_name(0)}"
        await nc.publish(a_pull, b'{"batch": 10, "expires": 1000000000}', reply=inbox)
        # Listen on A's partitions and on A's members' replies (their pulled messages).
        await nc.subscribe(partition_subject(a.subject_prefix, 0), cb=on_msg)
        await nc.subscribe(f"{default_inbox_prefix(a)}.>", cb=on_msg)
        await nc.subscribe("_INBOX.>", cb=on_msg)
        # Ask JetStream about A's stream, or take A's messages one by one.
        js_b = nc.jetstream(timeout=1)
        with pytest.raises(nats.errors.TimeoutError):  # refused: nobody answers
            await js_b.stream_info(a.stream)
        with pytest.raises(nats.errors.TimeoutError):
            await js_b.get_msg(a.stream, 1)
        await nc.flush()

        # (nats-py lowercases the server's -ERR text.)
        expected = [
            rf'publish to "\$JS\.API\.CONSUMER\.MSG\.NEXT\.{a.stream}\.',
            rf'subscription to "{re.escape(a.subject_prefix)}\.0"',
            rf'subscription to "{re.escape(default_inbox_prefix(a))}\.>"',
            r'subscription to "_INBOX\.>"',
            rf'publish to "\$JS\.API\.STREAM\.INFO\.{a.stream}"',
            rf'publish to "\$JS\.API\.STREAM\.MSG\.GET\.{a.stream}"',
        ]

        def missing() -> list[str]:
            return [
                w
                for w in expected
                if not any(re.search("permissions violation for " + w, e, re.I) for e in errors)
            ]

        await eventually_async(
            lambda: asyncio.sleep(0, missing()), 5, "every refusal reported", until=lambda m: not m
        )
        assert received == []
    finally:
        await nc.close()
    # Nothing of A's was taken: all 20 messages still wait in its stream.
    admin = await connect(url, name="admin", attempts=3, security=setup.client("admin"))
    try:
        info = await admin.jetstream().stream_info(a.stream)
        assert info.state.messages == 20
    finally:
        await admin.close()
    assert setup.server.violations("member-b"), "the server logged no violation"


async def test_the_export_runs_with_exactly_its_permissions(setup: Setup, tmp_path: Path) -> None:
    from shoal.analytics.export import export_log

    a, url = setup.a, setup.server.url
    op = await connect(url, name="operator", attempts=3, security=setup.client("operator"))
    admin = await connect(url, name="admin", attempts=3, security=setup.client("admin"))
    try:
        await ensure_group(op.jetstream(), a)
        for generation in range(5):  # what the leader logs (the export copies it verbatim)
            await admin.jetstream().publish(
                assignments_subject(a.subject_prefix), f'{{"generation": {generation}}}'.encode()
            )
    finally:
        await op.close()
        await admin.close()
    result = await export_log(
        nats_url=url,
        namespace=a.namespace,
        group=a.group,
        out=tmp_path / "out",
        security=setup.client("exporter", default_exporter_inbox_prefix(a)),
        connect_attempts=2,
    )
    assert result.messages == 5
    assert setup.server.violations("exporter") == []
