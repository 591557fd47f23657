"""This process's membership: a lease, the members/<id> key on it, keep-alives, fencing,
and the member's stats (routine ones in stats/<id>, Keys.stats).

Self-fencing is the safety rule the hand-over protocol rests on: a member stops
consuming before its lease could have expired on the server, so a partition whose claim
has vanished with the lease is never still being consumed by the old owner. `safe()`
is computed from the monotonic clock, so it turns false even if the whole process was
frozen (SIGSTOP, a long GC pause) and no keep-alive loop got to run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from shoal.clients.backoff import Backoff, QuietLog
from shoal.clients.etcd import TRANSIENT_ERRORS, Etcd
from shoal.contracts.values import MemberStats
from shoal.group.config import GroupConfig

log = logging.getLogger(__name__)

# After a failed (or timed-out) keep-alive, the next attempt goes out this soon, while
# the lease may still be alive on the server.
KEEPALIVE_RETRY = 0.5
# Once it cannot be (a TTL has passed since the last renewal), only noticing etcd's
# return matters: the attempts back off up to this (a member of a group whose etcd is
# down must not spin).
KEEPALIVE_RETRY_MAX = 5.0


# Routine stats rewrites (membership._stats_due): at most this many a second for the
# whole group, which keeps etcd's writes flat (only the leader reads them, polling:
# Keys.stats): at one rewrite per member per keepalive (3 s) a group of 64 wrote 21 a
# second. Up to 30 members nothing changes (one per keepalive); beyond, each member
# rewrites its routine stats every members / 10 seconds (6.4 s at 64).
ROUTINE_STATS_WRITES_PER_SECOND = 10.0


def routine_stats_period(keepalive_interval: float, group_size: int) -> float:
    """Seconds between a member's routine stats rewrites in a group of `group_size`
    (the autoscaler's staleness bound follows it: scaler.Policy.report_period_seconds)."""
    return max(keepalive_interval, group_size / ROUTINE_STATS_WRITES_PER_SECOND)


# The stats fields someone acts on at once (view.DECIDING_STATS, and paused: `shoal-consumer
# reset` waits for it): a change is put at the next keepalive, whatever the group's size.
Deciding = tuple[bool, bool | None, tuple[int, ...], tuple[int, ...] | None]


def deciding(stats: MemberStats) -> Deciding:
    return (stats.nats_ok, stats.handler_ok, stats.stalled, stats.paused)


class Membership:
    def __init__(
        self,
        etcd: Etcd,
        config: GroupConfig,
        stats: Callable[[], MemberStats],
        group_size: Callable[[], int] = lambda: 1,
    ) -> None:
        self.etcd = etcd
        self.config = config
        self.key = config.keys.member(config.member_id)
        self.stats_key = config.keys.member_stats(config.member_id)
        self._stats = stats
        self._group_size = group_size
        # What the last stats put said that someone acts on at once, and when it went.
        self._published: Deciding | None = None
        self._published_at = 0.0
        self.lease_id = 0
        # Each new lease is a new incarnation: claims made under an older one are gone.
        self.incarnation = 0
        self._renewed_at = 0.0  # monotonic time the last successful keep-alive was *sent*
        # Read once: safe() runs once per message.
        self._fence_after = config.fence_after
        self.leaving = False
        self.changed = asyncio.Event()
        # The member key's create_revision as we last wrote it: stats updates are
        # guarded on it, so an update that reaches etcd late never re-creates the key
        # after leave() deleted it (the leader would give a leaving member work again).
        self._created = 0
        # Every write of the member key, and leave()'s delete, one at a time: a stats put
        # still in flight when leave() starts finishes before the delete.
        self._key_lock = asyncio.Lock()

    def safe(self) -> bool:
        """True while our lease is certainly alive on the server."""
        if not self.lease_id:
            return False
        return time.monotonic() - self._renewed_at < self._fence_after

    def _value(self) -> bytes:
        return self._stats().to_json()

    async def join(self) -> None:
        """Grant a lease and register; retried with backoff until it works."""
        backoff = Backoff(0.2, 5.0)
        quiet = QuietLog(log)
        while True:
            try:
                sent = time.monotonic()
                lease_id = await self.etcd.grant_lease(self.config.lease_ttl)
                async with self._key_lock:
                    if self.leaving:
                        # leave() came while we were re-joining: stay out (the fresh
                        # lease goes with close(), or expires).
                        self.lease_id = lease_id
                        self._renewed_at = sent
                        return
                    self._created = await self.etcd.put_returning_revision(
                        self.key, self._value(), lease_id
                    )
                self.lease_id = lease_id
                self._renewed_at = sent
                self.incarnation += 1
                log.info(
                    "Joined group %s/%s as %s (lease %x, TTL %d s)",
                    self.config.namespace,
                    self.config.group,
                    self.config.member_id,
                    lease_id,
                    self.config.lease_ttl,
                )
                self._signal()
                return
            except TRANSIENT_ERRORS as exc:
                delay = backoff.next()
                quiet.failed(logging.WARNING, "Could not join (etcd: %s); retrying", exc)
                await asyncio.sleep(delay)

    def _signal(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def _watch_fence(self) -> None:
        """Signal `changed` the moment safe() turns false.

        The keep-alive loop below notices only between its own waits (a sleep, then a
        keep-alive that may hang for as long again), up to two intervals late; whoever
        must stop at the fence (the worker, the leader) waits on `changed`.
        """
        was_safe = self.safe()
        while True:
            left = self.config.fence_after - (time.monotonic() - self._renewed_at)
            if left > 0:
                wait = left + 0.01
            elif was_safe:
                wait = 0.0  # unsafe from now on: say so at once
            else:
                # Fenced: only a renewal ends it, and whoever renews signals `changed`
                # itself. Looking 100 times a second was a spin for as long as etcd
                # stayed away.
                wait = self.config.keepalive_interval
            await asyncio.sleep(min(wait, self.config.keepalive_interval))
            if self.safe() != was_safe:
                was_safe = self.safe()
                if not was_safe and self.lease_id:
                    log.warning(
                        "Fenced: lease %x not renewed for %.1f s; consuming nothing until it is",
                        self.lease_id,
                        time.monotonic() - self._renewed_at,
                    )
                self._signal()

    async def run(self) -> None:
        """Keep the lease alive and the stats fresh; re-join when the lease was lost."""
        watcher = asyncio.create_task(self._watch_fence(), name="fence-watch")
        try:
            await self._keep_alive()
        finally:
            watcher.cancel()

    async def _keep_alive(self) -> None:
        was_safe = True
        interval = self.config.keepalive_interval
        next_at = time.monotonic() + interval
        retry = Backoff(KEEPALIVE_RETRY, KEEPALIVE_RETRY_MAX)
        failures = QuietLog(log)
        stats_failures = QuietLog(log)
        while True:
            # Keep-alives go out every interval counted from the last one sent, not
            # from when the last one (and the stats put after it) finished, and one that
            # failed is retried soon: otherwise one slow keep-alive, or a slow put,
            # pushes the next renewal a whole interval later, past the fence.
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at = time.monotonic() + interval
            if self.safe() != was_safe:
                was_safe = self.safe()
                self._signal()
            sent = time.monotonic()
            try:
                async with asyncio.timeout(self.config.keepalive_interval):
                    ttl = await self.etcd.refresh_lease(self.lease_id)
            except TRANSIENT_ERRORS as exc:  # TimeoutError (the timeout) is among them
                unrenewed = time.monotonic() - self._renewed_at
                failures.failed(
                    logging.WARNING,
                    "Lease keep-alive failed (%s); fencing in %.1f s unless it recovers",
                    exc,
                    max(0.0, self.config.fence_after - unrenewed),
                )
                if unrenewed < self.config.lease_ttl:
                    # The lease may still be alive: a renewal in time saves everything.
                    retry.reset()
                    next_at = min(next_at, time.monotonic() + KEEPALIVE_RETRY)
                else:
                    # It has expired by now (we are fenced since fence_after, whatever
                    # these attempts do): wait for etcd's return without spinning.
                    next_at = time.monotonic() + retry.next()
                continue
            retry.reset()
            if failures.failing:
                lasted = failures.recovered()
                log.info("etcd answers keep-alives again (after %.1f s)", lasted)
            if ttl <= 0:
                log.warning("Lease %x expired; stopped consuming and re-joining", self.lease_id)
                self.lease_id = 0
                self._signal()
                if not self.leaving:
                    await self.join()
                continue
            self._renewed_at = sent
            if not was_safe:
                was_safe = True
                log.info("Lease keep-alive recovered")
                self._signal()
            try:
                stats = self._stats()
                if self._stats_due(stats, time.monotonic()):
                    await self._publish_stats(stats)
                stats_failures.recovered()
            except TRANSIENT_ERRORS as exc:
                stats_failures.failed(logging.WARNING, "Could not publish member stats: %s", exc)

    def _stats_due(self, stats: MemberStats, now: float) -> bool:
        """Whether to put our stats now: at once when what the leader acts on changed
        (nats_ok, handler_ok: it gives nothing to a member cut from NATS or from its
        handler; stalled: it moves those
        partitions; paused: `shoal-consumer reset` waits for it), else once the routine
        interval has passed: a keepalive interval, or longer in a big group
        (ROUTINE_STATS_WRITES_PER_SECOND)."""
        every = routine_stats_period(self.config.keepalive_interval, self._group_size())
        # (Half a keepalive early counts: the loop runs once per keepalive, and one that
        # ran a little early must not push the put a whole interval later.)
        return (
            deciding(stats) != self._published
            or now - self._published_at >= every - self.config.keepalive_interval / 2
        )

    async def put_stats_now(self) -> None:
        """Put our stats at once (Worker.partition_paused), between keepalives; a failure
        is left to the next keepalive's put."""
        if self.lease_id == 0 or self.leaving:
            return
        try:
            await self._publish_stats(self._stats())
        except TRANSIENT_ERRORS as exc:
            log.debug("Could not put member stats now: %s", exc)

    async def _publish_stats(self, stats: MemberStats) -> None:
        """Put our stats in stats/<id>, and in our member key too when a field someone acts
        on at once changed (Keys.stats: every member watches members/, only the leader
        stats/), in one transaction that holds only while the member key is the one we
        created: never re-creating it once leave() has begun."""
        value = stats.to_json()
        now_deciding = deciding(stats)
        async with self._key_lock:
            if self.leaving:
                return
            lease = self.lease_id
            items = {self.stats_key: value}
            if now_deciding != self._published:
                items[self.key] = value
            if await self.etcd.put_all_if_created_at(self.key, self._created, items, lease):
                self._published = now_deciding
                self._published_at = time.monotonic()
                return
            if self.leaving:
                return
            # Gone (or replaced) while we are a member: someone deleted it by hand, or
            # the group's keys were cleared. Register again, as join() would.
            log.warning("Member key %s vanished; registering again", self.key)
            self._created = await self.etcd.put_returning_revision(self.key, value, lease)
            self._published = now_deciding
            self._published_at = time.monotonic()

    async def leave(self) -> None:
        """Delete the member key so the leader moves our partitions; the lease stays for now."""
        async with self._key_lock:  # after a stats put in flight, never before it
            self.leaving = True
        try:
            await self.etcd.delete(self.key)
            # (Alone it is read by nobody, GroupView.members(); close() would take it.)
            await self.etcd.delete(self.stats_key)
            log.info("Left group %s/%s", self.config.namespace, self.config.group)
        except TRANSIENT_ERRORS as exc:
            log.warning("Could not delete member key (%s); the lease will expire it", exc)

    async def close(self) -> None:
        """Revoke the lease: every key on it (member, claims, leader) goes at once."""
        if not self.lease_id:
            return
        try:
            await self.etcd.revoke_lease(self.lease_id)
        except TRANSIENT_ERRORS as exc:
            log.warning(
                "Could not revoke lease (%s); it expires in %d s", exc, self.config.lease_ttl
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            # Expired already (its keep-alive stopped with the other tasks on a slow
            # host): what revoking was for is done.
            log.info("Lease %x had expired already; nothing to revoke", self.lease_id)
        self.lease_id = 0
