"""The leader (shoal.consumer.election) on a real etcd, with a stand-in for the membership
(a lease granted here, always safe) so that each test drives one situation exactly."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import etcd3
import pytest

from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.election import Election, GenerationRecord
from shoal.group.config import GroupConfig
from shoal.group.view import GroupView

pytestmark = pytest.mark.timeout(60)


class SafeMembership:
    """What the leader reads of a Membership: a live lease, never fenced, not leaving."""

    def __init__(self, lease_id: int) -> None:
        self.lease_id = lease_id
        self.leaving = False
        self.changed = asyncio.Event()

    def safe(self) -> bool:
        return True


@contextlib.asynccontextmanager
async def watching(etcd: Etcd, config: GroupConfig) -> AsyncIterator[GroupView]:
    """A view of the group, watching until the block ends (and the group's keys removed)."""
    view = GroupView(etcd, config.keys, config.partitions)
    task = asyncio.create_task(view.run())
    try:
        async with asyncio.timeout(10):
            await view.synced.wait()
        yield view
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await etcd.delete_prefix(config.keys.prefix)


async def caught_up(view: GroupView, revision: int) -> None:
    while view.revision < revision:
        await view.changed(0.5)


async def stop(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def config_for(group: str, namespace: str, **overrides: Any) -> GroupConfig:
    return GroupConfig(
        namespace=namespace, group=group, partitions=8, member_id="a", debounce=0.05, **overrides
    )


async def test_a_write_retry_that_finds_nothing_to_change_clears_the_failure(
    etcd: Etcd, group: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24, defect 10a: the assignment write committed but its answer was lost (an
    etcd time-out), so the leader flagged it failed and retried; the retry found nothing
    to change and returned without clearing the flag. The leader then treated every later
    round as its first (no load checks; the next join was logged as a fail-over, and
    analytics counted it so)."""
    config = config_for(group, namespace)
    lease = await etcd.grant_lease(30)
    records: list[GenerationRecord] = []

    async def on_generation(record: GenerationRecord) -> None:
        records.append(record)

    real = etcd.guarded_put_many
    lost: list[bool] = []

    async def commit_then_time_out(*args: Any, **kwargs: Any) -> bool:
        ok = await real(*args, **kwargs)
        if not lost:
            lost.append(True)
            raise etcd3.exceptions.ConnectionTimeoutError()
        return ok

    monkeypatch.setattr(etcd, "guarded_put_many", commit_then_time_out)
    try:
        async with watching(etcd, config) as view:
            for member in ("a", "b"):
                await etcd.put(config.keys.member(member), b"{}", lease)
            membership = SafeMembership(lease)
            leader = Election(etcd, view, membership, config, on_generation=on_generation)  # type: ignore[arg-type]
            task = asyncio.create_task(leader.run())
            try:
                # The first write "failed"; its retry (1 s later) finds the targets
                # already written, and so nothing to change.
                async def retried() -> bool:
                    return bool(lost) and not leader._write_failed

                await eventually_async(
                    retried, 5, "a retry with nothing to change to clear the failed write"
                )
                await etcd.put(config.keys.member("c"), b"{}", lease)
                while not records:
                    await view.changed(0.5)
            finally:
                await stop(task)
        assert [r.reason for r in records] == ["join"], records
        assert records[0].members == ["a", "b", "c"]
    finally:
        await etcd.revoke_lease(lease)


async def test_leading_stops_waiting_when_the_new_leader_key_vanished(
    etcd: Etcd, group: str, namespace: str
) -> None:
    """Issue 24, defect 10b: _lead waits until the view shows our new leader key. When the
    key was gone before that (its lease expired, or it was deleted), the view never shows
    it, and the wait never ended: this member neither led nor campaigned again."""
    config = config_for(group, namespace)
    lease = await etcd.grant_lease(30)
    try:
        async with watching(etcd, config) as view:
            epoch = await etcd.create_returning_revision(config.keys.leader, b"a", lease)
            assert epoch is not None
            await etcd.delete(config.keys.leader)
            await caught_up(view, epoch + 1)
            leader = Election(etcd, view, SafeMembership(lease), config)  # type: ignore[arg-type]
            leader.epoch = epoch
            async with asyncio.timeout(5):
                await leader._lead()
            assert not leader.is_leader
            # Back in run(), it campaigns again, and leads under a new epoch.
            task = asyncio.create_task(leader.run())
            try:
                while not leader.is_leader:
                    await view.changed(0.5)
                assert leader.epoch > epoch
            finally:
                await stop(task)
    finally:
        await etcd.revoke_lease(lease)


async def test_leading_stops_waiting_for_a_view_that_does_not_catch_up(
    etcd: Etcd, group: str, namespace: str
) -> None:
    """Issue 24, defect 10b, bounded: a view that stays behind (a silent watch) never
    shows the key; after a lease TTL _lead returns, and run() decides again from the view
    (it leads again once the view shows the key as ours)."""
    config = config_for(group, namespace, lease_ttl=2, keepalive_interval=0.5, fence_margin=1)
    lease = await etcd.grant_lease(30)
    try:
        async with watching(etcd, config) as live:
            frozen = GroupView(etcd, config.keys, config.partitions)
            frozen.load(*await etcd.get_prefix(config.keys.prefix))  # listed, never watching
            epoch = await etcd.create_returning_revision(config.keys.leader, b"a", lease)
            assert epoch is not None
            await caught_up(live, epoch)
            leader = Election(etcd, frozen, SafeMembership(lease), config)  # type: ignore[arg-type]
            leader.epoch = epoch
            async with asyncio.timeout(10):
                await leader._lead()
            assert not leader.is_leader
    finally:
        await etcd.revoke_lease(lease)
