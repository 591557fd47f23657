"""Members' routine stats reach the leader only (Keys.stats), against a real etcd.

In a group of 64 every member received every member's stats rewrite (10 a second, each
costing the receiver half a millisecond in gRPC's and the watcher's threads): most of an
idle member's CPU. Now no member's watch carries them; the leader polls them, and every
member still sees at once what anyone acts on (nats_ok, stalled, paused), which goes to
members/<id> as well.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from shoal.clients.etcd import Etcd
from shoal.consumer.membership import Membership
from shoal.contracts.names import Keys
from shoal.contracts.values import MemberStats
from shoal.group import view as view_module
from shoal.group.config import GroupConfig
from shoal.group.view import GroupView

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


class CountingView(GroupView):
    """A real view that counts the watch events it applies, per key."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen: dict[str, int] = {}

    def _count(self, events: list[Any]) -> None:
        for event in events:
            key = event.key.decode()
            self.seen[key] = self.seen.get(key, 0) + 1

    def _apply_events(self, events: list[Any], revision: int) -> None:
        self._count(events)
        super()._apply_events(events, revision)


async def eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


@pytest.fixture
async def running(
    make_config: Callable[..., GroupConfig], etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[GroupConfig, list[asyncio.Task[None]]]]:
    monkeypatch.setattr(view_module, "STATS_POLL_SECONDS", 0.1)
    monkeypatch.setattr(view_module, "STATS_FULL_POLL_EVERY", 3)
    config = make_config(member_id="m-a", lease_ttl=10, keepalive_interval=0.3)
    tasks: list[asyncio.Task[None]] = []
    yield config, tasks
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_only_the_leader_reads_routine_stats_and_no_watch_carries_them(
    running: tuple[GroupConfig, list[asyncio.Task[None]]], etcd: Etcd
) -> None:
    config, tasks = running
    keys: Keys = config.keys
    stats = MemberStats(ts=time.time(), cpu=0.1)
    membership = Membership(etcd, config, lambda: stats)
    await membership.join()
    follower = CountingView(etcd, keys, config.partitions)
    leader = CountingView(etcd, keys, config.partitions)
    tasks += [asyncio.create_task(follower.run()), asyncio.create_task(leader.run())]
    await follower.synced.wait()
    await leader.synced.wait()
    leader.follow_stats(True)
    async with asyncio.timeout(10):
        await leader.stats_synced.wait()

    # The first put writes both keys (nothing deciding was published yet); the rest are
    # routine: a new cpu each time.
    for i in range(6):
        stats = MemberStats(ts=time.time(), cpu=0.2 + i / 100)
        await membership.put_stats_now()
    await eventually(
        lambda: leader.members()["m-a"].cpu == stats.cpu, "the leader sees the last stats"
    )
    member_key, stats_key = keys.member("m-a"), keys.member_stats("m-a")
    for view in (follower, leader):
        assert view.seen.get(stats_key, 0) == 0
        assert view.seen.get(member_key, 0) <= 1  # the first put, which said nats_ok
    assert follower.members()["m-a"].cpu != stats.cpu  # it never read the routine ones

    # A deciding field reaches the follower at once, through members/<id>.
    changed = follower.change_event()
    stats = MemberStats(ts=time.time(), cpu=0.5, nats_ok=False)
    await membership.put_stats_now()
    async with asyncio.timeout(10):
        await changed.wait()
    await eventually(lambda: not follower.members()["m-a"].nats_ok, "the follower sees nats_ok")
    assert follower.members()["m-a"].cpu == 0.5

    # Stopping following drops the routine stats: the member key's copy again.
    leader.follow_stats(False)
    stats = MemberStats(ts=time.time(), cpu=0.7, nats_ok=False)
    await membership.put_stats_now()
    await asyncio.sleep(0.3)
    assert leader.members()["m-a"].cpu == 0.5
    assert not leader.stats_synced.is_set()
    await membership.close()


async def test_the_stats_of_members_gone_are_forgotten(
    running: tuple[GroupConfig, list[asyncio.Task[None]]], etcd: Etcd
) -> None:
    config, tasks = running
    keys: Keys = config.keys
    view = GroupView(etcd, keys, config.partitions)
    tasks.append(asyncio.create_task(view.run()))
    await view.synced.wait()
    view.follow_stats(True)
    gone = keys.member_stats("m-gone")
    await etcd.put(gone, MemberStats(ts=time.time()).to_json())
    await eventually(lambda: gone in view.stats_kvs, "the poll reads a new member's stats")
    # A poll of what changed shows no deletion; the next full one does.
    await etcd.delete(gone)
    await eventually(lambda: gone not in view.stats_kvs, "a full poll forgets them")
    assert "m-gone" not in view.members()  # (never a member: no members/ key)
    view.follow_stats(False)


async def test_a_full_listing_reads_the_newest_stats_and_leave_removes_both_keys(
    running: tuple[GroupConfig, list[asyncio.Task[None]]], etcd: Etcd
) -> None:
    config, _ = running
    keys: Keys = config.keys
    stats = MemberStats(ts=time.time(), cpu=0.1)
    membership = Membership(etcd, config, lambda: stats)
    await membership.join()
    await membership.put_stats_now()
    stats = MemberStats(ts=time.time(), cpu=0.3)
    await membership.put_stats_now()

    # What status and the operator do: one listing of the whole prefix.
    view = GroupView(etcd, keys, config.partitions)
    view.load(*await etcd.get_prefix(keys.prefix))
    assert view.members()["m-a"].cpu == 0.3

    await membership.leave()
    _, left = await etcd.get_prefix(keys.prefix)
    assert keys.member("m-a") not in left and keys.member_stats("m-a") not in left
    await membership.close()


def test_the_routine_stats_sort_after_every_other_key_of_a_group() -> None:
    # Members that do not lead watch the group below Keys.group_end: a key sorting
    # after it would reach none of them.
    keys = Keys("ns", "g")
    others = [
        keys.members,
        keys.leader,
        keys.partitions,
        keys.claims,
        keys.scale,
        keys.handbacks,
        keys.problems,
        keys.paused,
        keys.reset,
        keys.resetting,
        keys.partition(127),
        keys.claim(1023),
        keys.member("zzz"),
        keys.problem("zzz"),
        keys.handback(5),
    ]
    named = {v for v in vars(keys).values() if isinstance(v, str)}
    assert named - {keys.prefix, keys.stats, keys.group_end} <= set(others)
    assert all(key.encode() < keys.group_end.encode() for key in others)
    assert keys.member_stats("a").startswith(keys.group_end)
