"""The operator's StallWatch on a real etcd: stopping it never fails an observation."""

from __future__ import annotations

from shoal.clients.etcd import Etcd
from shoal.operator.stallwatch import StallWatch


async def test_a_watch_whose_client_was_closed_stops_quietly(etcd_endpoint: str) -> None:
    """A rotated etcd Secret: the operator closes the old client, then the status timer
    replaces the watch made on it. Stopping that watch raised (the client's executor was
    shut down), and the observation reported the group EtcdUnavailable, Ready False, for
    one tick at every rotation."""
    etcd = Etcd(etcd_endpoint)
    await etcd.connect(attempts=5)
    watch = StallWatch(etcd, "/shoal/test/stallwatch/members/", 8)
    try:
        revision, _ = await etcd.get_prefix("/shoal/test/stallwatch/")
        await watch.start(revision + 1)
    finally:
        etcd.close()
    await watch.stop()
    assert watch.watch is None
