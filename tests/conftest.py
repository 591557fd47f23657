"""Shared fixtures: one real etcd and one real nats-server per pytest session.

The servers start lazily, on the first test that asks for them (unit tests never do), in
a pytest tmp directory, bound to 127.0.0.1 on free ports; they are stopped when the
session ends, whatever happened. Binaries: see harness.servers (`make test` sets
SHOAL_ETCD and SHOAL_NATS_SERVER).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from harness.fakesecrets import FakeSecrets
from harness.fleet import Fleet
from harness.servers import EtcdServer, NatsServer
from shoal.analytics.timing import HEADER
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


def _report_in_a_process(*args: str) -> tuple[float, str]:
    """``shoal-analytics report`` as users run it: (its wall time, its stderr)."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "shoal.analytics", "report", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    wall = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-4000:]
    return wall, done.stderr


def _assert_timing_block(stderr: str, summary: dict[str, Any], wall: float) -> list[str]:
    """The block at the end of stderr lists summary.json's phases, which start at the
    process's start and add up to no more than the wall time measured outside; returns
    the phases' names."""
    timing = summary["timing"]
    names = [phase["name"] for phase in timing["phases"]]
    lines = stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if HEADER in line)
    block = lines[at + 1 : at + 2 + sum(1 + len(p.get("steps", [])) for p in timing["phases"])]
    said = [line.removeprefix("report:").strip().rsplit(maxsplit=1) for line in block]
    listed = [name for name, _ in said]
    assert [n for n in listed if n in names] == names and listed[-1] == "total", block
    assert names[0].startswith("start:") and names[1].startswith("import the report")
    assert all(phase["s"] >= 0 for phase in timing["phases"])
    assert timing["total_s"] == pytest.approx(sum(p["s"] for p in timing["phases"]), abs=0.01)
    assert float(said[-1][1]) == pytest.approx(timing["total_s"], abs=0.06)
    # /proc's start time has a 10 ms resolution; the wall time outside includes the fork.
    assert timing["total_s"] <= wall + 0.02
    return names


@pytest.fixture
def timed_report() -> Callable[..., tuple[list[str], dict[str, Any]]]:
    """``timed_report(*args)`` runs ``shoal-analytics report *args`` in a fresh process
    (``--out``/``-o`` among the args), checks the timing block it ends with against its
    summary.json and the wall time, and returns (the phases' names, summary.json)."""

    def run(*args: str) -> tuple[list[str], dict[str, Any]]:
        wall, stderr = _report_in_a_process(*args)
        flag = next(i for i, arg in enumerate(args) if arg in ("-o", "--out"))
        summary = json.loads((Path(args[flag + 1]) / "summary.json").read_text())
        return _assert_timing_block(stderr, summary, wall), summary

    return run
