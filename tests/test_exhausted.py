"""The leader's max-deliveries listener (shoal.consumer.deadletter.ExhaustedMessages) on a
real nats-server: a durable JetStream limits gives up on a message once, says so once, and
never delivers it again, so the listener's sweep must not give up either."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import nats
import pytest

from harness.servers import NatsServer
from harness.waiting import eventually_async
from shoal.consumer.deadletter import ExhaustedMessages, advisory_subject
from shoal.consumer.producer import Producer
from shoal.contracts.names import DEAD_LETTER_REASON_HEADER, PROJECT_HEADER, partition_for
from shoal.group.config import GroupConfig
from shoal.group.jetstream import consumer_config, ensure_group


class Leading:
    is_leader = True


async def quiet(exc: Exception) -> None:
    """Reconnection attempts while the server is down are expected here."""


async def messages(js: Any, stream: str) -> int:
    return int((await js.stream_info(stream)).state.messages)


class Setup:
    """A group of 4 partitions on its own nats-server, whose partition 1 durable someone
    made by hand: JetStream limits its deliveries to 1 (Shoal's own durables leave that
    to the members) and keeps its state on disk; the listener runs as if leading."""

    def __init__(self, server: NatsServer, group: str, namespace: str) -> None:
        self.server = server
        self.config = GroupConfig(
            group=group,
            namespace=namespace,
            nats_url=server.url,
            etcd_endpoints="127.0.0.1:1",  # unused: the listener needs NATS only
            partitions=4,
            ack_wait=1.0,
            max_deliver=1,
        )
        self.project = next(f"p{i}" for i in range(100) if partition_for(f"p{i}", 4) == 1)
        self.advisories: asyncio.Queue[Any] = asyncio.Queue()

    async def __aenter__(self) -> Setup:
        self.nc = await nats.connect(
            self.server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2, error_cb=quiet
        )
        self.js = self.nc.jetstream()
        await ensure_group(self.js, self.config)
        await self.js.delete_consumer(self.config.stream, "p1")
        limited = consumer_config(self.config, 1)
        limited.max_deliver = 1
        limited.mem_storage = None
        await self.js.add_consumer(self.config.stream, limited)
        self.exhausted = ExhaustedMessages(self.config, self.nc, self.js, Leading())
        self.listener = asyncio.create_task(self.exhausted.run())
        await self.nc.subscribe(advisory_subject(self.config.stream), cb=self.advisories.put)
        await self.nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.listener.cancel()
        await asyncio.gather(self.listener, return_exceptions=True)
        await self.nc.close()

    async def deliver_once(self) -> Any:
        """Publish to partition 1 and take its only delivery, unanswered, until JetStream
        announces that it gave up on it."""
        producer = Producer(self.js, self.config.subject_prefix, 4)
        await producer.publish(self.project, b"stuck", message_id="s-1")
        pull = await self.js.pull_subscribe_bind("p1", stream=self.config.stream)
        [delivered] = await pull.fetch(1, timeout=5)
        assert delivered.data == b"stuck"
        async with asyncio.timeout(15):
            await self.advisories.get()
        return delivered


async def test_a_message_jetstream_gave_up_on_is_dead_lettered_across_a_server_restart(
    tmp_path: Path, group: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server goes down between the advisory and the sweep, for longer than a
    request's timeout: the sweep's read fails, and it tries again until the server is
    back. (Before, it took any failure to read the message for "acked after all" and
    returned: the message stayed in the work-queue stream for good, delivered to nobody.)"""
    server = NatsServer(tmp_path / "nats").start()
    try:
        async with Setup(server, group, namespace) as setup:
            await setup.deliver_once()
            caplog.set_level(logging.WARNING, logger="shoal.consumer.deadletter")
            server.stop()  # before the sweep's read (ack_wait after the advisory)
            await asyncio.sleep(8)  # past the read's 5 s timeout
            server.start()

            js, config = setup.js, setup.config
            await eventually_async(
                lambda: messages(js, config.dlq_stream),
                45,
                "the message dead-lettered",
                until=lambda n: n == 1,
                retry_on=(Exception,),
            )
            assert await messages(js, config.stream) == 0
            info = await js.stream_info(config.dlq_stream)
            letter = await js.get_msg(config.dlq_stream, info.state.first_seq)
            assert letter.data == b"stuck"
            headers = letter.headers or {}
            assert headers[PROJECT_HEADER] == setup.project
            reason = headers[DEAD_LETTER_REASON_HEADER]
            assert "JetStream stopped delivering it" in reason
            assert setup.exhausted.dead_lettered == 1
            assert "Could not read message" in caplog.text  # and said why it waited
    finally:
        server.stop()


async def test_a_late_ack_settles_what_jetstream_gave_up_on(
    tmp_path: Path, group: str, namespace: str
) -> None:
    """Acked after the advisory, within the sweep's grace (ack_wait): the work queue drops
    the message, and the sweep, finding it gone, dead-letters nothing."""
    server = NatsServer(tmp_path / "nats").start()
    try:
        async with Setup(server, group, namespace) as setup:
            delivered = await setup.deliver_once()
            await delivered.ack_sync()
            await asyncio.sleep(setup.config.ack_wait + 1.5)  # the sweep has looked
            assert await messages(setup.js, setup.config.stream) == 0
            assert await messages(setup.js, setup.config.dlq_stream) == 0
            assert setup.exhausted.dead_lettered == 0
            assert not setup.exhausted._pending  # the sweep ended
    finally:
        server.stop()
