"""The operator's shared clients are closed once no group uses them: deleted groups, and
groups whose spec moved to another server, leave no NATS connection or etcd client
behind (before: kept until the operator stopped). On a real nats-server and etcd."""

from __future__ import annotations

from pathlib import Path

from harness.fakesecrets import FakeSecrets
from harness.servers import NatsServer
from shoal.clients.nats import connect
from shoal.clients.natsauth import NatsSecurity
from shoal.contracts.spec import NatsSpec
from shoal.operator.etcdsecret import EtcdClients
from shoal.operator.natssecret import NatsClients
from shoal.operator.sharing import Sharers


def test_sharers_tell_which_keys_nobody_uses() -> None:
    sharers: Sharers[str] = Sharers()
    assert sharers.use("a", 1) == []
    assert sharers.use("a", 2) == []
    assert sharers.use("b", 1) == []  # 1 moved to b; 2 still uses a
    assert sharers.use("b", 2) == ["a"]  # and now nobody uses a
    assert sharers.release(1) == []
    assert sharers.release(2) == ["b"]
    assert not sharers.used("a") and not sharers.used("b")
    assert sharers.release(3) == []


async def test_a_nats_connection_is_closed_when_its_last_group_leaves(
    tmp_path: Path, nats_url: str
) -> None:
    other = NatsServer(tmp_path / "other")
    other.start()
    clients = NatsClients(FakeSecrets(), NatsSecurity(), tmp_path / "files")
    try:
        spec = NatsSpec()
        a = await clients.get(nats_url, "ns", spec, connect=connect, attempts=2, user=1)
        b = await clients.get(nats_url, "ns", spec, connect=connect, attempts=2, user=2)
        assert a is b and len(clients) == 1
        await clients.release(1)
        assert not a.is_closed  # group 2 still uses it
        # Group 2's spec moves to another server: its old connection has nobody left.
        moved = await clients.get(other.url, "ns", spec, connect=connect, attempts=2, user=2)
        assert moved is not a and a.is_closed and len(clients) == 1
        await clients.release(2)
        assert moved.is_closed and len(clients) == 0
        # A group that comes back (a delete retried) connects again.
        again = await clients.get(nats_url, "ns", spec, connect=connect, attempts=2, user=1)
        assert again.is_connected
    finally:
        await clients.close()
        other.stop()


async def test_an_etcd_client_is_closed_when_its_last_group_leaves(
    tmp_path: Path, etcd_endpoint: str
) -> None:
    clients = EtcdClients(FakeSecrets(), tmp_path / "files")
    try:
        a = await clients.get(etcd_endpoint, user=1)
        b = await clients.get(etcd_endpoint, user=2)
        assert a is b
        await clients.release(1)
        await a.get_prefix("/shoal/sharing/")  # still open for group 2
        await clients.release(2)
        c = await clients.get(etcd_endpoint, user=3)
        assert c is not a  # a new client: the old one was closed with its last group
        await c.get_prefix("/shoal/sharing/")
    finally:
        clients.close()
