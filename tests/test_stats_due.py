"""When a member rewrites its stats (Membership._stats_due): what the leader acts on at
once, the rest at a pace that keeps a big group's etcd writes, and the watch events every
member receives, bounded (pure: no etcd is asked)."""

from __future__ import annotations

import pytest

from shoal.consumer.membership import ROUTINE_STATS_WRITES_PER_SECOND, Membership, deciding
from shoal.contracts.values import MemberStats
from shoal.group.config import GroupConfig


def membership(members: int) -> Membership:
    config = GroupConfig(group="g", namespace="ns", nats_url="nats://x:1", etcd_endpoints="e:1")
    m = Membership(None, config, MemberStats, lambda: members)  # type: ignore[arg-type]
    return m


def published(m: Membership, stats: MemberStats, at: float) -> None:
    # What _publish_stats records after a successful put.
    m._published, m._published_at = deciding(stats), at


def test_the_first_stats_are_due_at_once() -> None:
    assert membership(3)._stats_due(MemberStats(), 100.0)


@pytest.mark.parametrize("members", [1, 3, 16, 30])
def test_up_to_thirty_members_each_keepalive_puts_them(members: int) -> None:
    m = membership(members)
    published(m, MemberStats(), 100.0)
    keepalive = m.config.keepalive_interval
    # The loop runs once per keepalive, sometimes a little early: still due.
    assert m._stats_due(MemberStats(lag=5), 100.0 + keepalive - 0.1)
    assert not m._stats_due(MemberStats(lag=5), 100.0 + 1.0)


def test_a_big_group_puts_routine_stats_less_often() -> None:
    m = membership(64)
    published(m, MemberStats(), 100.0)
    every = 64 / ROUTINE_STATS_WRITES_PER_SECOND  # 6.4 s
    assert not m._stats_due(MemberStats(lag=7), 100.0 + 3.0)
    assert not m._stats_due(MemberStats(lag=7), 100.0 + every - 2.0)
    assert m._stats_due(MemberStats(lag=7), 100.0 + every)


@pytest.mark.parametrize(
    "changed",
    [
        MemberStats(nats_ok=False),
        MemberStats(handler_ok=False),
        MemberStats(stalled=(4,)),
        MemberStats(stalled=()),
        # (`shoal-consumer reset` waits for the partitions paused.)
        MemberStats(stalled=(1,), paused=(0, 1)),
    ],
)
def test_what_the_leader_acts_on_is_put_at_the_next_keepalive_whatever_the_size(
    changed: MemberStats,
) -> None:
    m = membership(64)
    before = MemberStats(stalled=(1,))
    published(m, before, 100.0)
    assert m._stats_due(changed, 100.0 + 3.0) == (changed != before)
