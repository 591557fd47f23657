"""Membership against a real etcd: the member key never outlives leave()."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from shoal.clients.etcd import Etcd
from shoal.consumer.membership import Membership
from shoal.contracts.values import MemberStats
from shoal.group.config import GroupConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


class SlowWrites(Etcd):
    """A real etcd client whose writes of one key wait `delay` before they go out, as
    a put queued behind a busy thread pool or a slow network would.

    Only the timing is changed: every call still reaches the real server.
    """

    def __init__(self, endpoint: str, key: str) -> None:
        super().__init__(endpoint)
        self.key = key
        self.delay = 0.0
        self.delayed = asyncio.Event()  # set when a delayed write has started waiting

    async def _slow(self, key: str | None) -> None:
        if self.delay and key == self.key:
            self.delayed.set()
            await asyncio.sleep(self.delay)

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        await self._slow(key)
        await super().put(key, value, lease)

    async def _transaction(
        self, *, compare: list[Any], success: list[Any], failure: list[Any]
    ) -> tuple[bool, list[Any]]:
        for op in success:
            await self._slow(getattr(op, "key", None))
        return await super()._transaction(compare=compare, success=success, failure=failure)


async def test_a_stats_put_in_flight_never_recreates_the_key_after_leave(
    make_config: Callable[..., GroupConfig], etcd: Etcd
) -> None:
    config = make_config(member_id="m-slow", lease_ttl=5, keepalive_interval=0.3)
    key = config.keys.member(config.member_id)
    client = SlowWrites(config.etcd_endpoints, key)
    await client.connect(attempts=10)
    membership = Membership(client, config, lambda: MemberStats(ts=time.time()))
    runner: asyncio.Task[None] | None = None
    try:
        await membership.join()
        runner = asyncio.create_task(membership.run())
        # The next stats put waits 1 s before it goes out; leave while it waits.
        client.delay = 1.0
        async with asyncio.timeout(5):
            await client.delayed.wait()
        await membership.leave()
        client.delay = 0.0
        # Longer than the delayed put and a few more keep-alive rounds.
        await asyncio.sleep(2.0)
        _, kvs = await etcd.get_prefix(key)
        assert key not in kvs, "a stats put re-created the member key after leave()"
        assert membership.safe(), "the lease must stay alive (kept alive) until close()"
    finally:
        if runner is not None:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        await membership.close()
        client.close()
        await etcd.delete_prefix(config.keys.prefix)


async def test_a_member_key_deleted_under_a_live_member_comes_back(
    make_config: Callable[..., GroupConfig], etcd: Etcd
) -> None:
    config = make_config(member_id="m-back", lease_ttl=5, keepalive_interval=0.3)
    key = config.keys.member(config.member_id)
    membership = Membership(etcd, config, lambda: MemberStats(ts=time.time()))
    runner: asyncio.Task[None] | None = None
    try:
        await membership.join()
        runner = asyncio.create_task(membership.run())
        await etcd.delete(key)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            _, kvs = await etcd.get_prefix(key)
            if key in kvs:
                assert kvs[key].lease == membership.lease_id
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the member key was not registered again")
    finally:
        if runner is not None:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        await membership.close()
        await etcd.delete_prefix(config.keys.prefix)


async def test_leaving_with_a_lease_that_expired_already_is_a_clean_exit(
    make_config: Callable[..., GroupConfig], etcd: Etcd
) -> None:
    """A member whose lease expired while it shut down (its keep-alive stopped with its
    other tasks, a slow host) has nothing left to revoke: close() says so and returns.
    It raised etcd's NOT_FOUND, and the pod exited 1 after a clean hand-over (seen in
    the fault suite's rolling restart on a busy host)."""
    config = make_config(member_id="m-expired", lease_ttl=3, keepalive_interval=0.5, fence_margin=1)
    membership = Membership(etcd, config, lambda: MemberStats(ts=time.time()))
    await membership.join()
    lease = membership.lease_id
    await etcd.revoke_lease(lease)  # gone, as an expiry would leave it
    await membership.close()
    assert membership.lease_id == 0
