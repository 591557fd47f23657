"""A task that is cancelled stops, even when the call it waits on finishes at that moment.

Python 3.11's asyncio.wait_for returns the inner result when a cancellation arrives in
the same loop iteration as that result, and drops the cancellation (CPython gh-86296,
fixed in 3.12 by building wait_for on asyncio.timeout). A loop around such a call (the
member's keep-alive: a refresh in etcd's thread pool every interval) then runs on for
good, "cancelling" but never cancelled: shutdown's gather waited on it forever (the
autoscaler test that hung in clean-clone runs, 3 of 40 runs by hand: its tasks dumped
at `Membership._keep_alive`'s sleep, still cancelling). Shoal uses asyncio.timeout, and
ruff bans asyncio.wait_for (pyproject.toml); nats-py's requests still wait that way, so
the loop around the member's NATS round trip raises a dropped cancellation again, and so
does every request through Shoal's NATS client (tests/test_natsclient.py, on a real
nats-server).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from shoal.clients.nats import NatsHealth
from shoal.consumer.membership import Membership
from shoal.contracts.values import MemberStats
from shoal.group.config import GroupConfig


class RefreshOnCue:
    """An etcd whose lease refresh completes when the test says."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def refresh_lease(self, lease_id: int) -> int:
        self.asked.set()
        return await self.answer

    async def put_all_if_created_at(self, *args: Any) -> bool:
        return True  # the stats written after a renewal


async def test_a_keep_alive_cancelled_as_its_refresh_answers_stops() -> None:
    config = GroupConfig(
        group="g",
        namespace="ns",
        nats_url="nats://x:4222",
        etcd_endpoints="x:2379",
        member_id="m",
        keepalive_interval=0.05,
    )
    etcd = RefreshOnCue()
    membership = Membership(etcd, config, lambda: MemberStats(ts=time.time()))  # type: ignore[arg-type]
    membership.lease_id = 1
    task = asyncio.create_task(membership.run())
    await asyncio.wait([asyncio.create_task(etcd.asked.wait())], timeout=5)
    assert etcd.asked.is_set()
    # The answer and the cancellation in the same loop iteration.
    etcd.answer.set_result(10)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2)
    if not done:
        task.cancel()  # (once more, so that the test's loop can close)
        await asyncio.wait([task], timeout=2)
    assert done, "the keep-alive loop swallowed its cancellation and ran on"
    assert task.cancelled()


class AnswerOnCue:
    """A NATS connection whose request waits as nats-py's does (asyncio.wait_for on the
    answer's future) and is answered when the test says."""

    is_connected = True
    _reading_task = None

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        self.asked.set()
        return await asyncio.wait_for(self.answer, timeout)  # noqa: TID251 (nats-py's way)


async def test_the_nats_health_loop_ends_when_nats_py_drops_its_cancellation() -> None:
    nc = AnswerOnCue()
    health = NatsHealth(nc, interval=5.0)
    task = asyncio.create_task(health.run())
    await asyncio.wait([asyncio.create_task(nc.asked.wait())], timeout=5)
    assert nc.asked.is_set()
    nc.answer.set_result(b"")
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2)
    if not done:
        task.cancel()
        await asyncio.wait([task], timeout=2)
    assert done, "the health loop lost its cancellation in nats-py's request and ran on"
    assert task.cancelled()
