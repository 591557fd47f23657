"""A 3-node NATS cluster: the node leading the group's stream killed (-9), then back.

Stream and durables are R3 (spec.nats.stream.replicas: 3); each member is given a
different node's URL (nats-py learns the others from the cluster). Ends with
FaultGroup.finish(): nothing acked lost, no overlap, no member died, every partition
claimed by a live member, one leader, skew <= 1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from harness.audit import resumed_after
from harness.faults import FaultGroup
from harness.servers import NatsCluster

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.timeout(300)]

#: How long the killed node stays away: longer than the bound, so that the bound is
#: judged while it is still gone.
DOWN_SECONDS = 20
BOUND_SECONDS = 15


async def test_stream_leader_node_killed_then_back(
    make_cluster_group: Callable[..., FaultGroup], nats_cluster: NatsCluster
) -> None:
    """Bound: every partition consumed again within 15 s of the kill."""
    g = make_cluster_group(
        name="3-node NATS cluster, the stream leader's node kill -9, back after 20 s",
        stream_replicas=3,
        member_env={f"m-{i}": {"NATS_URL": node.url} for i, node in enumerate(nats_cluster.nodes)},
    )
    await g.start(settle_timeout=60)
    await asyncio.sleep(4)
    info = await g.js.stream_info(g.config.stream)
    assert info.config.num_replicas == 3, info.config
    leader = info.cluster.leader
    durables = await g.js.consumers_info(g.config.stream)
    assert all(d.config.num_replicas in (3, 0, None) for d in durables)
    figures = g.figures
    figures["stream_leader"] = leader
    figures["durables_led_by_it"] = sum(
        1 for d in durables if d.cluster is not None and d.cluster.leader == leader
    )
    node = nats_cluster.node(leader)
    node.kill()
    killed = time.time()
    # Consumption must go on while it is away: judged before it comes back.
    await asyncio.sleep(DOWN_SECONDS)
    worst, delays = resumed_after(await g.records(), killed, range(g.config.partitions))
    figures["resumed_while_down_s"] = round(worst, 2)
    late = {p: round(d, 2) for p, d in delays.items() if d > BOUND_SECONDS}
    figures["partitions_later_than_bound"] = dict(sorted(late.items())[:20])
    figures["new_stream_leader"] = (await g.js.stream_info(g.config.stream)).cluster.leader
    node.start()
    back = time.time()
    figures["restarted_after_s"] = round(back - killed, 2)
    await asyncio.sleep(8)
    # Not a crash or fence of a member: deliveries lost in flight with the node come
    # back after ack_wait, and the runner that asked for them never stopped, so there is
    # no takeover to hold newer messages back (README: orderAfterFailure's scope).
    await g.finish(settle_timeout=60, drain_timeout=90, order_kept=False)
    if late:
        _, after_back = resumed_after(await g.records(), killed, late)
        figures["late_partitions_resumed_after_kill_s"] = {
            p: round(d, 2) for p, d in sorted(after_back.items())
        }
    assert figures["new_stream_leader"] != leader, figures
    assert worst <= BOUND_SECONDS, figures
