"""A rate-limited group on real servers: the group's rate stays within its limit, and
nothing is lost, duplicated, reordered or run by two members at once (issue 27).

Real nats-server, etcd and two member processes (harness.fleet) running the ledger
handler. The limiter alone is tested on a fake clock in test_ratelimit.py; the accuracy
over 10 s windows, across a scale from 4 to 6 members, is bench/ratelimit.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER, partition_for
from shoal.group.config import config_env
from shoal.group.jetstream import ensure_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HANDLER = "shoal.consumer.handlers:ledger"
PARTITIONS = 16
LIMIT = 200.0
PROJECTS = 300
PER_PROJECT = 10  # 3,000 messages: 15 s at the limit
# Short, so that held messages outlive it many times over while they wait for the limit:
# only the members' in-progress acks keep them from being redelivered.
ACK_WAIT = 2.0
SETTINGS = ("handler", "partitions", "ledger", "ack_wait", "max_messages_per_second")


def backlog() -> tuple[list[Outgoing], list[str]]:
    """PER_PROJECT messages for each of PROJECTS projects, interleaved; and their ids."""
    items = [
        Outgoing(f"proj-{p}", b"x", f"proj-{p}-{i}", {SEQ_HEADER: str(i)})
        for i in range(PER_PROJECT)
        for p in range(PROJECTS)
    ]
    return items, [item.message_id for item in items if item.message_id is not None]


def busiest_second(starts: list[float]) -> int:
    """The most handler runs that started within one second (starts sorted)."""
    j = 0
    busiest = 0
    for i, t in enumerate(starts):
        while starts[j] <= t - 1.0:
            j += 1
        busiest = max(busiest, i - j + 1)
    return busiest


async def ledger_size(js: Any, stream: str) -> int:
    info = await js.stream_info(stream)
    return int(info.state.messages)


CLEAN = {"lost": 0, "duplicates": 0, "out_of_order": 0, "overlaps": 0}


async def test_a_limited_group_keeps_its_rate_and_every_promise(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """Two members share 200 messages/s (100 each: 8 of 16 partitions each). A backlog of
    3,000 messages over 300 projects, published once the group has settled, is processed
    at no more than the limit (bounds generous: the burst is 50 ms of a share), and not
    much below it; the ledger shows 0 lost, 0 duplicates, 0 out of order, 0 overlaps.

    Each member holds a few hundred messages at a time, so most wait several seconds for
    their turn, ack_wait (2 s) several times over: every ledger record's delivery count
    is 1, i.e. the in-progress acks kept every waiting message alive (without them each
    would be redelivered after 2 s)."""
    config = make_config(
        handler=HANDLER, partitions=PARTITIONS, max_messages_per_second=LIMIT, ack_wait=ACK_WAIT
    )
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=PARTITIONS)
    env = config_env(config, SETTINGS)
    assert env["SHOAL_MAX_MESSAGES_PER_SECOND"] == "200"
    for name in ("m-0", "m-1"):
        fleet.start(name, **env)
    await wait_for_status(
        etcd, config.namespace, config.group, PARTITIONS, settled({"m-0", "m-1"}), 60
    )
    items, expected = backlog()
    published = time.time()
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)

    # 15 s at the limit; a generous bound for a busy machine.
    await eventually_async(
        lambda: ledger_size(js, config.ledger_stream),
        90,
        "every message in the ledger",
        until=lambda n: n >= len(expected),
    )
    records = await read_ledger(js, config.ledger_stream)
    result = audit(records, expected)
    assert result.summary() == {
        "expected": len(expected),
        "processed": len(expected),
        "lost": 0,
        "duplicates": 0,
        "out_of_order": 0,
        "overlaps": 0,
    }, result.summary()
    redelivered = [r for r in records if r.delivery_count != 1]
    assert not redelivered, redelivered[:5]
    assert {r.member for r in records} == {"m-0", "m-1"}

    starts = sorted(r.started for r in records)
    assert starts[0] >= published - 1.0
    elapsed = starts[-1] - starts[0]
    rate = (len(starts) - 1) / elapsed
    # The limit, plus the two members' bursts (5 tokens each) over the whole run.
    assert rate <= LIMIT * 1.05, f"{rate:.1f} messages/s over {elapsed:.1f} s"
    # Not throttled to nothing either: 3,000 messages in at most 30 s (100/s).
    assert elapsed <= 30, f"{rate:.1f} messages/s over {elapsed:.1f} s"
    # No second above the limit by more than the bursts and the clocks' jitter.
    busiest = busiest_second(starts)
    assert busiest <= LIMIT * 1.25, f"{busiest} messages in one second"
    for name in ("m-0", "m-1"):
        log = fleet.members[name].log_text()
        assert "Traceback" not in log, log[-3000:]


async def test_the_limit_holds_while_the_group_scales_down_and_up(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """The same backlog through a scale-down and a scale-up at 200 messages/s: two
    members, then one leaves (SIGTERM: its 8 partitions are handed over, and the other's
    share doubles), then a new one joins (half of them move to it). Over the whole run
    and in every second the group stays within the limit; the ledger shows 0 lost, 0
    duplicates, 0 out of order, 0 overlaps."""
    config = make_config(
        handler=HANDLER, partitions=PARTITIONS, max_messages_per_second=LIMIT, ack_wait=ACK_WAIT
    )
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=PARTITIONS)
    env = config_env(config, SETTINGS)
    for name in ("m-0", "m-1"):
        fleet.start(name, **env)
    await wait_for_status(
        etcd, config.namespace, config.group, PARTITIONS, settled({"m-0", "m-1"}), 60
    )
    items, expected = backlog()
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)

    async def processed_at_least(n: int, what: str) -> None:
        await eventually_async(
            lambda: ledger_size(js, config.ledger_stream), 60, what, until=lambda k: k >= n
        )

    await processed_at_least(600, "600 messages processed by two members")
    fleet.term("m-1")  # scale down: m-0 takes its partitions and its share
    assert fleet.wait_exit("m-1", 60) == 0
    await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 60)
    await processed_at_least(1500, "1,500 messages processed, the last by one member")
    fleet.start("m-2", **env)  # scale up again
    await wait_for_status(
        etcd, config.namespace, config.group, PARTITIONS, settled({"m-0", "m-2"}), 60
    )
    await processed_at_least(len(expected), "every message in the ledger")

    records = await read_ledger(js, config.ledger_stream)
    summary = audit(records, expected).summary()
    assert {k: summary[k] for k in CLEAN} == CLEAN, summary
    assert summary["processed"] == len(expected), summary
    assert {r.member for r in records} == {"m-0", "m-1", "m-2"}
    starts = sorted(r.started for r in records)
    elapsed = starts[-1] - starts[0]
    rate = (len(starts) - 1) / elapsed
    assert rate <= LIMIT * 1.05, f"{rate:.1f} messages/s over {elapsed:.1f} s"
    assert elapsed <= 45, f"{rate:.1f} messages/s over {elapsed:.1f} s"
    busiest = busiest_second(starts)
    assert busiest <= LIMIT * 1.25, f"{busiest} messages in one second"
    for name in ("m-0", "m-1", "m-2"):
        log = fleet.members[name].log_text()
        assert "Traceback" not in log, log[-3000:]


async def test_partitions_waiting_for_a_low_limit_are_not_reported_stalled(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """A limit so low that each partition runs a message less often than stallAfter:
    one member, 2 partitions, 0.25 messages/s (one every 8 s per partition), stall after
    2 s, and more backlog per partition than it holds (so its pulls stop too: nothing
    moves on it between its turns). Its partitions wait for the limit, not on something
    stuck: none is reported stalled (moving it would only move the wait), and what runs
    runs once each, in order."""
    config = make_config(handler=HANDLER, partitions=2, max_messages_per_second=0.25, stall_after=2)
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=2)
    env = config_env(config, (*SETTINGS, "stall_after"))
    fleet.start("m-0", **env)
    await wait_for_status(etcd, config.namespace, config.group, 2, settled({"m-0"}), 60)
    # One project per partition, 150 messages each: more than a partition holds (64).
    projects = [f"slow-{i}" for i in range(200)]
    by_partition = {partition_for(p, 2): p for p in projects}
    assert len(by_partition) == 2
    items = [
        Outgoing(project, b"x", f"{project}-{i}", {SEQ_HEADER: str(i)})
        for i in range(150)
        for project in by_partition.values()
    ]
    await Producer(js, config.subject_prefix, 2).publish_many(items)
    # Three stall periods and more, each partition between its turns for 8 s.
    await asyncio.sleep(10)
    log = fleet.members["m-0"].log_text()
    assert "is stalled" not in log, log[-3000:]
    records = await read_ledger(js, config.ledger_stream)
    # At most what the limit allowed (10 s at 0.25/s, plus the one-token burst).
    assert 1 <= len(records) <= 4, len(records)
    result = audit(records, [r.message_id for r in records])
    assert {k: result.summary()[k] for k in CLEAN} == CLEAN, result.summary()
