"""A real group: consumer processes on a real etcd and a real nats-server.

These tests prove the hand-over protocol: planned moves lose and duplicate nothing,
a killed member's partitions resume elsewhere, a leader fail-over moves nothing by
itself, and a frozen member fences itself so no partition is consumed twice at once.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.audit import message_ids
from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.assignor import min_moves, moved
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import LedgerRecord, audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group
from shoal.group.status import GroupStatus

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

# Short leases keep the failure tests quick; the protocol does not depend on the value.
# ack_wait stays below TTL - fence margin, as with the defaults (5 s < 10 s - 2 s): a
# crashed member's unacked messages are then due for redelivery before anyone takes
# its partitions over, so JetStream hands them out first and per-project order holds.
TTL = 5
ACK_WAIT = 2.0
FAST_ENV = {
    "SHOAL_LEASE_TTL": str(TTL),
    "SHOAL_KEEPALIVE_INTERVAL": "1",
    "SHOAL_ACK_WAIT": str(ACK_WAIT),
}


@pytest.fixture
def config(group: str, namespace: str, nats_url: str, etcd_endpoint: str) -> GroupConfig:
    return GroupConfig(
        group=group,
        namespace=namespace,
        nats_url=nats_url,
        etcd_endpoints=etcd_endpoint,
        handler="shoal.consumer.handlers:ledger",
        ledger=True,
        ack_wait=ACK_WAIT,
    )


@pytest.fixture
def fleet(tmp_path: Path, config: GroupConfig) -> Iterator[Fleet]:
    with Fleet(
        tmp_path / "members",
        nats_url=config.nats_url,
        etcd_endpoint=config.etcd_endpoints,
        namespace=config.namespace,
        group=config.group,
        env=FAST_ENV,
    ) as f:
        yield f


def traffic(count: int, projects: int, run: str) -> list[Outgoing]:
    return [
        Outgoing(f"project-{i % projects}", b"x", f"{run}-{i}", {SEQ_HEADER: str(i // projects)})
        for i in range(count)
    ]


async def produce_paced(producer: Producer, items: list[Outgoing], seconds: float) -> None:
    """Spread the messages over `seconds`, so membership changes happen mid-stream."""
    chunks = 20
    size = max(1, len(items) // chunks)
    for start in range(0, len(items), size):
        await producer.publish_many(items[start : start + size])
        await asyncio.sleep(seconds / chunks)


async def drained(js: Any, config: GroupConfig, expected: int, timeout: float) -> None:
    async def left_and_done() -> tuple[int, int]:
        work = await js.stream_info(config.stream)
        ledger = await js.stream_info(config.ledger_stream)
        return work.state.messages, ledger.state.messages

    await eventually_async(
        left_and_done,
        timeout,
        f"the group to drain and record {expected} messages",
        until=lambda counts: counts[0] == 0 and counts[1] >= expected,
        interval=0.2,
        describe=lambda counts: f"{counts[0]} left, {counts[1]} done",
    )


def assert_mid_stream(
    records: list[LedgerRecord],
    fault: str,
    at: float,
    partitions: Collection[int],
    before: Collection[str],
    after: Collection[str],
) -> None:
    """The fault placed by a sleep at wall time `at` landed while messages flowed through
    `partitions`: `before` processed some of them before it, `after` some after it.

    The sleeps only aim; this checks they hit (a slow machine could let production end
    first, and the test would then prove nothing about a fault under load).
    """
    ours = [r for r in records if r.partition in partitions]
    done_before = [r for r in ours if r.member in before and r.finished <= at]
    done_after = [r for r in ours if r.member in after and r.started >= at]
    span = (min(r.started for r in ours) - at, max(r.finished for r in ours) - at) if ours else ()
    assert done_before and done_after, (
        f"{fault} did not land mid-stream: of the {len(ours)} messages of its partitions, "
        f"{len(done_before)} were processed before it by {sorted(before)}, "
        f"{len(done_after)} after it by {sorted(after)} (processing from/to, in seconds "
        f"relative to the fault: {span})"
    )


async def start_group(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig, members: list[str], **env: str
) -> GroupStatus:
    """Create the group's streams, start the members, wait until they own everything."""
    await ensure_group(js, config)
    for member in members:
        fleet.start(member, **env)
    return await wait_for_status(
        etcd, config.namespace, config.group, config.partitions, settled(set(members)), 30
    )


async def test_join_and_graceful_leave_while_producing(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    P, ns, g = config.partitions, config.namespace, config.group
    before = await start_group(fleet, etcd, js, config, ["c-0", "c-1", "c-2"])

    items = traffic(20_000, 1000, "jl")
    producer = Producer(js, config.subject_prefix, P)
    production = asyncio.create_task(produce_paced(producer, items, 12.0))

    await asyncio.sleep(3)
    fleet.start("c-3")
    joined_at = time.time()  # wall clock, like the ledger's times
    joined = await wait_for_status(etcd, ns, g, P, settled({"c-0", "c-1", "c-2", "c-3"}), 30)
    join_moves = moved(before.owners, joined.owners)
    assert len(join_moves) == min_moves(P, joined.members, before.owners) == 32
    assert {to for _, _, to in join_moves} == {"c-3"}

    await asyncio.sleep(2)
    fleet.term("c-0")
    left_at = time.time()
    left = await wait_for_status(etcd, ns, g, P, settled({"c-1", "c-2", "c-3"}), 30)
    leave_moves = moved(joined.owners, left.owners)
    assert len(leave_moves) == joined.counts["c-0"]
    assert {frm for _, frm, _ in leave_moves} == {"c-0"}
    assert fleet.wait_exit("c-0", 30) == 0
    # A graceful leave releases each claim once, through its runner; before the view
    # caught up with those deletes, the member took them for claims that outlived a fence.
    leaver_log = fleet.members["c-0"].log_text()
    assert "Released " in leaver_log, leaver_log[-2000:]
    assert "outlived a fence" not in leaver_log, leaver_log[-2000:]

    await production
    await drained(js, config, len(items), 60)
    records = await read_ledger(js, config.ledger_stream)
    assert_mid_stream(
        records,
        "c-3 joining",
        joined_at,
        {p for p, _, _ in join_moves},
        before={"c-0", "c-1", "c-2"},
        after={"c-3"},
    )
    assert_mid_stream(
        records,
        "c-0 leaving",
        left_at,
        {p for p, _, _ in leave_moves},
        before={"c-0"},
        after={"c-1", "c-2", "c-3"},
    )
    result = audit(records, message_ids(items))
    assert result.summary() == {
        "expected": 20_000,
        "processed": 20_000,
        "lost": 0,
        "duplicates": 0,
        "out_of_order": 0,
        "overlaps": 0,
    }, fleet.logs()


async def test_kill_9_loses_nothing_and_resumes_within_ttl(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    P, ns, g = config.partitions, config.namespace, config.group
    before = await start_group(
        fleet, etcd, js, config, ["c-0", "c-1", "c-2"], SHOAL_HANDLER_DELAY_MS="1"
    )
    victim_partitions = {p for p, m in before.owners.items() if m == "c-1"}

    items = traffic(6_000, 300, "k9")
    producer = Producer(js, config.subject_prefix, P)
    production = asyncio.create_task(produce_paced(producer, items, 6.0))
    await asyncio.sleep(2)
    fleet.kill("c-1")
    killed_at, killed_wall = time.monotonic(), time.time()
    after = await wait_for_status(etcd, ns, g, P, settled({"c-0", "c-2"}), TTL + 10)
    resumed_in = time.monotonic() - killed_at
    assert resumed_in < TTL + 2, f"partitions resumed only after {resumed_in:.1f} s"
    assert {p for p, _, _ in moved(before.owners, after.owners)} == victim_partitions

    await production
    await drained(js, config, len(items), 60)
    records = await read_ledger(js, config.ledger_stream)
    assert_mid_stream(
        records, "kill -9 of c-1", killed_wall, victim_partitions, {"c-1"}, {"c-0", "c-2"}
    )
    result = audit(records, message_ids(items))
    assert result.lost == []
    assert result.out_of_order == []
    # Only messages the killed member had handled but not acked come back a second time.
    for mid, recs in result.duplicates.items():
        assert recs[0].member == "c-1", (mid, recs)
        assert all(r.member != "c-1" for r in recs[1:]), (mid, recs)
    assert result.overlaps == []


async def test_leader_failover_moves_nothing_by_itself(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    P, ns, g = config.partitions, config.namespace, config.group
    before = await start_group(fleet, etcd, js, config, ["c-0", "c-1", "c-2"])
    old_leader, old_epoch = before.leader, before.epoch
    assert old_leader is not None and old_epoch is not None
    survivors = {"c-0", "c-1", "c-2"} - {old_leader}

    fleet.kill(old_leader)
    killed_at = time.monotonic()
    new = await wait_for_status(
        etcd,
        ns,
        g,
        P,
        lambda s: s.leader is not None and s.leader != old_leader,
        TTL + 10,
    )
    took = time.monotonic() - killed_at
    assert took < TTL + 2, f"no new leader for {took:.1f} s"
    assert new.epoch is not None and new.epoch > old_epoch
    after = await wait_for_status(etcd, ns, g, P, settled(survivors), 30)
    moves = moved(before.owners, after.owners)
    # Only the dead leader's partitions moved; the fail-over itself moved none.
    assert {frm for _, frm, _ in moves} == {old_leader}
    assert len(moves) == before.counts[old_leader]


async def test_graceful_leader_departure_hands_over_at_once(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    P, ns, g = config.partitions, config.namespace, config.group
    before = await start_group(fleet, etcd, js, config, ["c-0", "c-1", "c-2"])
    assert before.leader is not None
    survivors = {"c-0", "c-1", "c-2"} - {before.leader}
    fleet.term(before.leader)
    started = time.monotonic()
    after = await wait_for_status(
        etcd, ns, g, P, lambda s: settled(survivors)(s) and s.leader in survivors, 20
    )
    # Much faster than a lease expiry: the leader resigned instead of dying.
    assert time.monotonic() - started < TTL
    assert {frm for _, frm, _ in moved(before.owners, after.owners)} == {before.leader}


async def test_frozen_member_fences_itself(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    P, ns, g = config.partitions, config.namespace, config.group
    before = await start_group(
        fleet, etcd, js, config, ["c-0", "c-1", "c-2"], SHOAL_HANDLER_DELAY_MS="2"
    )
    frozen_partitions = {p for p, m in before.owners.items() if m == "c-1"}

    items = traffic(6_000, 300, "st")
    producer = Producer(js, config.subject_prefix, P)
    production = asyncio.create_task(produce_paced(producer, items, 8.0))
    await asyncio.sleep(1.5)
    fleet.signal("c-1", signal.SIGSTOP)
    stopped_at = time.time()
    await wait_for_status(etcd, ns, g, P, settled({"c-0", "c-2"}), TTL + 10)
    await asyncio.sleep(2)
    fleet.signal("c-1", signal.SIGCONT)
    # It notices its lease is gone, stops, re-joins, and gets a fair share back.
    await wait_for_status(etcd, ns, g, P, settled({"c-0", "c-1", "c-2"}), 30)

    await production
    await drained(js, config, len(items), 60)
    records = await read_ledger(js, config.ledger_stream)
    assert_mid_stream(
        records, "SIGSTOP of c-1", stopped_at, frozen_partitions, {"c-1"}, {"c-0", "c-2"}
    )
    result = audit(records, message_ids(items))
    assert result.lost == []
    assert result.overlaps == [], result.overlaps[:5]
    log = fleet.members["c-1"].log_text()
    assert "Lease" in log and "expired" in log, log[-3000:]
