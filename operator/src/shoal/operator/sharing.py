"""Which groups use each of the operator's shared clients, so that the last one to leave
closes it.

The operator keeps one NATS connection per server and credentials, and one etcd client
per endpoints and Secret, for every group that names them. Kept for good, a client
outlived the groups that used it: a deleted group, or one whose spec moved to another
server or Secret, left its connection open (counted against the account's connection
limit, reconnecting for ever to a server that is gone) and its etcd client's threads
running. A group is known by a token of its own (the id of its GroupState, which kopf
keeps for as long as the object exists).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Sharers(Generic[K]):
    def __init__(self) -> None:
        self._groups: dict[K, set[int]] = {}

    def add(self, key: K, group: int) -> None:
        """`group` uses `key` (as well)."""
        self._groups.setdefault(key, set()).add(group)

    def use(self, key: K, group: int) -> list[K]:
        """`group` uses `key` now, and no other; the keys it used before and nobody uses
        any more."""
        left = self.release(group, keep=key)
        self.add(key, group)
        return left

    def release(self, group: int, *, keep: K | None = None) -> list[K]:
        """`group` uses no key (but `keep`); the keys nobody uses any more."""
        unused: list[K] = []
        for key, groups in list(self._groups.items()):
            if key != keep and group in groups:
                groups.discard(group)
                if not groups:
                    del self._groups[key]
                    unused.append(key)
        return unused

    def used(self, key: K) -> bool:
        return bool(self._groups.get(key))
