"""Consume exactly the partitions this member owns, and hand them over without loss.

The hand-over protocol (DESIGN.md):
  1. the leader changes partitions/p from A to B;
  2. A stops fetching p, finishes and acks the message in hand, gives back (nak) what it
     fetched but did not start, flushes its acks to the server, then deletes claims/p;
  3. B, watching, creates claims/p (only if absent) and starts pulling from p's durable.
Nobody consumes p without holding claims/p, and the claim lives on the holder's lease.

Pulling uses raw JetStream pull requests rather than nats-py's fetch(): every request is
read until the server ends it (batch complete, or a 404/408/409 status), so when A lets
go no pull request of A's is still open on the server. An open request would deliver a
message to A after A stopped reading; that message would sit unacked until ack_wait,
then come back to B out of order.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from nats.js.errors import NotFoundError

from shoal.consumer.config import GroupConfig
from shoal.consumer.deadletter import dead_letter_headers
from shoal.consumer.etcd import TRANSIENT_ERRORS, Etcd
from shoal.consumer.handlers import (
    Fenced,
    Handler,
    HandlerContext,
    Message,
    PermanentError,
)
from shoal.consumer.jetstream import consumer_config
from shoal.consumer.membership import Membership
from shoal.consumer.metrics import Metrics
from shoal.consumer.view import GroupView
from shoal.contracts.names import PROJECT_HEADER, dlq_subject, durable_name, partition_for

log = logging.getLogger(__name__)

ACTIVE_PROJECT_WINDOW = 60.0
# Seconds over which processing rates (per member and per partition) are measured.
RATE_WINDOW = 10.0
# Pulls nobody answers (503: the durable or the stream is gone): first and longest wait.
MISSING_DURABLE_BACKOFF = 0.5
MISSING_DURABLE_BACKOFF_MAX = 5.0


class Inbox:
    """Messages delivered for one partition, in order, with the time each arrived."""

    def __init__(self) -> None:
        self.entries: deque[list[Any]] = deque()  # [arrived or last kept alive, msg]
        self._arrived = asyncio.Event()

    def put(self, msg: Any) -> None:
        self.entries.append([time.monotonic(), msg])
        self._arrived.set()

    def get_nowait(self) -> Any | None:
        return self.entries.popleft()[1] if self.entries else None

    async def get(self, timeout: float) -> Any | None:
        """The next message, or None if none arrived within timeout."""
        while not self.entries:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout)
            except TimeoutError:
                return None
        return self.entries.popleft()[1]


def _is_status(msg: Any) -> bool:
    """A JetStream status message: a Status header, no data, nothing to ack."""
    return bool(msg.headers) and "Status" in msg.headers and not msg.data and not msg.reply


class PartitionRunner:
    """Pulls one partition's durable and runs the handler on each message, in order."""

    def __init__(
        self, worker: Worker, partition: int, claim_revision: int, target_ts: float | None
    ):
        self.worker = worker
        self.partition = partition
        self.claim_revision = claim_revision
        self.target_ts = target_ts
        self.stopping = False
        self.fenced = False
        self.first_message_seen = False
        self.inflight = 0
        self.handler_cancelled = False
        self.no_responders = False
        self.stop_requested_at = 0.0
        self.task: asyncio.Task[None] | None = None

    def stop(self) -> None:
        self.stopping = True
        self.stop_requested_at = time.monotonic()

    def fence(self) -> None:
        self.stopping = True
        self.fenced = True
        # A handler still running must stop now, not when it is done: fencing happens
        # fence_margin before our lease can expire, and once it has, the next owner
        # starts the partition. Left running, the handler would overlap with it, and
        # its in-progress acks would keep JetStream from redelivering the message (so
        # the next owner would also start on the later messages first). Cancelled, it
        # stops at its next await; the message is redelivered after ack_wait.
        # Not from inside the runner (it raises Fenced itself), and only once: a second
        # cancel could interrupt the bookkeeping in run()'s finally.
        task = self.task
        if (
            self.inflight
            and not self.handler_cancelled
            and task is not None
            and task is not asyncio.current_task()
        ):
            self.handler_cancelled = True
            task.cancel()
            log.warning("Fenced: cancelled the handler running on partition %d", self.partition)

    async def run(self) -> None:
        w = self.worker
        nc = w.nc
        queue = Inbox()

        async def deliver(msg: Any) -> None:
            queue.put(msg)

        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=deliver)
        api_subject = f"$JS.API.CONSUMER.MSG.NEXT.{w.config.stream}.{durable_name(self.partition)}"
        batch, expires = w.config.fetch_batch, w.config.fetch_expires
        request = json.dumps({"batch": batch, "expires": int(expires * 1e9)}).encode()
        # Messages that arrive after we were told to stop. They are given back only once
        # no request of ours is open: a nak while our request is open sends the message
        # straight back into that same request, round and round until max_deliver, after
        # which JetStream stops delivering it at all.
        held: list[Any] = []
        failed = False
        keeper = asyncio.create_task(self._keep_queued_alive(queue))
        try:
            backoff = MISSING_DURABLE_BACKOFF
            while not self.stopping:
                await nc.publish(api_subject, request, reply=inbox)
                await self._read_one_request(queue, batch, expires, held)
                if self.no_responders:
                    # Nobody answers pulls on this durable: it (or the stream) was
                    # deleted, or JetStream is away. Asking again at once is a busy loop
                    # of requests; recreate what is missing, and back off meanwhile.
                    self.no_responders = False
                    await self._recreate_durable()
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, MISSING_DURABLE_BACKOFF_MAX)
                else:
                    backoff = MISSING_DURABLE_BACKOFF
            # A message of a request we gave up on (its end status lost) may still come.
            await asyncio.sleep(0.02)
            while (msg := queue.get_nowait()) is not None:
                if not _is_status(msg):
                    held.append(msg)
            drained_at = time.monotonic()
            for msg in held:
                await self._give_back(msg)
            log.debug(
                "Partition %d: last request ended %.0f ms after the stop, %d given back in %.0f ms",
                self.partition,
                1000 * (drained_at - self.stop_requested_at),
                len(held),
                1000 * (time.monotonic() - drained_at),
            )
        except Fenced:
            log.warning("Fenced: stopped consuming partition %d at once", self.partition)
        except Exception:
            failed = not self.stopping
            if failed:
                log.exception("Partition %d consumer failed; restarting it", self.partition)
        finally:
            keeper.cancel()
            try:
                await sub.unsubscribe()
            except Exception:
                log.debug("Unsubscribe failed for partition %d", self.partition, exc_info=True)
            if failed:
                await asyncio.sleep(1.0)  # no tight loop while e.g. NATS is away
            await w.runner_done(self)

    async def _read_one_request(
        self, queue: Inbox, batch: int, expires: float, held: list[Any]
    ) -> None:
        """Read the current pull request to its end.

        A request ends when `batch` messages have arrived (the server sends nothing more)
        or with a 404/408/409 status. Waiting is bounded by the request's expiry plus a
        margin, counted only while nothing is queued, in case the end status was lost in
        a reconnect; time spent in the handler never cuts a request short, so messages
        are never left queued while another request is sent.
        """
        received = 0
        sent_at = time.monotonic()
        while received < batch:
            msg = queue.get_nowait()
            if msg is None:
                remaining = sent_at + expires + 1.0 - time.monotonic()
                if remaining <= 0:
                    return
                msg = await queue.get(remaining)
                if msg is None:
                    return
            if _is_status(msg):
                status = msg.headers.get("Status")
                if status == "100":  # idle heartbeat
                    continue
                if status not in ("404", "408"):
                    log.debug(
                        "Pull on partition %d ended: %s %s",
                        self.partition,
                        status,
                        msg.headers.get("Description"),
                    )
                    if status == "409":
                        await asyncio.sleep(0.1)
                    elif status == "503":
                        self.no_responders = True
                return
            received += 1
            if self.stopping:
                held.append(msg)
            else:
                await self._process(msg)

    async def _recreate_durable(self) -> None:
        """Recreate this partition's durable, unless JetStream objects are not ours to
        manage or the stream itself is gone."""
        w = self.worker
        c = w.config
        if not c.ensure_jetstream:
            log.error(
                "No JetStream consumer answers for partition %d (durable %s on stream %s "
                "deleted?); not recreating it (SHOAL_ENSURE_JETSTREAM is off)",
                self.partition,
                durable_name(self.partition),
                c.stream,
            )
            return
        try:
            try:
                # Creating a durable that exists with this config is a no-op; a new one
                # starts with what the work-queue stream still holds: nothing acked.
                await w.js.add_consumer(c.stream, config=consumer_config(c, self.partition))
                log.warning(
                    "Recreated the missing durable consumer of partition %d", self.partition
                )
            except NotFoundError:
                # The stream itself is gone, and its messages with it: recreating it is a
                # decision for whoever deleted it (the operator reconciles it). Say so
                # once, and keep backing off.
                if not w.stream_missing_logged:
                    w.stream_missing_logged = True
                    log.error("Stream %s is missing: nothing to consume until it is back", c.stream)
        except Exception as exc:  # JetStream away, or refusing: the backoff goes on
            log.warning("Could not recreate the durable of partition %d: %r", self.partition, exc)

    async def _keep_queued_alive(self, queue: Inbox) -> None:
        """Fetched messages wait their turn here while their ack_wait runs on the server.

        A member that takes over a backlog on many partitions at once may hold thousands
        of them; without in-progress acks the tail would be redelivered, and processed
        twice, before its turn came.
        """
        period = max(0.2, self.worker.config.ack_wait / 3)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for entry in list(queue.entries):
                if now - entry[0] >= period and not _is_status(entry[1]):
                    entry[0] = now
                    await entry[1].in_progress()

    async def _give_back(self, msg: Any) -> None:
        """Return a fetched but unstarted message to JetStream for the next owner."""
        if self.fenced:
            return  # the partition may be someone else's now: touch nothing
        if not self.worker.nats_reachable():
            # A nak request would wait out its timeout (5 s per message) on a dead
            # connection; unacked, the message is redelivered after ack_wait anyway.
            return
        try:
            if int(msg.metadata.num_delivered) >= self.worker.config.max_deliver:
                # A nak of its last delivery would strand it: JetStream would not
                # deliver it again. Finish it here instead.
                await self._process(msg)
            else:
                # A request, not a plain publish: JetStream applies acks asynchronously,
                # so a plain nak can still be in its queue when the next owner's first
                # pull arrives, which then gets newer messages first. The server answers
                # the request once the nak is applied (and naks stay in order).
                await self.worker.nc.request(msg.reply, b"-NAK", timeout=5)
        except Fenced:
            raise
        except Exception:
            log.debug("Giving back a message of partition %d failed", self.partition, exc_info=True)

    async def _process(self, msg: Any) -> None:
        w = self.worker
        if not w.membership.safe():
            self.fence()
            raise Fenced()
        meta = msg.metadata
        headers = dict(msg.headers or {})
        project = headers.get(PROJECT_HEADER, "")
        if not project:
            await w.dead_letter(msg, self.partition, "missing Shoal-Project-Id header")
            return
        if partition_for(project, w.config.partitions) != self.partition:
            await w.dead_letter(
                msg,
                self.partition,
                f"project {project!r} belongs to partition "
                f"{partition_for(project, w.config.partitions)}",
            )
            return
        message = Message(
            project_id=project,
            partition=self.partition,
            data=msg.data,
            headers=headers,
            stream_sequence=int(meta.sequence.stream),
            delivery_count=int(meta.num_delivered),
            subject=msg.subject,
            context=w.context,
        )
        if not self.first_message_seen:
            self.first_message_seen = True
            if self.target_ts is not None:
                w.metrics.handover_seconds.observe(max(0.0, time.time() - self.target_ts))
        self.inflight += 1
        started = time.perf_counter()
        ticker = asyncio.create_task(self._keep_in_progress(msg))
        try:
            await w.handler(message)
        except Fenced:
            self.fence()
            raise
        except PermanentError as exc:
            await w.dead_letter(msg, self.partition, f"permanent error: {exc}")
            w.metrics.processed.labels("dead_letter").inc()
            return
        except Exception as exc:
            if message.delivery_count >= w.config.max_deliver:
                await w.dead_letter(
                    msg,
                    self.partition,
                    f"failed {message.delivery_count} times, last: {exc!r}",
                )
                w.metrics.processed.labels("dead_letter").inc()
            else:
                delay = w.retry_delay(message.delivery_count)
                log.warning(
                    "Handler failed on %s (delivery %d): %r; retrying in %.1f s",
                    message.message_id,
                    message.delivery_count,
                    exc,
                    delay,
                )
                await msg.nak(delay=delay)
                w.metrics.processed.labels("retry").inc()
            return
        finally:
            ticker.cancel()
            self.inflight -= 1
            w.metrics.handler_seconds.observe(time.perf_counter() - started)
        await msg.ack()
        w.metrics.processed.labels("ok").inc()
        w.note_processed(project, self.partition)

    async def _keep_in_progress(self, msg: Any) -> None:
        """For long handlers: tell JetStream we are still at it, before ack_wait runs out."""
        interval = max(0.5, self.worker.config.ack_wait / 2)
        while True:
            await asyncio.sleep(interval)
            await msg.in_progress()


class Worker:
    def __init__(
        self,
        config: GroupConfig,
        etcd: Etcd,
        view: GroupView,
        membership: Membership,
        nc: Any,
        js: Any,
        handler: Handler,
        metrics: Metrics,
        *,
        nats_reachable: Callable[[], bool] | None = None,
    ) -> None:
        self.config = config
        # False while NATS does not answer (jetstream.NatsHealth): the leader then moves
        # our partitions away, and releasing them must not wait on NATS round trips.
        self.nats_reachable: Callable[[], bool] = nats_reachable or (lambda: True)
        self.etcd = etcd
        self.view = view
        self.membership = membership
        self.nc = nc
        self.js = js
        self.handler = handler
        self.metrics = metrics
        self.context = HandlerContext(config.member_id, config.subject_prefix, js, membership.safe)
        self.runners: dict[int, PartitionRunner] = {}
        self.stream_missing_logged = False
        self.claiming: set[int] = set()
        self.leaving = False
        self._incarnation = 0
        self._projects: dict[str, float] = {}
        # Messages processed per partition, in one-second buckets over RATE_WINDOW.
        self._processed: deque[tuple[int, Counter[int]]] = deque()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- stats for the member key -----------------------------------------------------

    def note_processed(self, project: str, partition: int) -> None:
        now = time.monotonic()
        self._projects[project] = now
        second = int(now)
        if not self._processed or self._processed[-1][0] != second:
            self._processed.append((second, Counter()))
        self._processed[-1][1][partition] += 1

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        while self._processed and now - self._processed[0][0] >= RATE_WINDOW:
            self._processed.popleft()
        for project, seen in list(self._projects.items()):
            if now - seen > ACTIVE_PROJECT_WINDOW:
                del self._projects[project]
        per_partition: Counter[int] = Counter()
        for _, counts in self._processed:
            per_partition.update(counts)
        return {
            "owned": sorted(self.runners),
            "inflight": sum(r.inflight for r in self.runners.values()),
            "rate": round(sum(per_partition.values()) / RATE_WINDOW, 2),
            # Messages per second of each owned partition: the leader's loads when the
            # group's assignment is load-aware.
            "partition_rates": {
                str(p): round(n / RATE_WINDOW, 2) for p, n in sorted(per_partition.items())
            },
            "active_projects": len(self._projects),
        }

    def retry_delay(self, delivery_count: int) -> float:
        backoff = self.config.backoff
        if backoff:
            return backoff[min(delivery_count - 1, len(backoff) - 1)]
        return min(1.0 * delivery_count, 30.0)

    async def dead_letter(self, msg: Any, partition: int, reason: str) -> None:
        """Publish to <prefix>.dlq.<p> with the reason, then terminate the original."""
        headers = dead_letter_headers(msg.headers, msg.subject, reason, self.config.member_id)
        await self.js.publish(
            dlq_subject(self.config.subject_prefix, partition), msg.data, headers=headers
        )
        await msg.term()
        log.warning("Dead-lettered a message of partition %d: %s", partition, reason)

    # -- ownership --------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run(self) -> None:
        await self.view.synced.wait()
        while True:
            view_changed = self.view.change_event()
            member_changed = self.membership.changed
            self._wake.clear()
            self._reconcile()
            waiters = [
                asyncio.ensure_future(view_changed.wait()),
                asyncio.ensure_future(member_changed.wait()),
                asyncio.ensure_future(self._wake.wait()),
            ]
            try:
                await asyncio.wait(waiters, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()

    def _reconcile(self) -> None:
        me = self.config.member_id
        if self.membership.incarnation != self._incarnation:
            # A new lease: claims taken under the old one have expired with it.
            for runner in self.runners.values():
                runner.fence()
            self._incarnation = self.membership.incarnation
        if not self.membership.safe():
            for runner in self.runners.values():
                if not runner.fenced:
                    runner.fence()
            return
        targets = self.view.targets()
        claims = self.view.claims()
        lease = self.membership.lease_id
        for p in range(self.config.partitions):
            target = targets.get(p)
            want = not self.leaving and target is not None and target.owner == me
            current = self.runners.get(p)
            if want and current is None and p not in self.claiming:
                claim = claims.get(p)
                if claim is None:
                    self.claiming.add(p)
                    self._spawn(self._claim(p, target.ts if target else None))
                elif claim.member == me and claim.lease == lease:
                    # Ours already (we were fenced for a moment, or restarted in place).
                    self._start(p, claim.create_revision, None)
            elif not want and current is not None and not current.stopping:
                log.info("Releasing partition %d", p)
                current.stop()
            elif not want and current is None and p not in self.claiming:
                claim = claims.get(p)
                if claim is not None and claim.member == me and claim.lease == lease:
                    # Our claim, on our live lease, with no runner and no longer ours to
                    # consume: a runner fenced for a moment left it (a fence touches
                    # nothing), and the partition moved meanwhile. Nobody uses it and
                    # the lease will not expire it: release it, or the next owner waits
                    # forever.
                    log.info("Releasing partition %d (its claim outlived a fence)", p)
                    self.claiming.add(p)
                    self._spawn(self._release_later(p, claim.create_revision))

    async def _claim(self, p: int, target_ts: float | None) -> None:
        try:
            lease = self.membership.lease_id
            revision = await self.etcd.create_returning_revision(
                self.config.keys.claim(p), self.config.member_id.encode(), lease
            )
            if revision is None:
                return  # somebody still holds it; its release wakes us through the view
            if target_ts is not None:
                log.debug(
                    "Claimed partition %d %.0f ms after its target was written",
                    p,
                    1000 * (time.time() - target_ts),
                )
            self._start(p, revision, target_ts)
        except TRANSIENT_ERRORS as exc:
            log.warning("Could not claim partition %d (etcd: %s)", p, exc)
        finally:
            self.claiming.discard(p)
            self._wake.set()

    def _start(self, p: int, claim_revision: int, target_ts: float | None) -> None:
        runner = PartitionRunner(self, p, claim_revision, target_ts)
        self.runners[p] = runner
        runner.task = asyncio.create_task(runner.run(), name=f"partition-{p}")
        self.metrics.partitions_owned.set(len(self.runners))
        log.debug("Consuming partition %d", p)

    async def runner_done(self, runner: PartitionRunner) -> None:
        """The runner stopped fetching: make acks durable, then let the partition go."""
        p = runner.partition
        if not runner.fenced:
            # Without NATS the flush can only time out: release at once, so that a member
            # cut from NATS hands its partitions over in seconds. Acks it could not
            # deliver mean redeliveries (at-least-once), never a loss.
            try:
                if self.nats_reachable():
                    await self.nc.flush(timeout=5)
                else:
                    log.warning("Releasing partition %d without flushing acks: NATS is away", p)
            except Exception:
                log.warning("Flushing acks before releasing partition %d failed", p)
            try:
                await self.etcd.delete_if_created_at(
                    self.config.keys.claim(p), runner.claim_revision
                )
            except TRANSIENT_ERRORS as exc:
                # Not "the lease will expire it": our lease is alive, so the claim would
                # stay, and the next owner would wait for it forever. Retry until it is
                # gone; meanwhile the partition counts as being claimed, so that we do
                # not start it again under the claim we are deleting.
                log.warning("Could not delete claim %d (%s); retrying", p, exc)
                self.claiming.add(p)
                self._spawn(self._release_later(p, runner.claim_revision))
            log.debug(
                "Released partition %d %.0f ms after the stop",
                p,
                1000 * (time.monotonic() - runner.stop_requested_at),
            )
        if self.runners.get(p) is runner:
            del self.runners[p]
        self.metrics.partitions_owned.set(len(self.runners))
        self._wake.set()

    async def _release_later(self, p: int, claim_revision: int) -> None:
        """Delete claims/p (the incarnation we held) once etcd answers again."""
        delay = 0.2
        try:
            while True:
                await asyncio.sleep(delay)
                claim = self.view.claims().get(p)
                if claim is None or claim.create_revision != claim_revision:
                    return  # gone already (deleted, or expired with an old lease)
                try:
                    if await self.etcd.delete_if_created_at(
                        self.config.keys.claim(p), claim_revision
                    ):
                        log.info("Released partition %d", p)
                    return
                except TRANSIENT_ERRORS as exc:
                    log.warning("Could not delete claim %d (%s); retrying", p, exc)
                    delay = min(delay * 2, 5.0)
        finally:
            self.claiming.discard(p)
            self._wake.set()

    async def drain(self, timeout: float) -> bool:
        """Leave: release every partition; True if all were released in time."""
        self.leaving = True
        self._wake.set()
        deadline = time.monotonic() + timeout
        while (self.runners or self.claiming) and time.monotonic() < deadline:
            self._reconcile()
            await asyncio.sleep(0.05)
        drained = not self.runners
        if not drained:
            # Handlers that outlived the drain timeout: stop them (as a fence does)
            # before the caller revokes the lease and so hands the partitions to the
            # next owners, which must not start while these still run.
            tasks = [r.task for r in self.runners.values() if r.task is not None]
            for runner in list(self.runners.values()):
                runner.fence()
            if tasks:
                await asyncio.wait(tasks, timeout=2.0)
        return drained

    def owned(self) -> list[int]:
        return sorted(self.runners)
