"""shoal.clients.nats.round_trip on a real nats-server, through a proxy that goes silent:
a round trip that timed out, answered late after the network heals, must leave the
connection reading. (The member used nc.flush() before releasing a partition; nats-py's
read loop dies on the late PONG of a flush that timed out, and a member whose NATS went
quiet for a few seconds just as it handed partitions over then read nothing more, its
NATS "unreachable", until nats-py's ping check reconnected it minutes later.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from harness.proxy import TcpProxy
from harness.waiting import eventually_async
from shoal.clients.nats import NatsHealth, connect, reader_ended, round_trip


async def test_a_round_trip_answered_late_leaves_the_connection_reading(nats_url: str) -> None:
    with TcpProxy(nats_url.removeprefix("nats://"), name="nats") as proxy:
        nc: Any = await connect(f"nats://{proxy.address}", name="round-trip", attempts=5)
        try:
            await round_trip(nc, 2.0)  # answered: returns
            got: asyncio.Queue[bytes] = asyncio.Queue()

            async def on_message(msg: Any) -> None:
                await got.put(msg.data)

            await nc.subscribe("round-trip.check", cb=on_message)
            proxy.blackhole()
            with pytest.raises(Exception):  # noqa: B017  (nats-py's timeout types vary)
                await round_trip(nc, 1.0)
            proxy.pass_through()  # the late answer arrives now
            await asyncio.sleep(0.5)
            assert not nc._reading_task.done(), "the read loop died"
            await round_trip(nc, 2.0)
            await nc.publish("round-trip.check", b"still reading")
            async with asyncio.timeout(5):
                assert await got.get() == b"still reading"
        finally:
            await nc.close()


async def test_a_read_loop_that_ended_is_started_again(nats_url: str) -> None:
    """nats-py ends its read loop on any unexpected exception while parsing, and does
    nothing else: the connection stays "connected", writes, and reads nothing until its
    ping check gives up on it (4 minutes by default). The member's NATS health check
    notices and reconnects, which starts a new read loop and makes every subscription
    again. Here the parser raises once, for a message of a subscription."""
    nc: Any = await connect(nats_url, name="read-loop", attempts=5)
    health = NatsHealth(nc, interval=0.2, grace=1.0)
    task = asyncio.create_task(health.run())
    try:
        got: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_message(msg: Any) -> None:
            await got.put(msg.data)

        await nc.subscribe("read-loop.check", cb=on_message)
        parse = nc._ps.parse
        broken: list[bool] = []

        async def parse_once_broken(data: bytes = b"") -> None:
            if not broken and b"read-loop.check" in data:
                broken.append(True)
                raise RuntimeError("a parser bug")
            await parse(data)

        nc._ps.parse = parse_once_broken
        await nc.publish("read-loop.check", b"the parser breaks on this")
        await eventually_async(lambda: _ended(nc), 5, "the read loop to end", until=bool)

        async def received() -> bytes:
            # Core NATS is at most once: what reached the dead reader is lost, so ask again.
            await nc.publish("read-loop.check", b"still reading")
            async with asyncio.timeout(0.5):
                return await got.get()

        message = await eventually_async(
            received, 15, "a message read again", retry_on=(TimeoutError,)
        )
        assert message == b"still reading"
        await round_trip(nc, 2.0)
        assert health.read_loop_restarts == 1
        assert not reader_ended(nc)
    finally:
        await stop_task(task)
        await nc.close()


async def _ended(nc: Any) -> bool:
    return bool(nc._reading_task.done())


async def stop_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
