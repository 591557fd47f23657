"""The leader (shoal.consumer.election) on a real etcd, with a stand-in for the membership
(a lease granted here, always safe) so that each test drives one situation exactly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
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


class FlakyMembership(SafeMembership):
    """A membership the test can fence, as Membership does: safe() turns false and
    `changed` is set (then replaced)."""

    def __init__(self, lease_id: int) -> None:
        super().__init__(lease_id)
        self._safe = True

    def safe(self) -> bool:
        return self._safe

    def set_safe(self, value: bool) -> None:
        self._safe = value
        self.changed.set()
        self.changed = asyncio.Event()


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


async def leading(
    etcd: Etcd, config: GroupConfig, view: GroupView, membership: SafeMembership
) -> tuple[Election, asyncio.Task[None], list[GenerationRecord]]:
    """An Election running on `membership`, once it has written its first generation."""
    records: list[GenerationRecord] = []

    async def on_generation(record: GenerationRecord) -> None:
        records.append(record)

    leader = Election(etcd, view, membership, config, on_generation=on_generation)  # type: ignore[arg-type]
    task = asyncio.create_task(leader.run())
    async with asyncio.timeout(10):
        while not records:
            await view.changed(0.2)
    assert leader.is_leader
    return leader, task, records


async def not_leading(leader: Election, timeout: float, what: str) -> None:
    async def stopped() -> bool:
        return not leader.is_leader

    await eventually_async(stopped, timeout, what, interval=0.05)


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


async def test_a_fenced_leader_waiting_for_scaled_up_members_stops_leading_at_once(
    etcd: Etcd, group: str, namespace: str
) -> None:
    """After a scale-up (expect_scale) a membership change made _lead sit in _settle for
    up to SCALE_JOIN_WAIT (15 s) without looking at the fence: a leader fenced meanwhile
    kept is_leader (autoscaler, dead-letter sweep) past fence_after and even past its
    lease's expiry, when another member may lead already."""
    config = config_for(group, namespace)
    lease = await etcd.grant_lease(60)
    try:
        async with watching(etcd, config) as view:
            for member in ("a", "b"):
                await etcd.put(config.keys.member(member), b"{}", lease)
            membership = FlakyMembership(lease)
            leader, task, _ = await leading(etcd, config, view, membership)
            try:
                # The autoscaler scaled 2 -> 4; the first new member arrives.
                leader.expect_scale(4, time.monotonic() + 120)
                await etcd.put(config.keys.member("c"), b"{}", lease)
                await asyncio.sleep(0.5)  # _lead is in _settle, awaiting the 4th member
                membership.set_safe(False)  # fenced: lease renewal failing
                await not_leading(leader, 2.0, "the fenced leader to stop leading")
            finally:
                await stop(task)
    finally:
        await etcd.revoke_lease(lease)


async def test_a_fence_signalled_while_writing_is_not_missed(
    etcd: Etcd, group: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """_lead took membership.changed only at the bottom of its loop, after the work: a
    fence signalled during the work (an etcd write timing out, as it usually does then)
    set the old event, and the loop waited on the fresh one, up to RECHECK_SECONDS (5 s)
    more before it saw that it was fenced."""
    config = config_for(group, namespace)
    lease = await etcd.grant_lease(60)
    try:
        async with watching(etcd, config) as view:
            for member in ("a", "b"):
                await etcd.put(config.keys.member(member), b"{}", lease)
            membership = FlakyMembership(lease)
            leader, task, _ = await leading(etcd, config, view, membership)
            fenced_at: list[float] = []

            async def fenced() -> bool:
                return bool(fenced_at)

            async def fence_then_time_out(*args: Any, **kwargs: Any) -> bool:
                if not fenced_at:
                    fenced_at.append(time.monotonic())
                    membership.set_safe(False)
                raise etcd3.exceptions.ConnectionTimeoutError()

            monkeypatch.setattr(etcd, "guarded_put_many", fence_then_time_out)
            try:
                await etcd.put(config.keys.member("c"), b"{}", lease)
                await eventually_async(fenced, 10, "the rebalance's write", interval=0.02)
                # _rebalance sleeps 1 s after a failed write; then it should notice.
                left = 2.0 - (time.monotonic() - fenced_at[0])
                await not_leading(leader, left, "the leader fenced while writing to stop")
            finally:
                await stop(task)
    finally:
        await etcd.revoke_lease(lease)


async def test_a_leaving_leader_fenced_for_a_moment_leads_again(
    etcd: Etcd, group: str, namespace: str
) -> None:
    """shutdown(): membership.leave() sets `leaving`; the leader key stays until resign()
    after the drain. A fence blip meanwhile ended _lead; the lease (and the key) survived,
    but run() refused to lead again while leaving, and nobody else can campaign while the
    key exists: no generation was written (a join, the leaver's own partitions) until the
    drain timed out and resign() ran. It leads on its surviving key now, as before."""
    config = config_for(group, namespace)
    lease = await etcd.grant_lease(60)
    try:
        async with watching(etcd, config) as view:
            for member in ("a", "b"):
                await etcd.put(config.keys.member(member), b"{}", lease)
            membership = FlakyMembership(lease)
            leader, task, records = await leading(etcd, config, view, membership)
            try:
                membership.leaving = True  # Membership.leave() began
                membership.set_safe(False)  # a keep-alive blip...
                await not_leading(leader, 10, "the fenced leaver to stop leading")
                membership.set_safe(True)  # ...that the lease survived
                # The leaver's member key goes (leave()), and a member joins.
                await etcd.delete(config.keys.member("a"))
                await etcd.put(config.keys.member("c"), b"{}", lease)

                async def leaver_unassigned() -> bool:
                    # Its record too: the watch may show the write before the leader's
                    # on_generation has recorded it.
                    recorded = records[-1].members == ["b", "c"]
                    return recorded and "a" not in set(view.owners().values())

                # (Before its fix it never came, until the drain's end: a generous bound.)
                await eventually_async(
                    leaver_unassigned, 30, "a generation without the leaver, by the leaver"
                )
                assert records[-1].members == ["b", "c"], records[-1]
            finally:
                await stop(task)
    finally:
        await etcd.revoke_lease(lease)


async def test_a_rebalance_on_a_view_behind_the_last_write_builds_on_that_write(
    etcd: Etcd, group: str, namespace: str
) -> None:
    """The view's watch lags (a loaded etcd or host) by more than the debounce, and a
    second member joins before the leader's write for the first reaches its view. The
    next generation is computed on the one the leader wrote, not the one its view
    shows: before, it reused the generation number and left out the partitions the
    last write had moved, so etcd's assignment stayed unbalanced (one member with two
    more than another) until the next membership change."""
    config = config_for(group, namespace).model_copy(update={"partitions": 16})
    lease = await etcd.grant_lease(60)
    lag = 1.0
    try:
        async with watching(etcd, config) as view:
            for member in ("a", "b"):
                await etcd.put(config.keys.member(member), b"{}", lease)
            _, task, records = await leading(etcd, config, view, SafeMembership(lease))
            try:
                loop = asyncio.get_running_loop()
                on_watch = view._on_watch

                def lagging(response: Any) -> None:  # on the watcher's thread
                    loop.call_soon_threadsafe(loop.call_later, lag, on_watch, response)

                view._on_watch = lagging  # type: ignore[method-assign]
                view._errors.put_nowait(RuntimeError("watch again, lagging"))
                await asyncio.sleep(0.5)
                await etcd.put(config.keys.member("c"), b"{}", lease)
                await asyncio.sleep(lag / 2)
                await etcd.put(config.keys.member("d"), b"{}", lease)

                async def four_members_written() -> list[str]:
                    last = records[-1] if records else None
                    return last.members if last is not None else []

                await eventually_async(
                    four_members_written,
                    10,
                    "a generation for four members",
                    until=lambda members: len(members) == 4,
                )
                await asyncio.sleep(2 * lag)
                _, kvs = await etcd.get_prefix(config.keys.partitions)
                owners = [json.loads(kv.value)["owner"] for kv in kvs.values()]
                counts = {m: owners.count(m) for m in ("a", "b", "c", "d")}
                generations = [r.generation for r in records]
                assert max(counts.values()) - min(counts.values()) <= 1, (counts, generations)
                assert generations == sorted(set(generations)), generations
            finally:
                await stop(task)
    finally:
        await etcd.revoke_lease(lease)
