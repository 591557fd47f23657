"""The leader's debounce: full after joins, short when members only left (pure: the
leader is built on a view fed by hand and never runs)."""

from __future__ import annotations

from typing import Any

from shoal.consumer.election import LEAVE_DEBOUNCE, Election
from shoal.group.config import GroupConfig
from shoal.group.view import GroupView

CONFIG = GroupConfig(group="g", namespace="ns", member_id="a", partitions=8, debounce=0.5)


def leader() -> Election:
    view = GroupView(None, CONFIG.keys, CONFIG.partitions)  # type: ignore[arg-type]
    membership: Any = None
    return Election(None, view, membership, CONFIG)  # type: ignore[arg-type]


def test_departures_only_get_the_short_debounce() -> None:
    assert leader()._debounce_for({"a", "b"}, {"a", "b", "c"}) == LEAVE_DEBOUNCE < 0.5


def test_joins_and_first_assignments_get_the_full_debounce() -> None:
    lead = leader()
    assert lead._debounce_for({"a", "b", "c", "d"}, {"a", "b", "c"}) == 0.5  # a join
    assert lead._debounce_for({"a", "b", "d"}, {"a", "b", "c"}) == 0.5  # a leave and a join
    assert lead._debounce_for({"a", "b"}, None) == 0.5  # nothing applied yet
    assert lead._debounce_for({"a", "b"}, {"a", "b"}) == 0.5


def test_a_short_configured_debounce_is_kept() -> None:
    lead = leader()
    lead.config = CONFIG.model_copy(update={"debounce": 0.05})
    assert lead._debounce_for({"a"}, {"a", "b"}) == 0.05
