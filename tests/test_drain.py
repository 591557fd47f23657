"""harness.drain on a real nats-server: an emptied stream is clean, messages a durable
still holds are waited for (and named on timeout), and messages nobody holds are returned
as stranded once the durables have been quiet long enough.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy

from harness.drain import wait_drained
from shoal.contracts.names import MSG_ID_HEADER

pytestmark = pytest.mark.timeout(60)


async def _work_queue(js: Any, group: str) -> tuple[str, str]:
    stream, subjects = f"DRAIN_{group}", f"{group}.*"
    await js.add_stream(name=stream, subjects=[subjects], retention=RetentionPolicy.WORK_QUEUE)
    return stream, subjects


async def _publish(js: Any, subject: str, ids: list[str]) -> None:
    for mid in ids:
        await js.publish(subject, b"x", headers={MSG_ID_HEADER: mid})


async def _durable(js: Any, stream: str, name: str, subject: str) -> None:
    await js.add_consumer(
        stream,
        ConsumerConfig(durable_name=name, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT),
    )


async def test_an_empty_stream_is_clean(js: Any, group: str) -> None:
    stream, subjects = await _work_queue(js, group)
    drained = await wait_drained(js, stream, subjects, 5, stranded_after=1)
    assert drained.clean


async def test_waits_while_a_durable_consumes(js: Any, group: str) -> None:
    stream, subjects = await _work_queue(js, group)
    await _durable(js, stream, "d0", f"{group}.0")
    await _publish(js, f"{group}.0", ["a", "b", "c"])

    async def consume_late() -> None:
        await asyncio.sleep(1.5)  # longer than stranded_after: pending is not "stranded"
        sub = await js.pull_subscribe_bind("d0", stream)
        for msg in await sub.fetch(3, timeout=5):
            await msg.ack_sync()

    consumer = asyncio.create_task(consume_late())
    drained = await wait_drained(js, stream, subjects, 15, stranded_after=0.5)
    await consumer
    assert drained.clean


async def test_times_out_naming_the_durable_holding_messages(js: Any, group: str) -> None:
    stream, subjects = await _work_queue(js, group)
    await _durable(js, stream, "holder", f"{group}.1")
    await _publish(js, f"{group}.1", ["a", "b"])
    with pytest.raises(TimeoutError) as caught:
        await wait_drained(js, stream, subjects, 2, stranded_after=0.5)
    assert "2 messages left" in str(caught.value)
    assert "'holder': {'pending': 2" in str(caught.value)


async def test_messages_no_durable_holds_are_returned_as_stranded(js: Any, group: str) -> None:
    stream, subjects = await _work_queue(js, group)
    # A durable on another subject is quiet: nothing pending for it, nothing unacked.
    await _durable(js, stream, "elsewhere", f"{group}.9")
    await _publish(js, f"{group}.0", ["m1", "m2"])
    await _publish(js, f"{group}.5", ["m3"])
    # A gap of deleted sequences between them must not hide the later ones.
    await _publish(js, f"{group}.7", ["gone"])
    info = await js.stream_info(stream)
    await js.delete_msg(stream, info.state.last_seq)
    await _publish(js, f"{group}.5", ["m4"])

    drained = await wait_drained(js, stream, subjects, 10, stranded_after=0.5)
    assert drained.stranded == {"m1", "m2", "m3", "m4"}
