"""Issue 31's "done when": a ConsumerGroup on the local plane against a NATS server that
requires TLS with client certificates and a password, the members and the operator each
with only the subjects they need, scaled 3 -> 5 -> 2 while messages flow, 0 lost.

The nats-server (harness.natssecurity) has three users: `member` and `shoal-operator`
with exactly the allow lists shoal.consumer.permissions gives for this one group (what
`shoal-consumer permissions` prints; the members reply under the group's own inbox
prefix, NATS_INBOX_PREFIX, which the operator sets in their pods), and `admin` for the
test's producer and audit. The operator runs as a local process with its own NATS
settings (NATS_URL, NATS_CA_FILE, NATS_CERT_FILE, NATS_KEY_FILE, NATS_USER,
NATS_PASSWORD: what the chart's nats.tlsSecret and nats.credentialsSecret give the
operator pod). The group names spec.nats.tlsSecret, which both its pods and the operator
use, and no credentialsSecret: the operator would then use that Secret itself, and the
members' allow list does not let anyone create streams. The members' user and password
reach them as env from a Secret of their own (spec.env).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import astuple
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml

from harness.fleet import wait_for_status
from harness.kubetest import apply_secret, condition, get_json, operator_watching, wait_until
from harness.localkube.plane import LocalKube
from harness.securenats import NatsUser, SecureNats, secure_nats_server
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import audit, read_ledger
from shoal.consumer.permissions import member_permissions, operator_permissions
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER, ledger_stream_name
from shoal.operator.builders import pod_config
from shoal.operator.settings import OperatorSettings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent
NS, NAME, PARTITIONS = "nats-least", "orders", 32
STREAM = f"shoal_{NS}_{NAME}"
PREFIX = f"shoal.{NS}.{NAME}"
API = "$JS.API"
MEMBER, OPERATOR, ADMIN = "member", "shoal-operator", "admin"
PASSWORDS = {name: secrets.token_hex(8) for name in (MEMBER, OPERATOR, ADMIN)}


def group_spec() -> dict[str, Any]:
    return {
        **yaml.safe_load((ROOT / "examples" / "consumergroup.yaml").read_text())["spec"],
        "partitions": PARTITIONS,
    }


# The group's configuration as the operator derives it for the pods (their inbox prefix
# among it): the allow lists are shoal.consumer.permissions' for it, exactly, as
# `shoal-consumer permissions` prints them.
CONFIG = pod_config(NAME, NS, group_spec(), OperatorSettings())
MEMBER_PERMISSIONS = member_permissions(CONFIG)
OPERATOR_PERMISSIONS = operator_permissions(CONFIG)


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureNats]:
    users = [
        NatsUser(MEMBER, PASSWORDS[MEMBER], *astuple(MEMBER_PERMISSIONS)),
        NatsUser(OPERATOR, PASSWORDS[OPERATOR], *astuple(OPERATOR_PERMISSIONS)),
        NatsUser(ADMIN, PASSWORDS[ADMIN]),  # the test's producer and audit
    ]
    server = secure_nats_server(tmp_path_factory.mktemp("nats-least"), users)
    with server.server:
        yield server


@pytest.fixture(scope="module")
def operator(
    localkube: LocalKube, secure: SecureNats, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    own = {"NATS_URL": secure.url, **secure.security.client_env(OPERATOR)}
    log_path = tmp_path_factory.mktemp("nats-least-operator") / "operator.log"
    with operator_watching(localkube, [NS], log_path, extra_env=own):
        yield log_path


def manifest(secure: SecureNats) -> str:
    group = yaml.safe_load((ROOT / "examples" / "consumergroup.yaml").read_text())
    group["metadata"] = {"name": NAME, "namespace": NS}
    spec = group["spec"]
    spec.update(replicas=3, partitions=PARTITIONS)
    spec["nats"] = {**spec.get("nats", {}), "url": secure.url, "tlsSecret": "nats-tls"}
    spec["env"] = [
        {"name": var, "valueFrom": {"secretKeyRef": {"name": "nats-member", "key": key}}}
        for var, key in (("NATS_USER", "user"), ("NATS_PASSWORD", "password"))
    ]
    return json.dumps(group)


async def scale_while_producing(plane: LocalKube, secure: SecureNats) -> dict[str, int]:
    etcd = Etcd(plane.state.etcd_endpoint)
    await etcd.connect(attempts=5)
    nc = await nats.connect(secure.url, **secure.client(ADMIN).connect_options())
    try:
        js = nc.jetstream()

        def members(n: int) -> Any:
            return lambda s: len(s.members) == n and not s.unowned and s.claims == s.owners

        await wait_for_status(etcd, NS, NAME, PARTITIONS, members(3), 60)
        items = [
            Outgoing(f"project-{i % 500}", b"x", f"lp-{i}", {SEQ_HEADER: str(i // 500)})
            for i in range(4000)
        ]
        producer = Producer(js, PREFIX, PARTITIONS)
        production = asyncio.create_task(producer.publish_many(items, window=128))
        for replicas in (5, 2):
            await asyncio.to_thread(
                plane.kubectl, "scale", "cg", NAME, "-n", NS, f"--replicas={replicas}"
            )
            await wait_for_status(etcd, NS, NAME, PARTITIONS, members(replicas), 150)
            print(f"scaled to {replicas}")
        await production

        async def left() -> int:
            return int((await js.stream_info(STREAM)).state.messages)

        await eventually_async(
            left, 120, "the group to drain its stream", until=lambda n: n == 0, interval=0.5
        )
        records = await read_ledger(js, ledger_stream_name(STREAM))
        summary: dict[str, int] = audit(records, [i.message_id or "" for i in items]).summary()
        return summary
    finally:
        await nc.close()
        etcd.close()


async def member_asks_for_stream_info(secure: SecureNats) -> str | None:
    """What refusing the member's STREAM.INFO of the dead-letter stream looks like to it
    (None: it was answered). (Its own stream's it may read: whether it was recreated.)"""
    nc = await nats.connect(secure.url, **secure.client(MEMBER).connect_options())
    try:
        await nc.request(f"{API}.STREAM.INFO.{STREAM}_dlq", b"", timeout=2)
    except nats.errors.TimeoutError as exc:  # the server drops it (and logs it)
        return repr(exc)
    finally:
        await nc.close()
    return None


def test_least_privilege_tls_and_passwords_scaled_3_5_2_with_nothing_lost(
    localkube: LocalKube, secure: SecureNats, operator: Path
) -> None:
    plane = localkube
    files = secure.tls_files()
    apply_secret(plane, NS, "nats-tls", files)
    apply_secret(plane, NS, "nats-member", user=MEMBER, password=PASSWORDS[MEMBER])
    started = time.monotonic()
    plane.kubectl("apply", "-f", "-", input_text=manifest(secure))
    wait_until(
        lambda: condition(get_json(plane, "cg", NAME, "-n", NS), "Ready").get("status") == "True",
        120,
        "the group to become Ready",
    )
    print(f"Ready in {time.monotonic() - started:.1f} s")

    summary = asyncio.run(scale_while_producing(plane, secure))
    print(f"audit: {summary}")
    assert summary["lost"] == 0
    assert summary["duplicates"] == 0

    # Nobody stepped outside their allow list: the server logs every refused subject...
    assert secure.server.violations() == []
    # ...as it does now for a member asking for the dead-letter stream's info.
    refused = asyncio.run(member_asks_for_stream_info(secure))
    assert refused is not None, "the member read the stream's info"
    logged = wait_until(lambda: secure.server.violations(), 10, "the server to log the violation")
    assert any(f"user:{MEMBER}" in line and f"STREAM.INFO.{STREAM}_dlq" in line for line in logged)
    plane.kubectl("delete", "cg", NAME, "-n", NS, "--timeout=120s")
