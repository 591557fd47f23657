"""Member process faults: the leader frozen (SIGSTOP) for 25 s; a rolling restart.

Every scenario ends with FaultGroup.finish(): nothing acked lost, no overlap, no member
died, every partition claimed by a live member, one leader, skew <= 1. Measured figures
go to one JSON line each (harness.faults.report).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from harness.faults import TTL, FaultGroup, report

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.timeout(240)]


async def test_leader_sigstop_25s(make_group: Callable[..., FaultGroup]) -> None:
    """Bound: a new leader; the old one writes nothing after SIGCONT (its epoch is stale)."""
    old = "m-0"
    g = make_group()
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
    figures: dict[str, Any] = {
        "new_leader_s": round(new_leader_s, 2),
        "new_leader": new.leader,
        "partitions_moved_s": round(moved_s, 2),
        "old_leader_writes_after_sigcont": len(stale) + len(wrote),
    }
    figures.update(await g.finish())
    report("leader SIGSTOP 25 s", figures)
    assert new.epoch is not None and old_epoch is not None and new.epoch > old_epoch
    assert stale == [] and wrote == [], (stale, wrote)


async def test_rolling_restart_under_load(make_group: Callable[..., FaultGroup]) -> None:
    """Bound: 0 duplicates, 0 order inversions, no partition paused more than 3 s."""
    g = make_group()
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
    figures: dict[str, Any] = {"rolling_restart_s": round(time.monotonic() - started, 2)}
    await asyncio.sleep(2)
    figures.update(await g.finish())
    report("rolling restart of every member under load", figures)
    assert figures["duplicates"] == 0, figures
    assert figures["order_inversions"] == 0, figures
    # A paused partition shows as waiting messages: the longest publish-to-processing
    # wait bounds every pause (the gap between two records of one partition also counts
    # the producer's own spacing, up to 2.5 s at 400 msg/s over 1,000 projects).
    assert figures["max_latency_s"] <= 3, figures
