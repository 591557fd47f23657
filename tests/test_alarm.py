"""The dozing partition's alarm (alarm.py), on a real nats-server."""

from __future__ import annotations

import asyncio

import nats
import pytest

from shoal.consumer.alarm import Alarm

pytestmark = pytest.mark.e2e


async def test_a_ring_calls_one_listener_however_many_sweeps(nats_url: str) -> None:
    """A dozing partition sets its listener again at every safety sweep (partition.py,
    _doze) while the alarm stays armed. Each call once added a callback to the same
    future: an idle member grew for ever, and a ring woke the partition once per sweep
    it had dozed through. Now one ring calls the listener once."""
    nc = await nats.connect(nats_url)
    try:
        alarm = Alarm(nc, "alarm.test.ring")
        await alarm.arm()
        calls = 0

        def woken() -> None:
            nonlocal calls
            calls += 1

        for _ in range(1000):  # 1,000 sweeps: 16 hours at the default 60 s
            alarm.on_ring(woken)
        await nc.publish("alarm.test.ring", b"x")
        await nc.flush()
        for _ in range(100):
            if alarm.rang:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)  # done callbacks run on the loop's next turns
        assert alarm.rang
        assert calls == 1
        await alarm.disarm()
    finally:
        await nc.close()
