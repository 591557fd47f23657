"""Fixtures of the fault suite: fresh servers per scenario, a group that is always stopped.

Each scenario gets its own etcd and nats-server (they are killed, frozen and restarted
here, so no other test may share them), on free loopback ports, in the test's tmp
directory. Every process a scenario starts (servers, members, proxies) is stopped when it
ends, passed or failed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.faults import FaultGroup, QuotaEtcdServer, report
from harness.servers import EtcdServer, NatsCluster, NatsServer

_OUTCOME = pytest.StashKey[pytest.TestReport]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep the test's own outcome where its fixtures' teardown can read it."""
    rep = yield
    if rep.when == "call":
        item.stash[_OUTCOME] = rep
    return rep


@pytest.fixture
def etcd_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EtcdServer]:
    """This scenario's etcd; parametrized indirectly with a number, its backend quota in
    bytes (etcd raises its NOSPACE alarm beyond it)."""
    quota: int | None = getattr(request, "param", None)
    server = (
        EtcdServer(tmp_path / "etcd")
        if quota is None
        else QuotaEtcdServer(tmp_path / "etcd", quota_bytes=quota)
    )
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats")
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """Three clustered nats-server nodes (JetStream, separate stores), all stopped at the end."""
    cluster = NatsCluster(tmp_path / "nats-cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def make_group(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    nats_server: NatsServer,
    etcd_server: EtcdServer,
) -> AsyncIterator[Callable[..., FaultGroup]]:
    """FaultGroup(...) on this scenario's servers; closed at the end whatever happened.

    A group with a name has its figures reported (one JSON line) with the outcome,
    failed scenarios included.
    """
    async for make in _groups(request, tmp_path, nats_server, etcd_server):
        yield make


@pytest.fixture
async def make_cluster_group(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    nats_cluster: NatsCluster,
    etcd_server: EtcdServer,
) -> AsyncIterator[Callable[..., FaultGroup]]:
    """As make_group, on a 3-node NATS cluster."""
    async for make in _groups(request, tmp_path, nats_cluster, etcd_server):
        yield make


async def _groups(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    nats: NatsServer | NatsCluster,
    etcd_server: EtcdServer,
) -> AsyncIterator[Callable[..., FaultGroup]]:
    groups: list[FaultGroup] = []

    def make(**kwargs: Any) -> FaultGroup:
        group = FaultGroup(tmp_path / f"group{len(groups)}", nats, etcd_server, **kwargs)
        groups.append(group)
        return group

    try:
        yield make
    finally:
        for group in groups:
            await group.close()
        outcome = request.node.stash.get(_OUTCOME, None)
        for group in groups:
            if group.name is not None:
                figures: dict[str, Any] = {
                    "passed": outcome is not None and outcome.passed,
                    **group.figures,
                }
                if outcome is not None and outcome.failed:
                    figures["failure"] = str(outcome.longrepr).splitlines()[-1][:300]
                report(group.name, figures)
