"""Every stall a group's members report, even one shorter than the status timer's period.

A member rewrites its stats (its member key) every few seconds; the leader moves a
stalled partition as soon as it sees the report, and the member stops reporting it at its
next write. So a report often lives for one stats period (~3 s), less than the operator's
OBSERVE_INTERVAL (5 s): read only at each observation, a stall that was healed at once
would often leave no trace in `kubectl describe cg`. A StallWatch therefore watches the
members' keys between observations and keeps each (partition, member) it saw reported,
with the revision it saw it at, until the status timer takes it.

It holds a set bounded by partitions x members; the callback runs on etcd3's watcher
thread, hence the lock. A watch that failed is replaced at the next observation (what was
reported in between is lost then: the status still shows what is stalled now).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from shoal.clients.etcd import Etcd, Watch
from shoal.contracts.values import MemberStats, ValueRefused
from shoal.operator.observe import stalled_partitions

log = logging.getLogger(__name__)

Stall = tuple[int, str]  # (partition, member)


class StallWatch:
    def __init__(self, etcd: Etcd, members_prefix: str, partitions: int) -> None:
        self.etcd = etcd
        self.prefix = members_prefix
        self.partitions = partitions
        self.watch: Watch | None = None
        self.failed = False
        self._lock = threading.Lock()
        self._seen: dict[Stall, int] = {}  # -> the first revision it was seen reported at

    async def start(self, revision: int) -> None:
        """Watch from `revision` (the one after the listing the caller just read)."""
        self.watch = await self.etcd.watch_prefix(self.prefix, revision, self._on_watch)

    async def stop(self) -> None:
        if self.watch is not None:
            watch, self.watch = self.watch, None
            try:
                await self.etcd.cancel_watch(watch)
            except Exception as exc:
                # Its client closed already (a rotated etcd Secret: the operator closed the
                # old client before the timer replaced this watch), and the watch with it.
                # Raised, it made that observation report the group EtcdUnavailable.
                log.debug("Stall watch on %s: not cancelled (%r)", self.prefix, exc)

    def _on_watch(self, response: Any) -> None:
        # etcd3's watcher thread. A deleted key reports nothing: its member is gone.
        if isinstance(response, BaseException):
            log.debug("Stall watch on %s failed: %r", self.prefix, response)
            self.failed = True
            return
        for event in response.events:
            if type(event).__name__ == "DeleteEvent":
                continue
            member = event.key.decode(errors="replace")[len(self.prefix) :]
            try:
                stats = MemberStats.parse(event.value)
            except ValueRefused:
                continue  # garbage: the timer's listing logs it (GroupView)
            revision = int(event.mod_revision)
            with self._lock:
                for stall in stalled_partitions({member: stats}, self.partitions):
                    self._seen.setdefault(stall, revision)

    def take(self, upto: int) -> set[Stall]:
        """The stalls seen reported at revisions up to `upto` (those are forgotten now);
        later ones stay for the next observation, which the listing at `upto` cannot
        judge."""
        with self._lock:
            taken = {s for s, rev in self._seen.items() if rev <= upto}
            for s in taken:
                del self._seen[s]
        return taken
