"""Member process faults: the leader frozen (SIGSTOP) for 25 s; a rolling restart.

Every scenario ends with FaultGroup.finish(): nothing acked lost, no overlap, no member
died, every partition claimed by a live member, one leader, skew <= 1. Measured figures
go to one JSON line each (harness.faults.report).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import Callable

import pytest

from harness.faults import TTL, FaultGroup

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.timeout(240)]


async def test_leader_sigstop_25s(make_group: Callable[..., FaultGroup]) -> None:
    """Bound: a new leader; the old one writes nothing after SIGCONT (its epoch is stale)."""
    old = "m-0"
    g = make_group(name="leader SIGSTOP 25 s")
    before = await g.start(leader=old)
    old_epoch = before.epoch
    await asyncio.sleep(3)
    stopped = time.monotonic()
    g.fleet.signal(old, signal.SIGSTOP)
    try:
        new = await g.wait_for(
            lambda s: s.leader not in (None, old), TTL + 5, "a new leader while the old is frozen"
        )
        new_leader_s = time.monotonic() - stopped
        await g.wait_for(g.settled({"m-1", "m-2"}), TTL + 10, "the others to take over")
        moved_s = time.monotonic() - stopped
        await asyncio.sleep(max(0.0, 25 - (time.monotonic() - stopped)))
        revision, _ = await g.etcd.get_prefix(g.config.keys.leader)
        offset = len(g.log_of(old))
    finally:
        g.fleet.signal(old, signal.SIGCONT)
    await g.wait_for(g.settled(), 30, f"{old} to rejoin")
    await asyncio.sleep(3)
    # Nothing the old leader could have written after SIGCONT carries its epoch.
    _, targets = await g.etcd.get_prefix(g.config.keys.partitions)
    stale = [
        kv.key
        for kv in targets.values()
        if kv.mod_revision > revision and json.loads(kv.value).get("epoch") == old_epoch
    ]
    wrote = [line for line in g.log_of(old)[offset:].splitlines() if "Wrote generation" in line]
    figures = g.figures
    figures |= {
        "new_leader_s": round(new_leader_s, 2),
        "new_leader": new.leader,
        "partitions_moved_s": round(moved_s, 2),
        "old_leader_writes_after_sigcont": len(stale) + len(wrote),
    }
    await g.finish()
    assert new.epoch is not None and old_epoch is not None and new.epoch > old_epoch
    assert stale == [] and wrote == [], (stale, wrote)


async def test_rolling_restart_under_load(make_group: Callable[..., FaultGroup]) -> None:
    """Bound: 0 duplicates, 0 order inversions, no partition paused more than 3 s."""
    # The default ack_wait (5 s): nothing crashes here, and on a busy machine 2 s can run
    # out for a message waiting its turn, which is then redelivered (a duplicate).
    g = make_group(name="rolling restart of every member under load", env={"SHOAL_ACK_WAIT": "5"})
    await g.start()
    await asyncio.sleep(3)
    started = time.monotonic()
    leader = (await g.status()).leader
    # The leader last, as a rolling update of a Deployment might do, or first: both work;
    # last makes the group hand leadership over once only.
    order = sorted(g.member_ids, key=lambda m: m == leader)
    for member in order:
        g.fleet.term(member)
        # In a thread: the producer must go on meanwhile.
        code = await asyncio.to_thread(g.fleet.wait_exit, member, 30)
        assert code == 0, g.log_of(member)[-3000:]
        g.start_member(member)
        await g.wait_for(g.settled(), 30, f"the group to settle after restarting {member}")
        await asyncio.sleep(1)
    figures = g.figures
    figures |= {"rolling_restart_s": round(time.monotonic() - started, 2)}
    await asyncio.sleep(2)
    await g.finish()
    assert figures["duplicates"] == 0, figures
    assert figures["order_inversions"] == 0, figures
    # A paused partition shows as waiting messages: the longest publish-to-processing
    # wait bounds every pause (the gap between two records of one partition also counts
    # the producer's own spacing, up to 2.5 s at 400 msg/s over 1,000 projects).
    assert figures["max_latency_s"] <= 3, figures


async def test_handler_longer_than_drain_timeout_then_sigterm(
    make_group: Callable[..., FaultGroup],
) -> None:
    """Bound: no overlap with the next owner (the handler stops before the partition
    is handed over, although it is not done)."""
    victim = "m-2"
    g = make_group(
        name="a handler running longer than the drain timeout, then SIGTERM",
        handler="harness.handlers:slow_ledger",
        env={"SHOAL_DRAIN_TIMEOUT": "2"},
    )
    await g.start(leader="m-0")
    await asyncio.sleep(2)
    offset = len(g.log_of(victim))
    # Cancelled, it takes 0.5 s to stop: a shutdown that does not wait for it before
    # handing the partition over lets the next owner start meanwhile.
    mid, partition = await g.publish_slow(victim, 8, cleanup=0.5)
    await g.wait_log(victim, "Slow message", 10, after=offset)
    g.fleet.term(victim)
    g.gone.add(victim)
    code = await asyncio.to_thread(g.fleet.wait_exit, victim, 30)
    found = re.search(rf"Slow message {mid} stopped at ([0-9.]+)", g.log_of(victim)[offset:])
    assert found is not None, g.log_of(victim)[offset:][-3000:]
    handler_end = float(found.group(1))
    await asyncio.sleep(3)
    figures = g.figures
    figures["victim_exit_code"] = code
    await g.finish()
    others = [r for r in await g.records() if r.partition == partition and r.member != victim]
    assert g.producer is not None
    sent = g.producer.acked[mid]
    next_start = min((r.started for r in others if r.started > sent), default=None)
    assert next_start is not None
    figures["handler_end_before_next_owner_s"] = round(next_start - handler_end, 3)
    assert code == 0
    assert handler_end < next_start, figures


async def test_consumer_settings_change_reaches_the_durables(
    make_group: Callable[..., FaultGroup],
) -> None:
    """Bound: after ack_wait / max_deliver / backoff change (the operator rolls the pods
    with the new settings), every durable has them. (maxDeliver is the members' to count,
    not JetStream's: every durable's own limit stays off, -1; jetstream.consumer_config.)"""
    g = make_group(name="ackWait / maxDeliver / backoff changed in the spec")
    await g.start()
    await asyncio.sleep(2)
    changed = {"SHOAL_ACK_WAIT": "4", "SHOAL_MAX_DELIVER": "7", "SHOAL_BACKOFF": "1,3"}
    g.fleet.env.update(changed)
    restarted = time.monotonic()
    for member in g.member_ids:
        g.fleet.term(member)
        code = await asyncio.to_thread(g.fleet.wait_exit, member, 30)
        assert code == 0, g.log_of(member)[-3000:]
        g.start_member(member)
        await g.wait_for(g.settled(), 30, f"the group to settle after restarting {member}")
    infos = await g.js.consumers_info(g.config.stream)
    stale = sorted(
        info.name
        for info in infos
        # The backoff is the members' (it spaces their in-place retries), not the durables'.
        if info.config.max_deliver != -1 or info.config.ack_wait != 4.0 or info.config.backoff
    )
    figures = g.figures
    figures["rolled_s"] = round(time.monotonic() - restarted, 2)
    figures["durables"] = len(infos)
    figures["durables_with_old_settings"] = len(stale)
    await g.finish()
    assert len(infos) == g.config.partitions and stale == [], figures
