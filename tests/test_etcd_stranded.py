"""A connection to etcd that dies without a word, with one endpoint.

etcd behind one address (a Kubernetes Service, a load balancer) whose pod was replaced
or whose NAT entry expired: the client's TCP connection still looks open, but nothing
comes back on it, while a new connection to the same address would work. Without
keep-alive pings the gRPC channel goes on using the silent connection: every call fails
at its deadline and a watch goes quiet with no error, until the kernel gives the
connection up (some 15 minutes of TCP retransmissions). A member then loses its lease
and stays fenced for as long: the whole group stops.

The proxy's `strand()` makes exactly that: the connections open at that moment are
blackholed for good, new ones pass. The client must find the working path on its own,
within its keep-alive bound (shoal.clients.etcd.GRPC_OPTIONS), calls and watches both.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from harness.fleet import Fleet, settled, wait_for_status
from harness.proxy import TcpProxy
from harness.servers import EtcdServer
from shoal.clients.etcd import Etcd

pytestmark = pytest.mark.timeout(120)

# Keep-alive ping every 10 s, 5 s to answer, then a new connection and its backoff: well
# inside this. Without keep-alive nothing gets through for minutes.
RECOVERY_BOUND = 40.0


async def test_a_stranded_connection_is_replaced_calls_and_watches_go_on(
    etcd_server: EtcdServer,
) -> None:
    direct = Etcd(etcd_server.endpoint)
    await direct.connect(attempts=5)
    with TcpProxy(etcd_server.endpoint, name="etcd") as proxy:
        client = Etcd(proxy.address, timeout=2.0)
        await client.connect(attempts=5)
        seen: list[bytes] = []
        event = threading.Event()
        ended = threading.Event()  # the watch ended with an error: its user watches again
        moved = threading.Event()  # calls moved to a new client: watches must move too
        client.on_new_client(moved.set)

        def on_watch(response: object) -> None:
            if isinstance(response, BaseException):
                ended.set()
                return
            for e in getattr(response, "events", []):
                seen.append(e.value)
                event.set()

        try:
            revision, _ = await client.get_prefix("/stranded/")
            watch = await client.watch_prefix("/stranded/", revision + 1, on_watch)
            await direct.put("/stranded/a", b"before")
            assert await asyncio.to_thread(event.wait, 10), "the watch saw nothing before"
            event.clear()

            assert proxy.strand() >= 1
            stranded = time.monotonic()
            await direct.put("/stranded/b", b"after")

            # Calls: each fails at its deadline until the client has a live connection.
            got = None
            while time.monotonic() - stranded < RECOVERY_BOUND:
                try:
                    _, kvs = await client.get_prefix("/stranded/")
                    got = kvs
                    break
                except Exception:
                    await asyncio.sleep(0.5)
            calls_back = time.monotonic() - stranded
            assert got is not None, f"no call got through in {RECOVERY_BOUND:.0f} s"
            assert set(got) == {"/stranded/a", "/stranded/b"}

            # The watch may not stay silent: it delivers what was written meanwhile, or
            # it ends with an error, or the client says that calls moved to a new client
            # (on_new_client), so that its user (GroupView) watches again there; doing
            # that here, the event written while the connection was dead arrives.
            left = RECOVERY_BOUND - (time.monotonic() - stranded)
            deadline = time.monotonic() + max(left, 0.1)
            while not (event.is_set() or ended.is_set() or moved.is_set()):
                assert time.monotonic() < deadline, "the watch stayed silent"
                await asyncio.sleep(0.1)
            if not event.is_set():
                watch = await client.watch_prefix("/stranded/", revision + 1, on_watch)
                while b"after" not in seen:
                    assert time.monotonic() < deadline + 10, "the new watch saw nothing"
                    await asyncio.sleep(0.1)
            print(
                f"\nstranded: calls got through after {calls_back:.1f} s, the watch's event "
                f"after {time.monotonic() - stranded:.1f} s (ended: {ended.is_set()}, "
                f"moved: {moved.is_set()})"
            )
            await client.cancel_watch(watch)
        finally:
            client.close()
            direct.close()


@pytest.mark.e2e
async def test_a_member_whose_etcd_connection_is_stranded_stays_in_its_group(
    tmp_path: Path, nats_url: str, etcd_endpoint: str, namespace: str, group: str
) -> None:
    """Two real members; c-0 reaches etcd through the proxy, which strands its
    connections. Before it made a new connection, c-0 lost its lease and stayed fenced
    with no partitions until the kernel gave the dead connection up (minutes); now it
    is back in the settled group within seconds, and says why in one line."""
    etcd = Etcd(etcd_endpoint)
    await etcd.connect(attempts=5)
    with (
        TcpProxy(etcd_endpoint, name="etcd") as proxy,
        Fleet(
            tmp_path / "members",
            nats_url=nats_url,
            etcd_endpoint=etcd_endpoint,
            namespace=namespace,
            group=group,
            partitions=8,
        ) as fleet,
    ):
        try:
            fleet.start("c-0", ETCD_ENDPOINTS=proxy.address)
            fleet.start("c-1")
            both = settled({"c-0", "c-1"})
            await wait_for_status(etcd, namespace, group, 8, both, 30)
            assert proxy.strand() >= 1
            stranded = time.monotonic()
            log = fleet.members["c-0"].log_text
            while "opening a new one" not in log():
                assert time.monotonic() - stranded < RECOVERY_BOUND, "c-0 kept the dead one"
                await asyncio.sleep(0.2)
            reconnected = time.monotonic() - stranded
            # Past the lease's TTL (10 s): a member still cut off would have lost its
            # lease and its member key by now. Whatever happened meanwhile (c-0 may have
            # fenced itself and its partitions moved), the group is settled with both.
            await asyncio.sleep(max(0.0, 12 - (time.monotonic() - stranded)))
            await wait_for_status(etcd, namespace, group, 8, both, RECOVERY_BOUND, interval=0.5)
            fenced = "fenced" in log().lower()
            print(
                f"\nc-0 made a new connection {reconnected:.1f} s after its connection was "
                f"stranded; the group settled with both members "
                f"{time.monotonic() - stranded:.1f} s after (c-0 fenced meanwhile: {fenced})"
            )
        finally:
            etcd.close()
