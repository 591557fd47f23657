"""A message whose handler ran but whose settling failed is settled later, in order.

Real nats-server, etcd and a member process running harness.handlers:scripted_ledger.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import (
    DEAD_LETTER_REASON_HEADER,
    SEQ_HEADER,
    dlq_subjects,
    partition_for,
)
from shoal.contracts.values import PauseRecord
from shoal.group.config import config_env
from shoal.group.jetstream import ensure_group
from shoal.group.pause import pause_group, resume_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HANDLER = "harness.handlers:scripted_ledger"
PARTITIONS = 4
SETTINGS = ("handler", "partitions", "ledger")


async def processed(js: Any, stream: str) -> set[str]:
    return {r.message_id for r in await read_ledger(js, stream)}


async def test_a_failed_dead_letter_publish_is_retried_and_the_project_goes_on(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """With the group's dead-letter stream deleted, a handler raises PermanentError on
    the second of four messages of one project. The dead-letter publish fails; the
    message keeps its place, its project's later messages wait (order), other projects
    flow, and once the stream is back the message is dead-lettered and the project
    goes on. Before the fix the message was abandoned: its project's later messages
    were never processed while another project's flowed."""
    config = make_config(handler=HANDLER, partitions=PARTITIONS)
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=PARTITIONS)
    fleet.start("m-0", **config_env(config, SETTINGS))
    await wait_for_status(
        etcd, config.namespace, config.group, config.partitions, settled({"m-0"}), 30
    )
    # (After the member started: it creates what is missing when it starts.)
    await js.delete_stream(config.dlq_stream)
    # Both projects on one partition: the stall is per project, not per partition.
    stuck = "stuck-0"
    other = next(
        f"other-{i}"
        for i in range(1000)
        if partition_for(f"other-{i}", PARTITIONS) == partition_for(stuck, PARTITIONS)
    )
    datas = [b"ok", b"permanent", b"ok", b"ok"]
    items = [Outgoing(stuck, d, f"{stuck}-{i}", {SEQ_HEADER: str(i)}) for i, d in enumerate(datas)]
    items += [Outgoing(other, b"ok", f"{other}-{i}", {SEQ_HEADER: str(i)}) for i in range(20)]
    producer = Producer(js, config.subject_prefix, config.partitions)
    await producer.publish_many(items)

    others = {f"{other}-{i}" for i in range(20)}
    await eventually_async(
        lambda: processed(js, config.ledger_stream),
        30,
        "the other project's messages",
        until=lambda done: others | {f"{stuck}-0"} <= done,
    )
    done = await processed(js, config.ledger_stream)
    # In order: nothing of the project runs past the message that is not settled yet.
    assert not done & {f"{stuck}-2", f"{stuck}-3"}, sorted(done)
    await ensure_group(js, config)  # the dead-letter stream is back
    await eventually_async(
        lambda: processed(js, config.ledger_stream),
        30,
        "the project's later messages after the dead-letter stream is back",
        until=lambda done: {f"{stuck}-2", f"{stuck}-3"} <= done,
    )
    sub = await js.pull_subscribe(dlq_subjects(config.subject_prefix)[0], stream=config.dlq_stream)
    try:
        letters = await sub.fetch(10, timeout=5)
    finally:
        await sub.unsubscribe()
    assert len(letters) == 1, [m.headers for m in letters]
    assert "permanent error" in (letters[0].headers or {})[DEAD_LETTER_REASON_HEADER]
    log = fleet.members["m-0"].log_text()
    assert "Could not dead-letter message" in log, log[-3000:]


async def test_a_handler_that_never_returns_is_timed_out_retried_then_dead_lettered(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """handlerTimeoutSeconds: a handler still running after it is cancelled, and the run
    counts as a failed attempt: retried in place with the backoff, dead-lettered after
    maxDeliver. The project's later messages wait for it (order); another project on the
    same partition never pauses, so the partition is not reported stalled. Before, the
    in-progress acks kept such a message alive for ever, its project behind it."""
    config = make_config(
        handler=HANDLER,
        partitions=PARTITIONS,
        handler_timeout=1.5,
        max_deliver=3,
        backoff=(0.5,),
        stall_after=5,
    )
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=PARTITIONS)
    settings = (*SETTINGS, "handler_timeout", "max_deliver", "backoff", "stall_after")
    fleet.start("m-0", **config_env(config, settings))
    await wait_for_status(
        etcd, config.namespace, config.group, config.partitions, settled({"m-0"}), 30
    )
    hung = "hung-0"
    other = next(
        f"other-{i}"
        for i in range(1000)
        if partition_for(f"other-{i}", PARTITIONS) == partition_for(hung, PARTITIONS)
    )
    items = [Outgoing(hung, d, f"{hung}-{i}", {}) for i, d in enumerate([b"hang", b"ok", b"ok"])]
    # 8 s of the other project's work, one message after another.
    items += [Outgoing(other, b"wait:200", f"{other}-{i}", {}) for i in range(40)]
    await Producer(js, config.subject_prefix, config.partitions).publish_many(items)

    ids = {i.message_id for i in items}
    await eventually_async(
        lambda: processed(js, config.ledger_stream),
        60,
        "every message but the hung one",
        until=lambda done: ids - {f"{hung}-0"} <= done,
    )
    records = {r.message_id: r for r in await read_ledger(js, config.ledger_stream)}
    # Order: the hung project's later messages ran only after it was dead-lettered,
    # three timeouts and two backoffs later; the other project's meanwhile.
    others_during = [
        r
        for mid, r in records.items()
        if mid.startswith(other) and r.started < records[f"{hung}-1"].started
    ]
    assert len(others_during) >= 10, len(others_during)
    sub = await js.pull_subscribe(dlq_subjects(config.subject_prefix)[0], stream=config.dlq_stream)
    try:
        letters = await sub.fetch(10, timeout=5)
    finally:
        await sub.unsubscribe()
    assert len(letters) == 1
    reason = (letters[0].headers or {})[DEAD_LETTER_REASON_HEADER]
    assert "failed 3 times" in reason and "handlerTimeoutSeconds" in reason, reason
    log = fleet.members["m-0"].log_text()
    assert log.count("Handler ran past 1.5 s on message") == 3, log[-3000:]
    assert f"project {hung!r}" in log
    assert "is stalled" not in log


async def test_a_handler_raising_cancelled_error_itself_is_a_failure(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """A handler that raises CancelledError although nobody cancelled it (a task of its
    own cancelled under it) fails like any other: retried, then dead-lettered, its
    project goes on. Let through, it ended the dispatch lane that ran it, for good,
    and its project stalled. With max_concurrency 1 the member had no worker left."""
    config = make_config(
        handler=HANDLER, partitions=PARTITIONS, max_concurrency=1, max_deliver=2, backoff=(0.2,)
    )
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=PARTITIONS)
    settings = (*SETTINGS, "max_concurrency", "max_deliver", "backoff")
    fleet.start("m-0", **config_env(config, settings))
    await wait_for_status(
        etcd, config.namespace, config.group, config.partitions, settled({"m-0"}), 30
    )
    items = [Outgoing("c", b"cancelled", "c-0", {}), Outgoing("c", b"ok", "c-1", {})]
    items += [Outgoing(f"o{i}", b"ok", f"o{i}", {}) for i in range(10)]
    await Producer(js, config.subject_prefix, config.partitions).publish_many(items)
    ids = {i.message_id for i in items} - {"c-0"}
    await eventually_async(
        lambda: processed(js, config.ledger_stream),
        30,
        "every message but the one whose handler raised CancelledError",
        until=lambda done: ids <= done,
    )
    assert int((await js.stream_info(config.dlq_stream)).state.messages) == 1
    assert fleet.members["m-0"].alive()


async def test_a_handler_that_turns_its_timeout_into_an_error_leaves_the_lane_working(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """With one dispatch lane and handlerTimeoutSeconds 1: a handler whose cancel (its
    timeout) becomes an ordinary error in its cleanup, then another handler that times
    out. Both are retried, then dead-lettered, and the other projects flow. Before, the
    first left the lane's cancel standing; the second timeout then looked like the
    process stopping and ended the lane for good: with one lane, the member ran
    nothing more (and nothing said why)."""
    config = make_config(
        handler=HANDLER,
        partitions=PARTITIONS,
        max_concurrency=1,
        handler_timeout=1.0,
        max_deliver=2,
        backoff=(0.2,),
    )
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=PARTITIONS)
    settings = (*SETTINGS, "max_concurrency", "handler_timeout", "max_deliver", "backoff")
    fleet.start("m-0", **config_env(config, settings))
    await wait_for_status(
        etcd, config.namespace, config.group, config.partitions, settled({"m-0"}), 30
    )
    producer = Producer(js, config.subject_prefix, config.partitions)
    await producer.publish_many([Outgoing("a", b"hang-then-raise", "a-0", {})])
    await asyncio.sleep(1.5)  # its first run timed out
    await producer.publish_many([Outgoing("b", b"hang", "b-0", {})])
    await asyncio.sleep(1.5)  # and this one's
    items = [Outgoing(f"o{i}", b"ok", f"o{i}", {}) for i in range(10)]
    await producer.publish_many(items)
    ids = {i.message_id for i in items}
    await eventually_async(
        lambda: processed(js, config.ledger_stream),
        30,
        "the other projects' messages",
        until=lambda done: ids <= done,
    )
    await eventually_async(
        lambda: dead_letter_count(js, config.dlq_stream),
        20,
        "both hung messages dead-lettered",
        until=lambda n: n == 2,
    )
    assert fleet.members["m-0"].alive()
    assert "Dispatch lane" not in fleet.members["m-0"].log_text()  # none replaced


async def dead_letter_count(js: Any, stream: str) -> int:
    return int((await js.stream_info(stream)).state.messages)


async def test_a_message_whose_settling_failed_is_not_run_again_after_a_pause(
    make_fleet: Callable[..., Fleet],
    etcd: Etcd,
    js: Any,
    make_config: Any,
    tmp_path: Path,
) -> None:
    """Its handler ran and decided (a permanent error: dead-letter it), but the dead
    letter could not be stored (the stream deleted), so the message waits at the head of
    its project for a retry of just that. The group is paused meanwhile, once the stream
    is back: the member settles it then, instead of giving it back with the unstarted
    messages; given back, it ran again after the resume (a second run of a handler
    whose outcome was already decided)."""
    config = make_config(handler=HANDLER, partitions=PARTITIONS)
    await ensure_group(js, config)
    fleet = make_fleet(
        handler=HANDLER, partitions=PARTITIONS, env={"SHOAL_TEST_STATE_DIR": str(tmp_path)}
    )
    fleet.start("m-0", **config_env(config, SETTINGS))
    await wait_for_status(
        etcd, config.namespace, config.group, config.partitions, settled({"m-0"}), 30
    )
    await js.delete_stream(config.dlq_stream)
    item = Outgoing("decided", b"permanent-runs:5", "decided-0", {SEQ_HEADER: "0"})
    await Producer(js, config.subject_prefix, config.partitions).publish_many([item])
    runs = tmp_path / "decided-0.runs"
    await eventually_async(lambda: asyncio.to_thread(runs.exists), 20, "the handler's run")
    # Its dead letter fails now, then again 0.5, 1.5 and 3.5 s later (then 7.5 s).
    await eventually_async(
        lambda: asyncio.to_thread(fleet.members["m-0"].log_text),
        20,
        "the dead letter to fail",
        until=lambda log: "Could not dead-letter message" in log,
    )
    await asyncio.sleep(4.0)
    await ensure_group(js, config)  # the dead-letter stream is back
    record = PauseRecord(by="test", time=time.time(), source="test", reason="maintenance")
    assert await pause_group(etcd, config.keys, record) is None
    await asyncio.sleep(2.0)
    await resume_group(etcd, config.keys)
    await eventually_async(
        lambda: dead_letter_count(js, config.dlq_stream), 20, "the dead letter", until=bool
    )
    await asyncio.sleep(2.0)  # a redelivery, had it been given back, would have run by now
    assert len(runs.read_text().splitlines()) == 1, "the handler ran again"
    assert await dead_letter_count(js, config.dlq_stream) == 1
