"""Keys Shoal writes only on a lease, found without one (shoal.consumer.leaseless): what
`etcdctl make-mirror` leaves, or a hand-written `etcdctl put`. Real members, etcd, NATS."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.producer import Producer
from shoal.contracts.names import Keys, partition_for
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def fleet(make_fleet: Callable[..., Fleet]) -> Fleet:
    return make_fleet(partitions=16, env={"SHOAL_LEASE_TTL": "5", "SHOAL_KEEPALIVE_INTERVAL": "1"})


async def test_lease_less_leader_member_and_claims_are_removed(
    fleet: Fleet,
    etcd: Etcd,
    js: Any,
    group: str,
    namespace: str,
    make_config: Callable[..., GroupConfig],
) -> None:
    """A leader key, a member key and two claims without a lease (as `etcdctl make-mirror`
    copies them). Before, they never expired: no member could campaign, so the group
    never had a leader, and had it had one, the ghost member would have been given
    partitions and the two claimed partitions would have waited for their claims for
    good, consumed by nobody, with every probe green."""
    config = make_config(partitions=16)
    await ensure_group(js, config)
    keys = Keys(namespace, group)
    await etcd.put(keys.leader, b"ghost")
    await etcd.put(keys.member("ghost"), b"{}")
    await etcd.put(keys.claim(3), b"ghost")
    # A claim in a live member's name, but not on its lease: not its either.
    await etcd.put(keys.claim(4), b"c-0")
    fleet.start("c-0")
    fleet.start("c-1")
    status = await wait_for_status(etcd, namespace, group, 16, settled({"c-0", "c-1"}), 45)
    assert "ghost" not in status.counts, status.counts
    assert status.leader in {"c-0", "c-1"}, status.leader
    _, kvs = await etcd.get_prefix(keys.prefix)
    assert kvs[keys.claim(3)].lease and kvs[keys.claim(4)].lease
    assert keys.member("ghost") not in kvs

    producer = Producer(js, config.subject_prefix, 16)
    for p in (3, 4):
        project = next(f"x{i}" for i in range(1000) if partition_for(f"x{i}", 16) == p)
        await producer.publish(project, b"after the mirror", message_id=f"m-{p}")

    async def stream_messages() -> int:
        return int((await js.stream_info(config.stream)).state.messages)

    await eventually_async(stream_messages, 20, "both consumed", until=lambda n: n == 0)
    log = "".join(fleet.members[m].log_text() for m in ("c-0", "c-1"))
    for key in (keys.leader, keys.member("ghost"), keys.claim(3), keys.claim(4)):
        assert f"Removing etcd key {key}: it has no lease" in log, key
    assert "Traceback" not in log
