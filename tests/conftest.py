"""Shared fixtures: one real etcd and one real nats-server per pytest session.

The servers start lazily, on the first test that asks for them (unit tests never do), in
a pytest tmp directory, bound to 127.0.0.1 on free ports; they are stopped when the
session ends, whatever happened. Binaries: see harness.servers (`make test` sets
SHOAL_ETCD and SHOAL_NATS_SERVER).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from harness.fakesecrets import FakeSecrets
from harness.fleet import Fleet
from harness.servers import EtcdServer, NatsServer
from shoal.clients.etcd import Etcd
from shoal.group.config import GroupConfig


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_endpoint(etcd_server: EtcdServer) -> str:
    """host:port of the session's etcd (restarted first if an earlier test stopped it)."""
    etcd_server.start()
    return etcd_server.endpoint


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    """nats:// URL of the session's nats-server (restarted first if a test stopped it)."""
    nats_server.start()
    return nats_server.url


@pytest.fixture
def group() -> str:
    """A group name no other test uses, so tests can share the servers."""
    return f"g{uuid.uuid4().hex[:8]}"


@pytest.fixture
def namespace() -> str:
    return "test"


@pytest.fixture
async def etcd(etcd_endpoint: str) -> AsyncIterator[Etcd]:
    """An async etcd client on the session's etcd."""
    client = Etcd(etcd_endpoint)
    await client.connect(attempts=10)
    yield client
    client.close()


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[Any]:
    """A JetStream context on the session's nats-server."""
    nc = await nats.connect(nats_url)
    yield nc.jetstream()
    await nc.close()


@pytest.fixture
def secrets() -> FakeSecrets:
    """Secrets for the operator's Secret readers, from a dict (harness.fakesecrets)."""
    return FakeSecrets()


@pytest.fixture
def make_config(
    group: str, namespace: str, nats_url: str, etcd_endpoint: str
) -> Callable[..., GroupConfig]:
    """A config of this test's group on the session's servers, plus overrides."""

    def make(**overrides: Any) -> GroupConfig:
        # The tests' members run the ledger handler (harness.fleet), which needs its stream.
        overrides.setdefault("ledger", True)
        return GroupConfig(
            group=group,
            namespace=namespace,
            nats_url=nats_url,
            etcd_endpoints=etcd_endpoint,
            **overrides,
        )

    return make


@pytest.fixture
def make_fleet(
    tmp_path: Path, nats_url: str, etcd_endpoint: str, namespace: str, group: str
) -> Iterator[Callable[..., Fleet]]:
    """Member processes of this test's group on the session's servers (harness.fleet),
    with Fleet's own keyword arguments (handler, partitions, env); all stopped at the end,
    even when the test fails."""
    fleets: list[Fleet] = []

    def make(**kwargs: Any) -> Fleet:
        fleet = Fleet(
            tmp_path / f"members-{len(fleets)}" if fleets else tmp_path / "members",
            nats_url=nats_url,
            etcd_endpoint=etcd_endpoint,
            namespace=namespace,
            group=group,
            **kwargs,
        )
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in reversed(fleets):
        fleet.close()
