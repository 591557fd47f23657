"""A group whose streams live in one NATS account and whose members in another.

The server runs (with TLS and client certificates, as tests/test_nats_permissions.py)
exactly the block `shoal-consumer permissions --accounts` prints for the group, the
passwords filled in, plus an unrestricted user in each account for the test's own
reads: SHOAL has JetStream, the operator's user (which creates the streams and
durables) and the producer's; TEAM has the members' user and only SHOAL's exports.
Two members, NATS_JS_API_PREFIX=JS.SHOAL.API, consume a few thousand messages while one
leaves; the ledger (published by the members into SHOAL's ledger stream, through the
import) shows none lost and none twice, and the server logged no violation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from nats.js.errors import ServiceUnavailableError

from harness.audit import message_ids
from harness.fleet import Fleet, settled, wait_for_status
from harness.natssecurity import NatsServerSecurity, NatsUser
from harness.securegroup import drain_and_audit, operator_made_config, produce_paced
from harness.servers import NatsServer
from shoal.clients.etcd import Etcd
from shoal.clients.nats import connect
from shoal.clients.natsauth import NatsSecurity
from shoal.consumer.cli import main
from shoal.consumer.permissions import default_inbox_prefix, default_producer_inbox_prefix
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER, durable_name
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

P = 16
API_PREFIX = "JS.SHOAL.API"
FAST_ENV = {"SHOAL_LEASE_TTL": "5", "SHOAL_KEEPALIVE_INTERVAL": "1", "SHOAL_ACK_WAIT": "2"}
USERS = [
    NatsUser("admin", "admin-pw"),  # SHOAL, no permissions: the test's reads
    NatsUser("team-admin", "team-admin-pw"),  # TEAM, no permissions: the imports alone
    NatsUser("operator", "operator-pw"),
    NatsUser("member", "member-pw"),
    NatsUser("producer", "producer-pw"),
    NatsUser("exporter", "exporter-pw"),
]


def accounts_config(config: GroupConfig) -> str:
    """The printed block, passwords filled in, and one unrestricted user per account."""
    result = CliRunner().invoke(
        main,
        [
            "permissions",
            "-g",
            config.group,
            "-n",
            config.namespace,
            "--ledger",
            "--accounts",
            "--member-user",
            "member",
            "--operator-user",
            "operator",
            "--producer-user",
            "producer",
            "--analytics-user",
            "exporter",
            "--admin-user",
            "shoal-admin",
        ],
    )
    assert result.exit_code == 0, result.output
    text = result.output
    for role, user in [
        ("MEMBER", "member"),
        ("OPERATOR", "operator"),
        ("PRODUCER", "producer"),
        ("ANALYTICS", "exporter"),
        ("ADMIN", "shoal-admin"),
    ]:
        text = text.replace(f"$SHOAL_{role}_PASSWORD", f'"{user}-pw"')
    shoal, team = text.split("  TEAM {")
    users = "    users = [\n"
    shoal = shoal.replace(users, users + '      {user: "admin", password: "admin-pw"}\n', 1)
    team = team.replace(users, users + '      {user: "team-admin", password: "team-admin-pw"}\n', 1)
    return shoal + "  TEAM {" + team


@dataclass
class Setup:
    server: NatsServer
    security: NatsServerSecurity
    config: GroupConfig

    def client(self, user: str, inbox_prefix: str | None = None) -> NatsSecurity:
        return self.security.client(user, inbox_prefix)


@pytest.fixture
def setup(tmp_path: Path, etcd_endpoint: str, group: str) -> Iterator[Setup]:
    config = operator_made_config(group, etcd_endpoint, P)
    security = NatsServerSecurity.generate(tmp_path / "pki", USERS)
    security = replace(security, accounts=accounts_config(config))
    server = NatsServer(tmp_path / "nats", security=security)
    try:
        server.start()
        yield Setup(server, security, config.model_copy(update={"nats_url": server.url}))
    finally:
        server.stop()


async def test_members_of_another_account_consume_and_hand_over(
    setup: Setup, etcd: Etcd, tmp_path: Path
) -> None:
    c, url = setup.config, setup.server.url
    op = await connect(url, name="operator", attempts=3, security=setup.client("operator"))
    try:
        await ensure_group(op.jetstream(), c)  # the streams and durables, in SHOAL
    finally:
        await op.close()

    # The account boundary alone, without user permissions: TEAM reaches what SHOAL
    # exports, under the prefix, and nothing else of SHOAL's JetStream.
    team = await connect(url, name="team-admin", attempts=3, security=setup.client("team-admin"))
    try:
        team_js = team.jetstream(prefix=API_PREFIX, timeout=2)
        info = await team_js.consumer_info(c.stream, durable_name(0))
        assert info.config.durable_name == durable_name(0)
        info_of_stream = await team_js.stream_info(c.stream)  # exported: the member checks it
        assert info_of_stream.config.name == c.stream
        with pytest.raises(ServiceUnavailableError):
            await team_js.account_info()  # $JS.API.INFO is not exported
        with pytest.raises(ServiceUnavailableError):
            await team.jetstream(timeout=2).stream_info(c.stream)  # TEAM has no JetStream
    finally:
        await team.close()

    producer_inbox = default_producer_inbox_prefix(c)
    producer_nc = await connect(
        url, name="producer", attempts=3, security=setup.client("producer", producer_inbox)
    )
    admin = await connect(url, name="admin", attempts=3, security=setup.client("admin"))
    items = [
        Outgoing(f"project-{i % 200}", b"x", f"acct-{i}", {SEQ_HEADER: str(i // 200)})
        for i in range(3000)
    ]
    env = {
        **FAST_ENV,
        "SHOAL_ENSURE_JETSTREAM": "false",
        "NATS_JS_API_PREFIX": API_PREFIX,
        **setup.security.client_env("member", default_inbox_prefix(c)),
    }
    with Fleet.for_config(tmp_path / "members", c, env) as fleet:
        try:
            for m in ("c-0", "c-1"):
                fleet.start(m)
            await wait_for_status(etcd, c.namespace, c.group, P, settled({"c-0", "c-1"}), 30)
            producer = Producer(producer_nc.jetstream(), c.subject_prefix, P)
            production = asyncio.create_task(produce_paced(producer, items))
            await asyncio.sleep(3)
            fleet.term("c-0")  # a graceful leave mid-stream: c-1 takes everything
            await wait_for_status(etcd, c.namespace, c.group, P, settled({"c-1"}), 30)
            assert fleet.wait_exit("c-0", 30) == 0
            await production

            ids = message_ids(items)
            js = admin.jetstream()
            records = await drain_and_audit(js, c, ids, "the group to drain", fleet.logs)
            logs = fleet.logs()
            assert {r.member for r in records} == {"c-0", "c-1"}
        finally:
            await producer_nc.close()
            await admin.close()
    assert "permissions violation" not in logs.lower(), logs
    for user in ("operator", "member", "producer"):
        assert setup.server.violations(user) == [], setup.server.violations(user)
