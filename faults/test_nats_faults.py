"""NATS faults: the whole server killed and restarted; one member cut from it.

Every scenario ends with FaultGroup.finish(): nothing acked lost, no overlap, no member
died, every partition claimed by a live member, one leader, skew <= 1. Measured figures
go to one JSON line each (harness.faults.report).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable

import pytest

from harness.audit import resumed_after
from harness.faults import FaultGroup
from harness.servers import NatsServer
from shoal.contracts.names import durable_name

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.timeout(240)]


async def test_nats_kill_9_and_restart_after_6s(
    make_group: Callable[..., FaultGroup], nats_server: NatsServer
) -> None:
    """Bound: every partition consumed again within 10 s of the restart."""
    g = make_group(name="nats kill -9, restart after 6 s")
    await g.start()
    await asyncio.sleep(3)
    nats_server.kill()
    await asyncio.sleep(6)
    nats_server.start()
    restarted = time.time()
    await asyncio.sleep(12)
    figures = await g.finish()  # g.figures, the audit's added
    worst, _ = resumed_after(await g.records(), restarted, range(g.config.partitions))
    figures["resumed_after_restart_s"] = round(worst, 2)
    assert worst <= 10, figures


async def test_member_cut_from_nats_30s(make_group: Callable[..., FaultGroup]) -> None:
    """Bound: its partitions move to healthy members within 20 s; it takes work again
    after the heal."""
    victim = "m-2"
    g = make_group(name="one member cut from NATS (blackhole) 30 s", proxied={victim: ("nats",)})
    await g.start()
    await asyncio.sleep(3)
    before = await g.status()
    lost_partitions = g.partitions_of(before, victim)
    assert lost_partitions
    cut = time.time()
    g.proxy(victim, "nats").blackhole()
    healthy = set(g.member_ids) - {victim}
    try:
        await g.wait_for(
            lambda s: all(s.claims.get(p) in healthy for p in lost_partitions),
            30,
            f"{victim}'s partitions to be claimed by healthy members",
        )
        moved_in = time.time() - cut
    except TimeoutError:
        moved_in = float("inf")
    await asyncio.sleep(max(0.0, 30 - (time.time() - cut)))
    g.proxy(victim, "nats").pass_through()
    healed = time.time()
    await g.wait_for(
        lambda s: victim in s.claims.values(),
        30,
        f"{victim} to consume again after the heal",
    )
    back_in = time.time() - healed
    await asyncio.sleep(3)
    figures = await g.finish()  # g.figures, the audit's added
    worst, _ = resumed_after(await g.records(), cut, lost_partitions, not_by=victim)
    figures.update(
        victim_partitions=len(lost_partitions),
        claims_moved_s=round(moved_in, 2),
        consumed_elsewhere_s=round(worst, 2),
        took_work_after_heal_s=round(back_in, 2),
    )
    assert worst <= 20, figures


def in_msgs(nats_server: NatsServer) -> int:
    """Messages the server has received so far (its /varz)."""
    with urllib.request.urlopen(f"{nats_server.monitor_url}/varz", timeout=5) as response:
        return int(json.load(response)["in_msgs"])


async def inbound_rate(nats_server: NatsServer, seconds: float) -> float:
    start = await asyncio.to_thread(in_msgs, nats_server)
    await asyncio.sleep(seconds)
    return (await asyncio.to_thread(in_msgs, nats_server) - start) / seconds


async def test_durable_deleted_under_running_group(
    make_group: Callable[..., FaultGroup], nats_server: NatsServer
) -> None:
    """Bound: the durable is recreated (its partition is consumed again) and its owner
    does not busy-loop pull requests meanwhile."""
    g = make_group(name="a durable consumer deleted under a running group")
    status = await g.start()
    partition = 5
    await asyncio.sleep(2)
    figures = g.figures
    figures["inbound_msgs_per_s_before"] = round(await inbound_rate(nats_server, 4), 1)
    await g.js.delete_consumer(g.config.stream, durable_name(partition))
    deleted = time.time()
    figures["inbound_msgs_per_s_after"] = round(await inbound_rate(nats_server, 4), 1)
    await asyncio.sleep(4)
    await g.finish()
    worst, _ = resumed_after(await g.records(), deleted, [partition])
    figures["partition_owner"] = status.owners[partition]
    figures["consumed_again_s"] = round(worst, 2)
    assert worst <= 15, figures
    # The owner's pull loop on a missing durable must not add more than a few hundred
    # requests a second (the group's usual traffic here is well over 1,000 a second).
    assert figures["inbound_msgs_per_s_after"] < figures["inbound_msgs_per_s_before"] * 1.5, figures
