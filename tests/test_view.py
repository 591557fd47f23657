"""GroupView's reading of a listing: what it parses, and that what it caches follows
every change (pure: the view is fed a listing and watch events by hand)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import pytest

from shoal.clients.etcd import KV
from shoal.contracts.names import Keys
from shoal.contracts.values import MemberStats
from shoal.group.view import Claim, GroupView

KEYS = Keys("ns", "g")


def kv(key: str, value: Any, revision: int = 1, lease: int = 0) -> KV:
    data = value if isinstance(value, bytes) else json.dumps(value).encode()
    return KV(key, data, revision, revision, lease)


def target(owner: str, generation: int = 1) -> dict[str, Any]:
    return {"owner": owner, "generation": generation, "epoch": 7, "ts": 1.0}


@dataclass
class PutEvent:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass
class DeleteEvent:
    key: bytes
    mod_revision: int = 0  # the deletion's revision (etcd3's DeleteEvent has it too)


def view_of(*kvs: KV) -> GroupView:
    view = GroupView(None, KEYS, 4)  # type: ignore[arg-type]  # no etcd: fed by hand
    view.load(10, {item.key: item for item in kvs})
    return view


def test_member_ids_are_the_member_keys_whatever_their_values() -> None:
    view = view_of(
        kv(KEYS.member("a"), {"owned": []}),
        kv(KEYS.member("b"), b"not json"),
        kv(KEYS.partition(0), target("a")),
    )
    assert view.member_ids() == {"a", "b"}
    assert set(view.members()) == {"a"}  # members() needs stats it can read


def test_a_member_with_a_broken_stats_field_stays_a_member_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken = {"cpu": "high", "ts": 5.0, "lag": 0, "active_projects": 1, "stalled": [2]}
    view = view_of(kv(KEYS.member("a"), broken, revision=3))
    with caplog.at_level(logging.WARNING, logger="shoal.group.view"):
        first, again = view.members(), view.members()
    # Still eligible for partitions, its stalls still count; the autoscaler skips it.
    assert set(first) == {"a"} and first["a"].stalled == (2,)
    assert first["a"].scaling_problem() == "cpu 'high': Input should be a valid number"
    assert again["a"] is first["a"]  # parsed once per revision
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "cpu 'high'" in logged[0], logged
    # Gone with its key.
    view._apply_events([DeleteEvent(KEYS.member("a").encode(), 4)], 4)
    assert view.members() == {} and view._stats == {}


def test_targets_and_claims_follow_watch_events_and_relists() -> None:
    view = view_of(kv(KEYS.partition(0), target("a")), kv(KEYS.claim(0), b"a", lease=5))
    assert view.owners() == {0: "a"}
    assert view.claims() == {0: Claim("a", 5, 1)}

    # A caller may change what it was given; the view's copy stays as it was.
    view.targets().clear()
    assert view.owners() == {0: "a"}

    view._apply_events(
        [
            PutEvent(KEYS.partition(0).encode(), json.dumps(target("b", 2)).encode(), 1, 11, 0),
            DeleteEvent(KEYS.claim(0).encode()),
        ],
        11,
    )
    assert view.owners() == {0: "b"}
    assert view.generation() == 2
    assert view.claims() == {}

    view.load(12, {KEYS.partition(1): kv(KEYS.partition(1), target("c"))})
    assert view.owners() == {1: "c"}


def test_a_change_parses_again_only_what_it_touched() -> None:
    view = view_of(
        kv(KEYS.member("a"), {"owned": []}),
        kv(KEYS.partition(0), target("a")),
        kv(KEYS.claim(0), b"a", lease=5),
    )
    view.targets(), view.claims()
    targets, claims = view._targets, view._claims

    # A member's stats: neither targets nor claims are read again.
    stats = json.dumps({"owned": [0]}).encode()
    view._apply_events([PutEvent(KEYS.member("a").encode(), stats, 1, 11, 0)], 11)
    assert view._targets is targets and view._claims is claims
    assert view.members() == {"a": MemberStats(owned=(0,))}

    # A target: the claims stay parsed; the targets are read again.
    moved = json.dumps(target("b", 2)).encode()
    view._apply_events([PutEvent(KEYS.partition(0).encode(), moved, 1, 12, 0)], 12)
    assert view._claims is claims
    assert view.owners() == {0: "b"}

    # A claim: the targets stay parsed; the claims are read again.
    targets = view._targets
    view._apply_events([PutEvent(KEYS.claim(0).encode(), b"b", 13, 13, 6)], 13)
    assert view._targets is targets
    assert view.claims() == {0: Claim("b", 6, 13)}


def put(key: str, value: bytes, revision: int) -> PutEvent:
    return PutEvent(key.encode(), value, revision, revision, 0)


def delete(key: str, revision: int) -> DeleteEvent:
    return DeleteEvent(key.encode(), revision)


def test_an_orderly_hand_over_is_told_from_a_lost_claim() -> None:
    """handed_over_cleanly: the claim's deletion and the hand-over record at one revision
    (one transaction, Worker._release); a claim that expired with its lease, or a
    deletion this view never saw, is not."""
    keys = Keys("ns", "g")
    view = GroupView(None, keys, 4)  # type: ignore[arg-type]
    view.load(10, {})
    view._apply_events([put(keys.claim(1), b"m-0", 11), put(keys.claim(2), b"m-0", 12)], 12)
    assert not view.handed_over_cleanly(1)
    # Partition 1 released in order: one transaction.
    view._apply_events([delete(keys.claim(1), 13), put(keys.handback(1), b"{}", 13)], 13)
    assert view.handed_over_cleanly(1)
    # Partition 2's claim expired with its lease: an old record does not make it orderly.
    view._apply_events([put(keys.handback(2), b"{}", 14)], 14)
    view._apply_events([put(keys.claim(2), b"m-1", 15)], 15)
    view._apply_events([delete(keys.claim(2), 16)], 16)
    assert not view.handed_over_cleanly(2)
    # Claimed again, then lost: its deletion wrote no record.
    view._apply_events([put(keys.claim(1), b"m-1", 17)], 17)
    view._apply_events([delete(keys.claim(1), 18)], 18)
    assert not view.handed_over_cleanly(1)
    # A fresh listing has no deletions in it: nothing is known to be orderly.
    view._apply_events([delete(keys.claim(2), 19), put(keys.handback(2), b"{}", 19)], 19)
    assert view.handed_over_cleanly(2)
    view.load(20, dict(view.kvs))
    assert not view.handed_over_cleanly(2)


def stats_put(member: str, value: dict[str, Any] | bytes, create: int, mod: int) -> PutEvent:
    data = value if isinstance(value, bytes) else json.dumps(value).encode()
    return PutEvent(KEYS.member(member).encode(), data, create, mod, 0)


def woke(view: GroupView, *events: PutEvent | DeleteEvent) -> bool:
    """Apply the events as one watch response; whether they woke the view's readers."""
    event = view.change_event()
    view._apply_events(list(events), max(int(e.mod_revision) for e in events))
    return event.is_set()


def test_a_routine_stats_rewrite_is_stored_without_waking_anyone() -> None:
    view = view_of(kv(KEYS.member("a"), {"lag": 0, "nats_ok": True}))
    assert not woke(view, stats_put("a", {"lag": 5, "nats_ok": True, "cpu": 3.0}, 1, 11))
    assert view.members()["a"].lag == 5
    assert view.revision == 11
    # Readers that wait for the next change still get it.
    assert woke(view, put(KEYS.claim(0), b"a", 12))


@pytest.mark.parametrize(
    "new",
    [
        {"lag": 0, "nats_ok": False},  # cut from NATS: the leader gives it nothing
        {"lag": 0, "nats_ok": True, "stalled": [3]},  # a stall: the leader moves it
        b"not json",  # unreadable: acted on (and logged) as any change
        b"[1, 2]",
    ],
)
def test_a_stats_rewrite_that_changes_a_deciding_field_wakes_the_readers(
    new: dict[str, Any] | bytes,
) -> None:
    view = view_of(kv(KEYS.member("a"), {"lag": 0, "nats_ok": True}))
    assert woke(view, stats_put("a", new, 1, 11))


def test_joins_leaves_and_re_registrations_wake_the_readers() -> None:
    view = view_of(kv(KEYS.member("a"), {"lag": 0}))
    assert woke(view, stats_put("b", {"lag": 0}, 11, 11))  # a join
    assert woke(view, stats_put("a", {"lag": 0}, 12, 12))  # a's key made again
    assert woke(view, DeleteEvent(KEYS.member("b").encode(), 13))  # a leave


def test_a_batch_with_anything_but_routine_rewrites_wakes_the_readers() -> None:
    view = view_of(kv(KEYS.member("a"), {"lag": 0}), kv(KEYS.member("b"), {"lag": 0}))
    assert not woke(view, stats_put("a", {"lag": 1}, 1, 11), stats_put("b", {"lag": 2}, 1, 11))
    assert woke(view, stats_put("a", {"lag": 3}, 1, 12), put(KEYS.partition(0), b"{}", 12))
