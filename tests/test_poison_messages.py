"""Messages no handler can settle the usual way never stop their project, on real servers.

A review found messages whose dead letter could never be written, each retried for good
while the project's later messages waited (or the member crash-looped): the header
JetStream's publish controls leave (Nats-Expected-Stream, from `js.publish(stream=...)`
or nats.go's ExpectStream: the dead-letter stream checked it again and refused the
copy), a message near max_payload (the dead letter's headers took it past the limit: the
server closed the connection, the member restarted and met it again), one near the 64 KiB
header limit; handlers raising what is no Exception (GeneratorExit ran 26,000 times in 5
s, SystemExit ended the member's lane), or an exception whose repr raises; and a message
refused at arrival (no project id) whose one try to dead-letter it failed: it came back
every ack_wait, for good, without a word. In-process members (harness.inprocess).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from harness.inprocess import Member, assign, until
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.clients.nats import connect
from shoal.consumer.handlers import HandlerUnreachable, PermanentError
from shoal.consumer.worker import SETTLE_RETRY_MAX
from shoal.contracts.names import (
    DEAD_LETTER_CUT_HEADER,
    DEAD_LETTER_REASON_HEADER,
    ORIGINAL_HEADERS_HEADER,
    PROJECT_HEADER,
    partition_subject,
)
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group

pytestmark = pytest.mark.e2e


async def letters(js: Any, config: GroupConfig, count: int, timeout: float = 20) -> list[Any]:
    """The first `count` dead letters of the group, once there are that many."""

    async def stored() -> int:
        return int((await js.stream_info(config.dlq_stream)).state.messages)

    await eventually_async(stored, timeout, f"{count} dead letters", until=lambda n: n >= count)
    return [await js.get_msg(config.dlq_stream, seq) for seq in range(1, count + 1)]


class Odd(Exception):
    def __repr__(self) -> str:
        raise ValueError("no repr for you")

    def __str__(self) -> str:
        raise ValueError("no str either")


@pytest.mark.timeout(90)
async def test_messages_near_the_servers_limits_are_dead_lettered_and_the_project_goes_on(
    etcd: Etcd, nats_url: str, group: str
) -> None:
    config = GroupConfig(group=group, namespace="test", member_id="m-0", partitions=1, ledger=False)
    admin = await connect(nats_url, name="admin")
    js = admin.jetstream()
    await ensure_group(js, config)
    handled: list[bytes] = []

    async def handler(msg: Any) -> None:
        if msg.data != b"ok":
            raise PermanentError("not for us")
        handled.append(msg.data)

    member = Member(config, etcd, handler)
    subject = partition_subject(config.subject_prefix, 0)
    try:
        await assign(etcd, config, "m-0", 1)
        await member.start(nats_url)
        limit = member.nc.max_payload
        # (Fresh headers each time: js.publish(stream=...) adds to the dict it is given.)
        await js.publish(subject, b"controls", headers={PROJECT_HEADER: "X"}, stream=config.stream)
        await js.publish(subject, b"b" * (limit - 200), headers={PROJECT_HEADER: "X"})
        # Within the 64 KiB of headers JetStream takes, not with the dead letter's own.
        await js.publish(subject, b"h", headers={PROJECT_HEADER: "X", "X-Big": "v" * 65_440})
        await js.publish(subject, b"ok", headers={PROJECT_HEADER: "X"})
        await until(lambda: handled == [b"ok"], 30, "the project's next message")
        found = await letters(js, config, 3)
        assert member.nc.is_connected  # never closed by the server
        controls, big, wide = (letter.headers or {} for letter in found)
        assert json.loads(controls[ORIGINAL_HEADERS_HEADER]) == {
            "Nats-Expected-Stream": config.stream
        }
        assert "permanent error: not for us" in controls[DEAD_LETTER_REASON_HEADER]
        assert "the data" in big[DEAD_LETTER_CUT_HEADER] and found[1].data.startswith(b"bbb")
        assert ORIGINAL_HEADERS_HEADER not in big
        assert "X-Big" in wide[DEAD_LETTER_CUT_HEADER] and found[2].data == b"h"
    finally:
        await member.close()
        await admin.close()


@pytest.mark.timeout(90)
async def test_a_handler_raising_what_is_no_exception_fails_an_attempt(
    etcd: Etcd, nats_url: str, group: str
) -> None:
    config = GroupConfig(
        group=group,
        namespace="test",
        member_id="m-0",
        partitions=1,
        ledger=False,
        max_deliver=2,
        backoff=(0.1,),
    )
    admin = await connect(nats_url, name="admin")
    js = admin.jetstream()
    await ensure_group(js, config)
    runs: dict[bytes, int] = {}
    raised: dict[bytes, BaseException] = {
        b"gen": GeneratorExit(),
        b"exit": SystemExit(3),
        b"interrupt": KeyboardInterrupt(),
        b"odd": Odd(),
        # Only the HTTP handler, which probes its service, may say "never reached": from
        # a Python handler the message waited for good, without a word.
        b"unreachable": HandlerUnreachable("from a Python handler"),
    }

    async def handler(msg: Any) -> None:
        runs[msg.data] = runs.get(msg.data, 0) + 1
        if msg.data in raised:
            raise raised[msg.data]

    member = Member(config, etcd, handler)
    subject = partition_subject(config.subject_prefix, 0)
    try:
        await assign(etcd, config, "m-0", 1)
        await member.start(nats_url)
        for data in [*raised, b"ok"]:
            await js.publish(subject, data, headers={PROJECT_HEADER: "X"})
        await until(lambda: b"ok" in runs, 30, "the project's next message")
        found = await letters(js, config, 5)
        reasons = [letter.headers[DEAD_LETTER_REASON_HEADER] for letter in found]
        assert "GeneratorExit" in reasons[0] and "SystemExit(3)" in reasons[1]
        assert "KeyboardInterrupt" in reasons[2] and "Odd (its repr failed)" in reasons[3]
        assert "HandlerUnreachable('from a Python handler')" in reasons[4]
        assert all(runs[data] == 2 for data in raised), runs  # maxDeliver, no more
    finally:
        await member.close()
        await admin.close()


@pytest.mark.timeout(90)
async def test_a_refused_message_is_dead_lettered_once_the_dead_letter_stream_is_back(
    etcd: Etcd, nats_url: str, group: str
) -> None:
    """No project id: refused at arrival and dead-lettered by the runner, not a handler.
    A try that failed was tried again only at the message's next delivery, an ack_wait
    later, without a word; one that always failed (its Nats-Expected-Stream header
    refused by the dead-letter stream) came back every ack_wait for good. Retried with
    a backoff now, each message once: its later deliveries (nothing keeps it alive
    meanwhile) had each started a loop of their own, and each wrote a copy (4 here)."""
    config = GroupConfig(
        group=group, namespace="test", member_id="m-0", partitions=1, ledger=False, ack_wait=2
    )
    admin = await connect(nats_url, name="admin")
    js = admin.jetstream()
    await ensure_group(js, config)

    async def handler(msg: Any) -> None:
        pass

    member = Member(config, etcd, handler)
    try:
        await assign(etcd, config, "m-0", 1)
        await member.start(nats_url)
        await until(lambda: 0 in member.worker.runners, 10, "the runner")
        await js.delete_stream(config.dlq_stream)
        await js.publish(partition_subject(config.subject_prefix, 0), b"who am I")
        # Longer than ack_wait: delivered again meanwhile (nothing keeps it alive).
        await asyncio.sleep(2.5 * config.ack_wait)
        await ensure_group(js, config)  # the dead-letter stream is back
        await js.publish(
            partition_subject(config.subject_prefix, 0), b"nor I", stream=config.stream
        )
        found = {letter.data: letter.headers for letter in await letters(js, config, 2, 30)}
        await asyncio.sleep(SETTLE_RETRY_MAX + 2)  # any other copy would be written by now
        # One copy each: every delivery of the first had started a loop writing its own.
        assert int((await js.stream_info(config.dlq_stream)).state.messages) == 2
        assert "Shoal-Project-Id" in found[b"who am I"][DEAD_LETTER_REASON_HEADER]
        assert "Nats-Expected-Stream" in found[b"nor I"][ORIGINAL_HEADERS_HEADER]
        info = await js.stream_info(config.stream)
        assert int(info.state.messages) == 0  # terminated: gone from the work queue
    finally:
        await member.close()
        await admin.close()
