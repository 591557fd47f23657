"""A durable deleted under a running member is recreated where the old one was.

On a `limits` stream acked messages stay, so a durable recreated with "deliver all" would
hand the member the partition's whole history again (restart.py). Real nats-server, etcd
and member processes; the ledger handler records every run of a handler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.audit import message_ids
from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import LedgerRecord, audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER, durable_name, partition_for
from shoal.group.config import GroupConfig, config_env
from shoal.group.jetstream import ensure_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HANDLER = "harness.handlers:scripted_ledger"
PARTITIONS = 8
PARTITION = 3
SETTINGS = ("handler", "partitions", "ledger", "ack_wait", "retention")


def project_of(partition: int) -> str:
    i = 0
    while partition_for(f"project-{i}", PARTITIONS) != partition:
        i += 1
    return f"project-{i}"


def messages(project: str, start: int, count: int, data: bytes = b"") -> list[Outgoing]:
    return [
        Outgoing(project, data, f"{project}-{i}", {SEQ_HEADER: str(i)})
        for i in range(start, start + count)
    ]


async def start_member(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig, more: tuple[str, ...] = ()
) -> None:
    await ensure_group(js, config)
    fleet.start("m-0", **config_env(config, SETTINGS + more))
    await wait_for_status(
        etcd, config.namespace, config.group, config.partitions, settled({"m-0"}), 30
    )


async def ledger_until(js: Any, config: GroupConfig, count: int, what: str) -> list[LedgerRecord]:
    async def records() -> list[LedgerRecord]:
        return await read_ledger(js, config.ledger_stream)

    return await eventually_async(records, 60, what, until=lambda rs: len(rs) >= count)


async def delete_and_wait_recreated(fleet: Fleet, js: Any, config: GroupConfig) -> None:
    await js.delete_consumer(config.stream, durable_name(PARTITION))

    async def recreated() -> bool:
        return f"Recreated the missing durable consumer of partition {PARTITION}" in fleet.logs()

    await eventually_async(recreated, 30, "m-0 to recreate the deleted durable")


@pytest.mark.parametrize("retention", ["limits", "workqueue"])
async def test_a_recreated_durable_does_not_deliver_the_partition_again(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any, retention: str
) -> None:
    """Consumed, idle, durable deleted: the next messages are the only ones handled."""
    config = make_config(handler=HANDLER, partitions=PARTITIONS, retention=retention)
    fleet = make_fleet(handler=HANDLER, partitions=PARTITIONS)
    await start_member(fleet, etcd, js, config)
    project = project_of(PARTITION)
    producer = Producer(js, config.subject_prefix, config.partitions)
    first = messages(project, 0, 40)
    await producer.publish_many(first)
    await ledger_until(js, config, 40, "the first 40 messages to be handled")

    await delete_and_wait_recreated(fleet, js, config)
    second = messages(project, 40, 5)
    await producer.publish_many(second)
    await ledger_until(js, config, 45, "the next 5 messages to be handled")

    async def idle() -> int:
        info = await js.consumer_info(config.stream, durable_name(PARTITION))
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    await eventually_async(
        idle, 30, "the recreated durable to have nothing outstanding", until=lambda n: n == 0
    )
    result = audit(await read_ledger(js, config.ledger_stream), message_ids(first + second))
    summary = result.summary()
    assert (summary["lost"], summary["duplicates"], summary["out_of_order"]) == (0, 0, 0), summary
    assert result.processed == 45
    assert "Traceback" not in fleet.logs()


async def test_a_durable_deleted_while_its_messages_run_loses_none_and_repeats_none(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """Deleted while the member holds and runs the partition's messages (each takes
    50 ms, one project: one at a time): the new durable delivers what the member holds
    again, and the member neither runs those twice nor skips any."""
    config = make_config(handler=HANDLER, partitions=PARTITIONS, retention="limits", ack_wait=3.0)
    fleet = make_fleet(handler=HANDLER, partitions=PARTITIONS)
    await start_member(fleet, etcd, js, config)
    project = project_of(PARTITION)
    items = messages(project, 0, 100, b"wait:50")
    await Producer(js, config.subject_prefix, config.partitions).publish_many(items)
    await ledger_until(js, config, 20, "20 messages to be handled")

    await delete_and_wait_recreated(fleet, js, config)
    records = await ledger_until(js, config, 100, "every message to be handled")

    async def idle() -> int:
        info = await js.consumer_info(config.stream, durable_name(PARTITION))
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    await eventually_async(
        idle, 30, "the recreated durable to have nothing outstanding", until=lambda n: n == 0
    )
    records = await read_ledger(js, config.ledger_stream)
    result = audit(records, message_ids(items))
    summary = result.summary()
    assert (summary["lost"], summary["duplicates"], summary["out_of_order"]) == (0, 0, 0), summary
    assert "Traceback" not in fleet.logs()


async def test_a_durable_missing_at_start_on_a_limits_stream_is_reported(
    js: Any, make_config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Deleted while no member ran, nobody knows where it was: it is created at the
    stream's start (a new group's durables are too), and the log says so and how to
    choose another place."""
    config = make_config(partitions=PARTITIONS, retention="limits")
    assert await ensure_group(js, config) == []  # a new group: all start at the start
    await js.delete_consumer(config.stream, durable_name(PARTITION))
    await js.delete_consumer(config.stream, durable_name(5))
    with caplog.at_level(logging.INFO, logger="shoal.group.jetstream"):
        # (The operator posts a DurablesRecreated Warning for these.)
        assert await ensure_group(js, config) == [PARTITION, 5]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"partitions {PARTITION}, 5 were missing" in warnings[0]
    assert "shoal-consumer reset" in warnings[0]
    info = await js.consumer_info(config.stream, durable_name(PARTITION))
    assert info.config.deliver_policy == "all"


async def test_a_held_message_naked_after_the_recreate_is_taken_when_it_comes_again(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any, tmp_path: Path
) -> None:
    """Held when the durable was recreated, then failed and naked (NakAndContinue): its
    delivery by the new durable must be taken, not ignored as one of those held then."""
    config = make_config(
        handler=HANDLER,
        partitions=PARTITIONS,
        retention="limits",
        retry_policy="NakAndContinue",
        ack_wait=3.0,
    )
    fleet = make_fleet(
        handler=HANDLER, partitions=PARTITIONS, env={"SHOAL_TEST_STATE_DIR": str(tmp_path)}
    )
    await start_member(fleet, etcd, js, config, ("retry_policy",))
    project = project_of(PARTITION)
    items = messages(project, 0, 1, b"wait:4000") + messages(project, 1, 1, b"fail-runs:1")
    await Producer(js, config.subject_prefix, config.partitions).publish_many(items)

    async def running() -> int:
        info = await js.consumer_info(config.stream, durable_name(PARTITION))
        return int(info.num_ack_pending or 0)

    await eventually_async(running, 10, "m-0 to hold both", until=lambda n: n == 2)
    await delete_and_wait_recreated(fleet, js, config)
    records = await ledger_until(js, config, 2, "both messages to be handled")
    result = audit(records, message_ids(items))
    summary = result.summary()
    assert (summary["lost"], summary["duplicates"], summary["out_of_order"]) == (0, 0, 0), summary


async def test_ack_wait_lowered_under_a_running_member_runs_nothing_twice(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """The spec's ackWaitSeconds goes from 20 to 2: the operator updates the durables at
    once, the pods roll later, and meanwhile the running member keeps what it holds
    alive at its old pace (every 5 s). JetStream sends each message held longer than 2 s
    again, to the same member. Before, its runner took the copy for a new message and
    the handler ran it twice (4 of 12 here); now the copy replaces the delivery held."""
    import asyncio

    config = make_config(handler=HANDLER, partitions=PARTITIONS, ack_wait=20.0)
    fleet = make_fleet(handler=HANDLER, partitions=PARTITIONS)
    await start_member(fleet, etcd, js, config)
    project = project_of(PARTITION)
    producer = Producer(js, config.subject_prefix, config.partitions)
    slow = messages(project, 0, 12, b"wait:700")  # 8.4 s of one project, in order
    await producer.publish_many(slow)
    await asyncio.sleep(0.5)
    await ensure_group(js, config.model_copy(update={"ack_wait": 2.0}))
    # Other projects of the partition keep it pulling, as a busy partition does.
    others = [f"other-{i}" for i in range(2000) if partition_for(f"other-{i}", PARTITIONS) == 3]
    trickle = [messages(other, 0, 1)[0] for other in others[:40]]
    for item in trickle:
        await producer.publish_many([item])
        await asyncio.sleep(0.2)
    await ledger_until(js, config, len(slow) + len(trickle), "every message to be handled")
    await asyncio.sleep(3)  # what would run twice, has
    result = audit(await read_ledger(js, config.ledger_stream), message_ids(slow + trickle))
    summary = result.summary()
    assert (summary["lost"], summary["duplicates"], summary["out_of_order"]) == (0, 0, 0), summary
