"""A connection to NATS that dies without a word, with one address.

NATS behind one address (a Kubernetes Service, a load balancer) whose pod was replaced,
or whose NAT entry expired: the member's TCP connection still looks open, nothing comes
back on it, and a new connection to the same address would work. nats-py keeps the
silent connection until its ping check gives up (ping_interval x max_outstanding_pings:
4 minutes by default, then the PING's own timeout), buffering what the member sends.
The member's NatsHealth knows within seconds that NATS does not answer (and gives its
partitions up); it must also make nats-py try a new connection, or a one-member group
stops for those minutes.

The proxy's `strand()` makes exactly that: the connections open at that moment are
blackholed for good, new ones pass.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from harness.fakesecrets import FakeSecrets
from harness.fleet import Fleet, settled, wait_for_status
from harness.natssecurity import NatsServerSecurity, NatsUser
from harness.proxy import TcpProxy
from harness.servers import NatsServer
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.clients.nats import NatsHealth, connect, round_trip
from shoal.clients.natsauth import NatsSecurity
from shoal.consumer.ledger import audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.spec import NatsSpec
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group
from shoal.operator.natssecret import NatsClients

pytestmark = pytest.mark.timeout(120)

# NatsHealth's grace and its reconnect bound, then nats-py's reconnect: well inside this.
RECOVERY_BOUND = 45.0


async def seconds_until_it_works(call: Callable[[], Awaitable[object]], what: str) -> float:
    """Seconds from now until `call` first succeeds (tried every 0.5 s); fails the test
    after RECOVERY_BOUND."""
    stranded = time.monotonic()
    while time.monotonic() - stranded < RECOVERY_BOUND:
        try:
            await call()
            return time.monotonic() - stranded
        except Exception:
            await asyncio.sleep(0.5)
    raise AssertionError(f"no {what} got through in {RECOVERY_BOUND:.0f} s")


async def test_a_stranded_nats_connection_is_replaced(nats_url: str) -> None:
    with TcpProxy(nats_url.removeprefix("nats://"), name="nats") as proxy:
        nc = await connect(f"nats://{proxy.address}", name="stranded", attempts=5)
        health = NatsHealth(nc, interval=0.5, grace=2.0)
        task = asyncio.create_task(health.run())
        try:
            await round_trip(nc, 2.0)
            assert proxy.strand() >= 1
            back = await seconds_until_it_works(lambda: round_trip(nc, 1.0), "round trip")
            print(f"round trips back {back:.1f} s after the connection was stranded")
            assert health.stranded_reconnects == 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await nc.close()


@pytest.mark.e2e
async def test_a_lone_member_consumes_again_soon_after_its_nats_connection_is_stranded(
    nats_url: str,
    make_fleet: Callable[..., Fleet],
    make_config: Callable[..., GroupConfig],
    etcd: Etcd,
    js: Any,
) -> None:
    """A one-member group: the member gives its partitions up once NATS stops answering
    (NatsHealth's grace), and takes them back once a new connection answers. Before
    `_replace_stranded`, nothing was consumed for the minutes of nats-py's ping check."""
    partitions = 8
    config = make_config(partitions=partitions)
    await ensure_group(js, config)
    with TcpProxy(nats_url.removeprefix("nats://"), name="nats") as proxy:
        fleet = make_fleet(partitions=partitions)
        member = fleet.start("m-0", NATS_URL=f"nats://{proxy.address}")
        await wait_for_status(
            etcd, config.namespace, config.group, partitions, settled({"m-0"}), 30
        )
        producer = Producer(js, config.subject_prefix, partitions)
        before = [Outgoing(f"p-{i % 10}", b"x", f"before-{i}") for i in range(50)]
        await producer.publish_many(before)

        async def ledger() -> list[Any]:
            return await read_ledger(js, config.ledger_stream)

        async def recorded() -> int:
            return len(await ledger())

        await eventually_async(recorded, 30, "the first 50", until=lambda n: n >= 50)
        assert proxy.strand() >= 1
        stranded = time.monotonic()
        after = [Outgoing(f"p-{i % 10}", b"x", f"after-{i}") for i in range(50)]
        await producer.publish_many(after)
        await eventually_async(
            recorded, RECOVERY_BOUND + 15, "the 50 published after", until=lambda n: n >= 100
        )
        print(f"consumed again {time.monotonic() - stranded:.1f} s after the stranding")
        records = await ledger()
        ids = [i.message_id or "" for i in before + after]
        summary = audit(records, ids).summary()
        assert (summary["lost"], summary["overlaps"]) == (0, 0), summary
        assert "on a connection the client counts as open" in member.log_text()


async def test_the_operators_stranded_nats_connection_is_replaced(
    nats_url: str, tmp_path: Path
) -> None:
    """The operator keeps one connection per server (and Secrets) for all its groups: a
    stranded one used to leave every group on it NatsUnavailable, and their streams
    unmanaged, for the minutes of nats-py's ping check."""
    with TcpProxy(nats_url.removeprefix("nats://"), name="nats") as proxy:
        clients = NatsClients(FakeSecrets(), NatsSecurity(), tmp_path / "files")
        url = f"nats://{proxy.address}"
        try:
            nc = await clients.get(url, "ns", NatsSpec(), connect=connect, attempts=2, user=1)
            await nc.jetstream().account_info()
            assert proxy.strand() >= 1

            async def request() -> None:
                nc = await clients.get(url, "ns", NatsSpec(), connect=connect, attempts=2, user=1)
                await nc.jetstream(timeout=1.0).account_info()

            back = await seconds_until_it_works(request, "JetStream request")
            print(f"the operator's requests back {back:.1f} s after the stranding")
        finally:
            await clients.close()


async def test_a_user_refused_the_health_subject_is_answered_not_stranded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A NATS user who may not publish the health check's subject (an operator user
    made before the operator used it): the server answers each round trip with a
    Permissions Violation, which proves the connection alive. Counted as an answer, said
    once, and never a forced reconnect (it would drop every group's requests on it)."""
    security = NatsServerSecurity.generate(
        tmp_path / "pki", [NatsUser("narrow", "pw", publish=("$JS.API.>",))]
    )
    server = NatsServer(tmp_path / "nats", security=security)
    server.start()
    try:
        nc = await connect(
            server.url, name="narrow", attempts=3, security=security.client("narrow")
        )
        health = NatsHealth(nc, interval=0.5, grace=1.0, stranded_after=2.0)
        task = asyncio.create_task(health.run())
        try:
            with caplog.at_level(logging.WARNING, logger="shoal.clients.nats"):
                await asyncio.sleep(6)
            assert health.reachable() and health.stranded_reconnects == 0
            assert nc.is_connected and nc.stats["reconnects"] == 0
            refused = [r for r in caplog.records if "refuses this user publish" in r.message]
            assert len(refused) == 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await nc.close()
    finally:
        server.stop()


class SilentClient:
    """Enough of a nats-py client for NatsHealth: round trips time out, the connection
    is up or not as the test says, and forced reconnects are counted."""

    def __init__(self) -> None:
        self.is_connected = True
        self.last_error = None
        self.forced = 0

    async def request(self, subject: str, data: bytes, timeout: float) -> None:
        await asyncio.sleep(timeout)
        raise TimeoutError

    async def force_reconnect(self) -> None:
        self.forced += 1
        self.is_connected = False

    async def _process_op_err(self, exc: Exception) -> None:  # nats-py's own path
        await self.force_reconnect()


async def test_a_new_connection_gets_its_full_time_before_it_is_replaced() -> None:
    """After an outage (a forced reconnect, or nats-py's own), the round trips failed
    all along: a connection made at last must not be dropped at its first slow answer
    for the failures of the one before."""
    nc = SilentClient()
    health = NatsHealth(nc, interval=0.1, grace=0.2, stranded_after=1.0)
    task = asyncio.create_task(health.run())
    try:
        await eventually_async(lambda: asyncio.sleep(0, nc.forced), 5, "a forced reconnect")
        await asyncio.sleep(1.5)  # reconnecting, round trips failing
        nc.is_connected = True
        back = time.monotonic()
        await eventually_async(
            lambda: asyncio.sleep(0, nc.forced), 5, "a second", until=lambda n: n == 2
        )
        assert time.monotonic() - back >= 0.9
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_one_stall_of_the_event_loop_is_not_a_dead_connection(nats_url: str) -> None:
    """The event loop is blocked for 11 s (a CPU-bound handler, a long GC pause) just as
    a health round trip goes out: the server answers at once, the answer is read late
    and the round trip times out. Before, the failure was dated from the round trip's
    start, 11 s back, past stranded_after: a healthy connection was aborted at once,
    and what was written to it with it."""
    nc = await connect(nats_url, name="stall", attempts=3)
    health = NatsHealth(nc, interval=1.0, grace=3.0, stranded_after=10.0)
    armed, stalled = False, asyncio.Event()
    request = nc.request

    async def stalling(*args: Any, **kwargs: Any) -> Any:
        nonlocal armed
        if armed:
            armed = False
            asyncio.get_running_loop().call_soon(time.sleep, 11)
            stalled.set()
        return await request(*args, **kwargs)

    nc.request = stalling
    task = asyncio.create_task(health.run())
    unreachable = False
    try:
        await asyncio.sleep(2.5)
        assert health.reachable()
        armed = True
        await stalled.wait()
        for _ in range(40):
            await asyncio.sleep(0.05)
            unreachable |= not health.reachable()
        await round_trip(nc, 2.0)
        assert health.stranded_reconnects == 0 and not unreachable
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await nc.close()
