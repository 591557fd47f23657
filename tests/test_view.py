"""GroupView's reading of a listing: what it parses, and that what it caches follows
every change (pure: the view is fed a listing and watch events by hand)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shoal.consumer.etcd import KV
from shoal.consumer.view import Claim, GroupView
from shoal.contracts.names import Keys

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
