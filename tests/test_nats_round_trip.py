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
from shoal.clients.nats import connect, round_trip


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
            assert await asyncio.wait_for(got.get(), 5) == b"still reading"
        finally:
            await nc.close()
