"""Consume exactly the partitions this member owns, and hand them over without loss.

The hand-over protocol (DESIGN.md):
  1. the leader changes partitions/p from A to B;
  2. A stops fetching p, lets the handlers running on p finish and ack, gives back (nak,
     in stream order) what it fetched but did not start, flushes its acks to the server,
     then deletes claims/p;
  3. B, watching, creates claims/p (only if absent) and starts pulling from p's durable.
Nobody consumes p without holding claims/p, and the claim lives on the holder's lease.

Each owned partition has a `PartitionRunner` (partition.py): it pulls the partition's
durable into the member's `Dispatcher` (dispatch.py) and, when stopped, does step 2 up to
the claim's deletion, which is the worker's (`runner_done`). The worker decides what runs:
it reconciles the partitions this member should own (the view of etcd, view.py) with the
runners it has, claims and starts partitions, stops and releases them, and holds the
member's budget: at most `max_buffered` messages over all partitions. Where each partition
is in that life on this member (claiming, consuming, releasing, released, handlers still
stopping after a fence, or free) is one record per partition (ownership.py).

While the group is paused (the `paused` key, read through the view before anything is
claimed) every runner finishes what runs, gives back what waits and pulls nothing, and
keeps its claim (partition.PartitionRunner._pause); the worker goes on reconciling, so
a partition the leader moves meanwhile is handed over as usual, and one claimed during
the pause starts paused.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from nats.js.errors import APIError, NotFoundError

from shoal.clients.etcd import TRANSIENT_ERRORS, Etcd
from shoal.clients.nats import round_trip
from shoal.clients.natsclient import Delivery, DirectClient
from shoal.consumer.deadletter import dead_letter_message
from shoal.consumer.dispatch import (
    ABANDONED,
    ACK_VERDICT,
    ACKED,
    DEAD_LETTER,
    NAKED,
    SETTLED,
    TERMINATED,
    Dispatcher,
    Held,
    Outcome,
    ProjectQueue,
)
from shoal.consumer.handlers import (
    DeliveredMessage,
    Fenced,
    Handler,
    HandlerContext,
    HandlerTimeout,
    HandlerUnreachable,
    Message,
    PermanentError,
    RetryAfter,
    message_id_of,
)
from shoal.consumer.handover_log import HandOverLog, ranges
from shoal.consumer.holding import HoldBudget
from shoal.consumer.httphandler import HttpHandler
from shoal.consumer.membership import Membership
from shoal.consumer.metrics import Metrics
from shoal.consumer.ownership import Ownership, Slot, Stage
from shoal.consumer.partition import IDLE_BATCH, PartitionRunner, Phase, ack_fields
from shoal.consumer.progress import WEDGED_AFTER_STALLS, Change
from shoal.consumer.pull import AnswerClock, PullRequest
from shoal.consumer.ratelimit import RateLimiter
from shoal.consumer.reach import Reach
from shoal.consumer.settled import SettledRing
from shoal.contracts.names import (
    dlq_subject,
    durable_name,
    partition_for,
)
from shoal.group.config import GroupConfig
from shoal.group.view import GroupView

log = logging.getLogger(__name__)


ACTIVE_PROJECT_WINDOW = 60.0
# For a while after a member joined or left (the leader's debounce, its write, the
# moves), pulls expire after BRISK_EXPIRES instead of fetch_expires: a partition that
# moves is released only once its open pull has ended (module docstring).
BRISK_EXPIRES = 0.05
BRISK_FOR = 3.0
# Projects whose partition was checked (sha256) once; the cache is dropped when this big.
PARTITION_CACHE_SIZE = 100_000
# Longer project ids are hashed each time, not kept: a producer sending many distinct ids
# of 64 KiB (a header may be that long) would have filled gigabytes.
PARTITION_CACHE_ID_CHARS = 256
# Claims made in one etcd transaction (its compares and puts count against etcd's
# --max-txn-ops, 128 by default).
CLAIM_BATCH = 64
ACK = b"+ACK"
# At most one log line a minute about redeliveries of settled messages.
RESETTLED_LOG_EVERY = 60.0
# A verdict that could not be carried out (dispatch.Held.verdict) is tried again after
# this long, doubling up to SETTLE_RETRY_MAX.
SETTLE_RETRY_FIRST = 0.5
SETTLE_RETRY_MAX = 10.0
# A message that never reached its handler (HandlerUnreachable: no attempt) is tried again
# after this long, doubling up to UNREACHABLE_RETRY_MAX: soon after the service is back.
UNREACHABLE_RETRY_FIRST = 0.2
UNREACHABLE_RETRY_MAX = 2.0
# How long past handlerTimeoutSeconds the handler sweep cancels an HTTP handler's run,
# which keeps the timeout itself (Worker._watch_handlers).
HTTP_SWEEP_GRACE = 5.0
# A message held this many stall periods (stallAfterSeconds: 10 min by default) is said
# in the log, once (Worker._say_held_long).
HELD_LONG_STALLS = 10


def backoff(first: float, tries: int, most: float) -> float:
    """`first`, doubling with each try after the first, at most `most`: for as many
    tries as it takes (2.0 ** 1024 overflows, some 34 minutes of 2 s retries in)."""
    return min(first * 2.0 ** min(max(tries - 1, 0), 62), most)


def why(exc: BaseException) -> str:
    """An error for a log line or a dead letter's reason, whatever it is: JetStream's
    errors with their description and code (their repr is "BadRequestError()"), and an
    exception whose own repr raises (a handler's) by its type."""
    try:
        return str(exc) if isinstance(exc, APIError) else repr(exc)
    except Exception:
        return f"{type(exc).__name__} (its repr failed)"


def _in_a_running_task() -> bool:
    """Whether we run in a task (a lane), not in a coroutine's close() outside one."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop
        return False
    return task is not None and not task.done()


def text(exc: BaseException) -> str:
    """str(exc), or its type when that raises."""
    try:
        return str(exc)
    except Exception:
        return f"{type(exc).__name__} (its str failed)"


def _log_etcd_error(exc: Exception, message: str, partition: int) -> None:
    """A warning for etcd being away (retried as a matter of course); an error, with
    its type, for anything else, which someone should look at."""
    if isinstance(exc, TRANSIENT_ERRORS):
        log.warning(message, partition, exc)
    else:
        log.error(message, partition, f"{type(exc).__name__}: {exc}")


def message_id(held: Held) -> str:
    """The message's id as its handler sees it (handlers.message_id_of), for logs."""
    try:
        return message_id_of(held.msg.headers, held.seq)
    except Exception:
        return f"seq-{held.seq}"


# At most one look at the stream's info this often (check_stream): while the stream is
# gone, each partition's attempts to recreate its durable ask too, and those were
# doubling the member's requests to a server that had nothing to tell.
STREAM_CHECK_SECONDS = 2.0


def _take_back_cancel() -> None:
    """Undo one cancel of the current task (one it no longer has to end for)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        task.uncancel()


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
        # False while NATS does not answer (shoal.clients.nats.NatsHealth): the leader then moves
        # our partitions away, and releasing them must not wait on NATS round trips.
        self.nats_reachable: Callable[[], bool] = nats_reachable or (lambda: True)
        self.etcd = etcd
        self.view = view
        self.membership = membership
        self.nc = nc
        self.js = js
        self.handler = handler
        # An HTTP handler's reachability (reach.py): while its service accepts no
        # connection, no message is sent it. (None for Python handlers: one raising
        # HandlerUnreachable has failed an attempt, as with any error.)
        self._reach: Reach | None = handler.reach if isinstance(handler, HttpHandler) else None
        self.metrics = metrics
        self.context = HandlerContext(config.member_id, config.subject_prefix, js, membership.safe)
        # The group's rate limit (maxMessagesPerSecond), this member's share of it: 0
        # until it owns partitions (share_rate). None without a limit.
        self.limiter: RateLimiter | None = None
        if config.max_messages_per_second is not None:
            self.limiter = RateLimiter(0.0)
        self.dispatcher = Dispatcher(self._execute, config.max_concurrency, self.limiter)
        # Each partition's life on this member, one record each (ownership.py): claiming,
        # consuming, releasing, released, handlers stopping, or free. `runners` is its
        # index of the consuming partitions' runners, read on the hot path; only
        # `ownership.move` changes either.
        self.ownership = Ownership()
        self.runners = self.ownership.runners
        self.holding = HoldBudget(config.max_buffered)
        self.buffered = 0
        self.reserved = 0  # asked for by open pull requests, not arrived yet
        self.answers = AnswerClock()
        # Runners waiting for room in the member's buffer (not in their own).
        # (An ordered set: the longest waiting is woken first.)
        self.starved: dict[PartitionRunner, None] = {}
        self.stream_missing_logged = False
        # Pull requests that could not be sent since the last one that was (partition.py).
        self.unsent_pulls = 0
        # One INFO line per hand-over batch (nothing reads it to decide what to do).
        self.handovers = HandOverLog()
        # What this member settled lately (settled.py): a redelivery of one of those is
        # acked again instead of handled again.
        self.settled_seqs = SettledRing()
        # Keys.reset's mod_revision as last seen (follow_reset); None: not looked yet.
        self._reset_seen: int | None = None
        # When the stream we consume was created, as last read (check_stream); None: not
        # read yet, or the stream was deleted since. And how many times we found it was
        # not the stream we consumed (forget_stream).
        self._stream_created: object | None = None
        self.stream_epoch = 0
        self._stream_checked_at = -STREAM_CHECK_SECONDS
        self.resettled = 0  # such redeliveries, since the last log line about them
        self.resettled_logged = 0.0
        self.leaving = False
        # The group is paused (Keys.paused): set from the view before each reconcile, so
        # before any partition of a paused group is claimed (set_paused).
        self.paused = False
        self._incarnation = 0
        self._projects: dict[str, float] = {}
        self._partition_of: dict[str, int] = {}
        # Refused messages being dead-lettered, (partition, stream sequence) -> their
        # latest delivery (dead_letter).
        self._dead_lettering: dict[tuple[int, int], Delivery] = {}
        # Processed counts at the last stats(), for rates over the stats interval.
        self._rate_mark: tuple[float, dict[int, int]] = (time.monotonic(), {})
        self._wake = asyncio.Event()
        self._connection_mark: tuple[bool, int] = (True, 0)
        self._member_ids: frozenset[str] | None = None
        self._brisk_until = 0.0
        self._brisk_generation = 0  # the assignment generation when brisk pulls began
        self._tasks: set[asyncio.Task[Any]] = set()
        # One subscription for every runner's pull requests, <prefix>.<token> each: one
        # nats-py queue and task for the member, instead of one per partition. (The
        # token is per request: for its statuses. Messages go by durable: receive.)
        self._inbox_prefix = ""
        self._inbox_sub: Any = None
        self._inboxes: dict[str, tuple[PartitionRunner, PullRequest]] = {}
        self._inbox_count = 0
        self._partitions_by_durable = {durable_name(p): p for p in range(config.partitions)}
        # Counted into plain integers, read at scrape time (metrics.MessageTally).
        self.tally = metrics.messages

    # -- running messages (the dispatcher's execute) ----------------------------------

    def belongs(self, project: str, partition: int) -> bool:
        known = self._partition_of.get(project)
        if known is None:
            known = partition_for(project, self.config.partitions)
            if len(project) <= PARTITION_CACHE_ID_CHARS:
                if len(self._partition_of) >= PARTITION_CACHE_SIZE:
                    self._partition_of.clear()
                self._partition_of[project] = known
        return known == partition

    def _message(self, runner: PartitionRunner, held: Held) -> Message:
        return DeliveredMessage(
            held.project,
            runner.partition,
            held.msg,
            held.seq,
            held.delivered - held.credit + held.failures,
            self.context,
        )

    async def _execute(self, runner: PartitionRunner, held: Held) -> Outcome | float:
        """Run the handler on one message and settle it; see dispatch.Execute."""
        if runner.fenced:
            return ABANDONED
        if not self.membership.safe():
            runner.fence()
            return ABANDONED
        if held.verdict is None and held.delivered - 1 - held.credit >= self.config.max_deliver:
            # Every attempt made already, each delivery unanswered: its members crashed or
            # froze mid-handler (JetStream's own limit is off: jetstream.consumer_config).
            held.verdict = (
                DEAD_LETTER,
                f"delivered {held.delivered - held.credit - 1} times without an answer "
                f"(maxDeliver {self.config.max_deliver}): its members died or froze on it",
            )
        reach = self._reach
        if held.verdict is None and reach is not None:
            if reach.since is not None:
                # The HTTP handler accepts no connection: nothing is sent it until its
                # probe finds it back (reach.py), and the wait is no attempt.
                return self._unreached(runner, held, reach.why)
            held.unreached = 0  # (its backoff starts afresh at the next episode)
        if not runner.first_message_seen:
            runner.first_message_seen = True
            if runner.target_ts is not None:
                self.metrics.handover_seconds.observe(max(0.0, time.time() - runner.target_ts))
        if held.verdict is None:
            # (Otherwise decided already: the handler ran, and only settling it failed.)
            started = held.started = time.perf_counter()
            try:
                await self.handler(self._message(runner, held))
            except Fenced:
                runner.fence()
                return ABANDONED
            except PermanentError as exc:
                held.verdict = (DEAD_LETTER, f"permanent error: {text(exc)}")
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is None:
                    raise
                if not task.cancelling():
                    # Nobody cancelled us: the handler raised it itself (a task of its own
                    # cancelled under it, say). A failure like any other; let through, it
                    # ended a dispatch lane for good, and its project with it.
                    failure: BaseException = exc
                elif not held.timed_out:
                    raise  # a fence, or the process stopping
                else:
                    task.uncancel()  # ours (_watch_handlers); another cancel still stands
                    if task.cancelling() or runner.fenced:
                        raise
                    failure = HandlerTimeout(
                        f"still running after {self.config.handler_timeout:g} s "
                        "(handlerTimeoutSeconds)"
                    )
                delay = self._failed(runner, held, failure)
                if delay is not None:
                    return delay
            except Exception as exc:
                if held.timed_out:
                    # Our cancel, turned into an error by the handler (a cleanup that
                    # raised, say): take it back, as below. Left standing, the lane's
                    # next timeout or fence would take it for the process stopping.
                    _take_back_cancel()
                delay = self._failed(runner, held, exc)
                if delay is not None:
                    return delay
            except (SystemExit, KeyboardInterrupt, GeneratorExit) as exc:
                # A handler cannot stop the member: let through, it ended the dispatch
                # lane, which was replaced and ran the same message again at once, for
                # good (GeneratorExit: 26,000 runs in 5 s). A failed attempt, as any.
                if isinstance(exc, GeneratorExit) and not _in_a_running_task():
                    raise  # this coroutine itself is being closed, not the handler's doing
                if held.timed_out:
                    _take_back_cancel()
                delay = self._failed(runner, held, exc)
                if delay is not None:
                    return delay
            else:
                if held.timed_out:
                    # The handler swallowed our cancel and finished: take it back.
                    _take_back_cancel()
                # Msg.ack() minus its checks (we ack each message once, here or
                # nowhere), and without a coroutine while a flush is queued (nearly
                # always, under load): the hot path ends here.
                if self.nc.queue_ack(held.msg.reply, ACK):
                    self.settled_seqs.add(held.seq)
                    self.tally.ok += 1
                    # (Its delivery time: close enough for a 60 s window, no clock read.)
                    self._projects[held.project] = held.kept
                    return SETTLED
                held.verdict = ACK_VERDICT
            finally:
                held.started = 0.0
                held.timed_out = False
                self.tally.observe_handler(time.perf_counter() - started)
        return await self.settle(runner, held)

    async def _watch_handlers(self) -> None:
        """Cancel handlers that run past handler_timeout: each such run is a failed
        attempt (_execute). Without this a handler that never returns holds its project
        for good, kept alive by in-progress acks. One sweep for the member, reading what
        the dispatcher knows anyway: nothing is added per message but a clock read."""
        timeout = self.config.handler_timeout
        period = min(1.0, max(0.05, timeout / 4))
        # An HTTP handler's request keeps the timeout itself, and tells a connection not
        # made in time (no attempt) from a request unanswered (one): this sweep is only
        # its backstop, HTTP_SWEEP_GRACE later. Due together, as a late event loop makes
        # them, the sweep's cancel hides the request's own timeout: a connection never
        # made would count as an attempt.
        limit = timeout + (HTTP_SWEEP_GRACE if self._reach is not None else 0.0)
        while True:
            await asyncio.sleep(period)
            now = time.perf_counter()
            for task, _, held in self.dispatcher.running_heads():
                if not held.started or held.timed_out or now - held.started < limit:
                    continue
                held.timed_out = True
                log.warning(
                    "Handler ran past %g s on message %d (id %s) of project %r, partition "
                    "%d: cancelling it; the run counts as a failed attempt",
                    timeout,
                    held.seq,
                    message_id(held),
                    held.project,
                    partition_for(held.project, self.config.partitions),
                )
                task.cancel()

    def _failed(self, runner: PartitionRunner, held: Held, exc: BaseException) -> float | None:
        """A handler error: the delay before it is retried in place, or None when its
        verdict is set (dead-letter after max_deliver attempts, or nak)."""
        if isinstance(exc, HandlerUnreachable) and self._reach is not None:
            return self._unreached(runner, held, str(exc))
        held.failures += 1
        # Attempts so far: one per earlier delivery that was one (elsewhere: Held.credit),
        # plus ours here.
        attempts = held.delivered - 1 - held.credit + held.failures
        if attempts >= self.config.max_deliver:
            held.verdict = (DEAD_LETTER, f"failed {attempts} times, last: {why(exc)}")
            return None
        delay = self.retry_delay(attempts)
        if isinstance(exc, RetryAfter) and exc.delay > delay:
            delay = exc.delay  # the handler (an HTTP Retry-After) asks for longer
        self.tally.retry += 1
        if self.config.retry_policy == "NakAndContinue":
            # The old behaviour, chosen explicitly: JetStream redelivers it after the
            # delay, and later messages of its project may overtake it.
            log.warning(
                "Handler failed on message %d of partition %d (attempt %d): %s; "
                "redelivering in %.1f s",
                held.seq,
                runner.partition,
                attempts,
                why(exc),
                delay,
            )
            held.verdict = (NAKED, str(delay))
            return None
        log.warning(
            "Handler failed on message %d of project %r (attempt %d of %d): %s; "
            "retrying in %.1f s, the project's later messages wait",
            held.seq,
            held.project,
            attempts,
            self.config.max_deliver,
            why(exc),
            delay,
        )
        # A failed attempt is progress, and the wait for the retry a deliberate one.
        runner.attempts_ended += 1
        runner.retry_until = max(runner.retry_until, time.monotonic() + delay)
        return delay

    def _unreached(self, runner: PartitionRunner, held: Held, why: str) -> float:
        """The message did not reach the HTTP handler, which accepts no connection: the
        delay before it is tried again in place. No attempt, whatever the retry policy
        (a nak would count a delivery), and a wait the member reports as one (reach.py),
        not a stall: the leader moves the partition if another member can do better."""
        held.unreached += 1
        if self._reach is not None:
            self._reach.waits += 1
        delay = backoff(UNREACHABLE_RETRY_FIRST, held.unreached, UNREACHABLE_RETRY_MAX)
        log.debug(
            "Message %d of project %r did not reach the handler (%s); again in %.1f s",
            held.seq,
            held.project,
            why,
            delay,
        )
        runner.retry_until = max(runner.retry_until, time.monotonic() + delay)
        return delay

    async def settle(self, runner: PartitionRunner, held: Held) -> Outcome | float:
        """Carry out the message's verdict: ack, dead-letter or nak it.

        If that fails (NATS away and its reconnect buffer full, the dead-letter stream
        missing or full), the message stays at the head of its project with its verdict,
        and settling is retried after a backoff; the handler does not run again. Leaving
        it instead (as a failure here once did) stalled the project for good: nothing
        rescheduled it, and in-progress acks kept JetStream from redelivering it.
        """
        assert held.verdict is not None
        kind, detail = held.verdict
        msg = held.msg
        try:
            if kind is ACKED:
                # Msg.ack() minus its checks (we ack each message once, here or
                # nowhere), and without a coroutine while a flush is queued (nearly
                # always, under load).
                if not self.nc.queue_ack(msg.reply, ACK):
                    await self.nc.publish_ack(msg.reply, ACK)
            elif kind is DEAD_LETTER:
                await self._publish_dead_letter(msg, runner.partition, detail)
                # Copied: if only the term fails, the retry must not copy it again.
                held.verdict = (TERMINATED, detail)
                await msg.term()
            elif kind is TERMINATED:
                await msg.term()
            else:
                await msg.nak(delay=float(detail))
        except Exception as exc:
            held.settle_failures += 1
            delay = backoff(SETTLE_RETRY_FIRST, held.settle_failures, SETTLE_RETRY_MAX)
            # Once, then every tenth: a long outage must not flood the log.
            if held.settle_failures % 10 == 1:
                log.warning(
                    "Could not %s message %d of project %r (partition %d, try %d): %s; "
                    "retrying in %.1f s, the project's later messages wait",
                    kind,
                    held.seq,
                    held.project,
                    runner.partition,
                    held.settle_failures,
                    why(exc),
                    delay,
                )
            return delay
        if kind is not NAKED:
            self.settled_seqs.add(held.seq)
        if kind is ACKED:
            self.tally.ok += 1
            # (Its delivery time: close enough for a 60 s window, and no clock read.)
            self._projects[held.project] = held.kept
        elif kind is NAKED:
            pass
        else:
            self.tally.dead_letter += 1
            log.warning("Dead-lettered a message of partition %d: %s", runner.partition, detail)
        if held.settle_failures:
            log.warning(
                "Settled message %d of project %r after %d failed tries",
                held.seq,
                held.project,
                held.settle_failures,
            )
        return SETTLED

    async def keep_held_alive(self) -> None:
        """In-progress acks for messages held longer than a quarter of ack_wait.

        Held messages (queued behind their project, waiting for the rate limit's token
        in the ready queue, running a long handler, or waiting for a retry) run their
        ack_wait on the server; without these the server would
        redeliver them, and they would be processed twice. One loop for the whole member,
        not a task per message.
        """
        # With a backoff, JetStream's first redelivery comes after its first step.
        c = self.config
        ack_wait = min(c.ack_wait, c.backoff[0]) if c.backoff and c.backoff[0] > 0 else c.ack_wait
        period = max(0.2, ack_wait / 4)
        while True:
            await asyncio.sleep(period / 2)
            now = time.monotonic()
            queues = [
                queue
                for runner in list(self.runners.values())
                if not runner.fenced
                for queue in list(runner.projects.values())
                if queue.pending
            ]
            due = [held for queue in queues for held in queue.pending if now - held.kept >= period]
            try:
                self._report_held(queues, now)
            except Exception:  # a report must never stop the in-progress acks
                log.exception("Reporting the held messages' ages failed")
            for held in due:
                held.kept = now
                try:
                    await held.msg.in_progress()
                except Exception:
                    log.debug("In-progress ack failed", exc_info=True)
                    break
            if due:
                log.debug("Sent in-progress acks for %d held messages", len(due))

    def _report_held(self, queues: list[ProjectQueue], now: float) -> None:
        """shoal_oldest_held_seconds, and a line for each head held long (once each)."""
        # A project's oldest message is its head.
        oldest = min((queue.pending[0].since for queue in queues), default=now)
        self.metrics.oldest_held.set(round(now - oldest, 1))
        long_ago = now - HELD_LONG_STALLS * self.config.stall_after
        if oldest <= long_ago:
            for queue in queues:
                head = queue.pending[0]
                if head.since <= long_ago and not head.said:
                    self._say_held_long(head, now)

    def _say_held_long(self, held: Held, now: float) -> None:
        """Log, once, a project's head held longer than HELD_LONG_STALLS stall periods.
        Its partition may be making progress (other projects move on) while this head
        cannot finish: no stall of the partition, yet its project waits, which must not
        go unsaid (shoal_oldest_held_seconds measures it)."""
        held.said = True
        log.warning(
            "Message %d (id %s) of project %r, partition %d, has been held here for %.0f s, "
            "its project's later messages behind it; waiting on %s",
            held.seq,
            message_id(held),
            held.project,
            partition_for(held.project, self.config.partitions),
            now - held.since,
            self._held_waits_on(held),
        )

    def _held_waits_on(self, held: Held) -> str:
        """What a held message waits on, in words (for _say_held_long's line)."""
        if held.verdict is not None:
            kind, _ = held.verdict
            return f"its {kind} to be carried out ({held.settle_failures} tries failed)"
        if held.started:
            return f"its handler, running for {time.perf_counter() - held.started:.0f} s"
        if self._reach is not None and self._reach.since is not None:
            return f"its handler, which accepts no connection ({self._reach.why})"
        if held.failures:
            return f"a retry after {held.failures} failed attempt(s) here"
        return "its turn (a free dispatch lane, or the group's rate limit)"

    # -- stats for the member key -----------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """This worker's fields of the member's stats (MemberStats: the member adds its
        own, and writes them to its member key)."""
        now = time.monotonic()
        for project, seen in list(self._projects.items()):
            if now - seen > ACTIVE_PROJECT_WINDOW:
                del self._projects[project]
        counts = {p: r.processed for p, r in self.runners.items()}
        mark, before = self._rate_mark
        self._rate_mark = (now, counts)
        elapsed = max(now - mark, 1e-3)
        rates = {p: max(0, n - before.get(p, 0)) / elapsed for p, n in counts.items()}
        return {
            "owned": sorted(self.runners),
            "inflight": self.dispatcher.running,
            "buffered": self.buffered,
            "rate": round(sum(rates.values()), 2),
            # Messages per second of each owned partition: the leader's loads when the
            # group's assignment is load-aware.
            "partition_rates": {str(p): round(r, 2) for p, r in sorted(rates.items()) if r},
            "active_projects": len(self._projects),
            # Partitions with work and no progress (progress.py): the leader moves them.
            "stalled": self.stalled(),
            # Partitions done pausing (nothing running, nothing held, no pull open):
            # `shoal-consumer reset` recreates the durables only once all say so.
            "paused": self.paused_partitions(),
        }

    def partition_paused(self) -> None:
        """A runner finished pausing. Once all have, put our stats now, not at the next
        keepalive: `shoal-consumer reset` waits for every member's `paused` (up to a
        keepalive interval, 3 s by default, otherwise)."""
        if all(r.phase is Phase.PAUSED for r in self.runners.values()):
            self._spawn(self.membership.put_stats_now())

    def paused_partitions(self) -> list[int]:
        return sorted(p for p, r in self.runners.items() if r.phase is Phase.PAUSED)

    def retry_delay(self, attempts: int) -> float:
        backoff = self.config.backoff
        if backoff:
            return backoff[min(attempts - 1, len(backoff) - 1)]
        return min(1.0 * attempts, 30.0)

    async def dead_letter(self, msg: Delivery, partition: int, reason: str) -> None:
        """Publish to <prefix>.dlq.<p> with the reason, then terminate the original: a
        message refused at arrival (no project id, another partition's). Retried with a
        backoff while the partition is ours: such a message is no project's head, so
        nothing else tries it again, and unsettled it came back every ack_wait for good
        (the durable's own max_deliver is off). A delivery of a message being
        dead-lettered already (nothing keeps it alive meanwhile: it comes back every
        ack_wait) only takes the place of the one to terminate; each had started a loop of
        its own, and each loop wrote a copy of the message."""
        _, seq, _ = ack_fields(msg.reply)
        key = (partition, seq)
        if key in self._dead_lettering:
            self._dead_lettering[key] = msg
            return
        self._dead_lettering[key] = msg
        try:
            await self._dead_letter_refused(key, partition, reason)
        finally:
            self._dead_lettering.pop(key, None)

    async def _dead_letter_refused(self, key: tuple[int, int], partition: int, reason: str) -> None:
        copied = False
        for attempt in itertools.count(1):
            msg = self._dead_lettering[key]  # its latest delivery
            try:
                if not copied:
                    await self._publish_dead_letter(msg, partition, reason)
                    copied = True
                await self._dead_lettering[key].term()
                break
            except Exception as exc:
                runner = self.runners.get(partition)
                gone = runner is None or runner.letting_go
                delay = backoff(SETTLE_RETRY_FIRST, attempt, SETTLE_RETRY_MAX)
                if gone or attempt % 10 == 1:
                    log.warning(
                        "Could not dead-letter a message of partition %d (try %d): %s; %s",
                        partition,
                        attempt,
                        why(exc),
                        "its next owner will"
                        if gone
                        else f"retrying in {delay:.1f} s (reason: {reason[:200]})",
                    )
                if gone:
                    return
                await asyncio.sleep(delay)
        log.warning("Dead-lettered a message of partition %d: %s", partition, reason)

    async def _publish_dead_letter(self, msg: Delivery, partition: int, reason: str) -> None:
        headers, data, cut = dead_letter_message(
            msg.headers, msg.data, msg.subject, reason, self.config.member_id, self.nc.max_payload
        )
        if cut:
            log.error(
                "A message of partition %d was cut to be dead-lettered (the server's limits): %s",
                partition,
                cut,
            )
        await self.js.publish(
            dlq_subject(self.config.subject_prefix, partition), data, headers=headers
        )

    def resettle(self, runner: PartitionRunner, msg: Delivery, seq: int) -> None:
        """A message this member settled came back (its ack applied late, or lost): ack
        it again, without running its handler again (settled.py)."""
        if not self.nc.queue_ack(msg.reply, ACK):
            self._spawn(self._ack_again(msg.reply))
        self.metrics.redeliveries_resettled.inc()
        self.resettled += 1
        now = time.monotonic()
        if now - self.resettled_logged >= RESETTLED_LOG_EVERY:
            log.warning(
                "%d message(s) came back although this member had settled them (e.g. "
                "message %d of partition %d): the server applied the acks late or lost "
                "them; acked again, not handled again",
                self.resettled,
                seq,
                runner.partition,
            )
            self.resettled, self.resettled_logged = 0, now

    async def _ack_again(self, reply: str) -> None:
        try:
            await self.nc.publish_ack(reply, ACK)
        except Exception as exc:  # it comes back after ack_wait, and is acked again then
            log.debug("Could not ack a redelivered message again: %r", exc)

    def budget(self) -> int:
        """What the member may hold plus what its open pulls may bring (holding.py): about
        a second of its settle rate, up to max_buffered, and never less than every owned
        partition's idle pull plus one full batch: below that, idle partitions' open pulls
        hold the whole budget and a busy partition can never pull."""
        floor = IDLE_BATCH * len(self.runners) + self.config.fetch_batch
        return self.holding.limit(floor, time.monotonic())

    def wake_starved(self) -> None:
        """Wake the runner that has waited longest for room in the member's buffer, if
        there is room for a pull now (one at a time: waking all of them on every
        settled message, to find no room for most, is a thundering herd)."""
        if self.budget() - self.buffered - self.reserved >= IDLE_BATCH:
            runner = next(iter(self.starved))
            del self.starved[runner]
            runner._wake()

    # -- ownership --------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def spawn(self, coro: Any) -> None:
        """Run `coro` as a task of the worker's (kept until done; cancelled on close)."""
        self._spawn(coro)

    def inbox_for(self, runner: PartitionRunner, request: PullRequest) -> str:
        """A new reply subject for one of `runner`'s pull requests: its statuses arrive
        on it, and reach that request only (an old request's 408 must not end a newer
        one). Its messages do not: see receive()."""
        self._inbox_count += 1
        inbox = f"{self._inbox_prefix}.{runner.partition}-{self._inbox_count}"
        self._inboxes[inbox] = (runner, request)
        request.inbox = inbox
        return inbox

    def forget_inbox(self, inbox: str) -> None:
        self._inboxes.pop(inbox, None)

    def receive(self, msg: Delivery) -> None:
        """Hand a message of our pull requests to its runner, as it is read (natsclient).

        A JetStream message keeps its own subject, so the shared subscription cannot
        tell whose inbox it came to; its reply subject names the durable, hence the
        partition. The partition's runner has at most one request open on the server
        (partition.py's docstring), so the message is that request's.
        """
        durable, seq, delivered = ack_fields(msg.reply)
        partition = self._partitions_by_durable.get(durable)
        runner = self.runners.get(partition) if partition is not None else None
        if runner is not None:
            refused = runner.deliver(msg, seq, delivered)
            if refused is not None:
                self._spawn(self.dead_letter(msg, runner.partition, refused))
        else:
            # Ours no more (a request we gave up on as lost delivered late): unacked,
            # JetStream redelivers it to the partition's owner after ack_wait.
            log.debug("A message of %s arrived with no runner for it", durable)

    def receive_status(self, subject: str, headers: dict[str, str]) -> None:
        """A status has no reply subject; it arrives on the request's reply subject,
        which is that request's own (inbox_for)."""
        owner = self._inboxes.get(subject)
        if owner is not None:
            owner[0].deliver_status(headers, owner[1])

    async def run(self) -> None:
        if not isinstance(self.nc, DirectClient):
            raise TypeError("a Worker reads through shoal.clients.natsclient.DirectClient")
        await self.view.synced.wait()
        self._inbox_prefix = self.nc.new_inbox()
        # No callback: the direct path hands every message over as it is read.
        self._inbox_sub = await self.nc.subscribe(self._inbox_prefix + ".*")
        self.nc.route_directly(self._inbox_sub, self.receive, self.receive_status)
        await self._watch_deletions()
        self._spawn(self.check_stream())  # (the first look: not worth a slower start)
        self.dispatcher.start()
        self._spawn(self.keep_held_alive())
        if self.config.handler_timeout:
            self._spawn(self._watch_handlers())
        while True:
            view_changed = self.view.change_event()
            member_changed = self.membership.changed
            self._wake.clear()
            self._notice_members()
            # (The reset first: a reset and the resume after it may arrive together, and
            # the runners must forget the old durables before they pull again.)
            self.follow_reset()
            self.set_paused()
            self._reconcile()
            self.share_rate()
            self.check_connection()
            self.check_stalls()
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

    def set_paused(self) -> None:
        """Follow the group's `paused` key (GroupView.paused): pause every runner when it
        appears, resume them when it goes. Runners started later follow `paused` (_start)."""
        # Every round of the worker's loop: the key's presence, and its record parsed
        # only when that changes (for the log line).
        paused = self.view.is_paused()
        if paused == self.paused:
            return
        self.paused = paused
        runners = list(self.runners.values())
        record = self.view.paused()
        if record is not None:
            for runner in runners:
                runner.pause()
            log.info(
                "Group paused %s: %d partition(s) finish what runs, give back what waits "
                "and pull nothing; claims kept",
                record.describe(),
                len(runners),
            )
        else:
            for runner in runners:
                runner.resume()
            log.info("Group resumed: %d partition(s) pull again", len(runners))

    def follow_reset(self) -> None:
        """After `shoal-consumer reset` (Keys.reset changed since we first looked):
        forget what we remember of the old durables. The recreated ones deliver the
        replayed messages again, with the same stream sequences: the settled ring would
        take a replayed message that comes back (a nak, a hand-over) for a late
        redelivery and ack it unhandled; a runner's given-back sequences and credits
        would hold back, or miscount, the first deliveries. The reset writes the key
        while every runner is paused, so nothing is in flight to lose track of."""
        kv = self.view.kvs.get(self.config.keys.reset)
        revision = kv.mod_revision if kv is not None else 0
        if self._reset_seen is None:
            self._reset_seen = revision  # one from before we started: nothing of ours
            return
        if revision == self._reset_seen:
            return
        self._reset_seen = revision
        if kv is None:
            return  # the record was deleted: no new durables
        self.settled_seqs = SettledRing()
        for runner in self.runners.values():
            runner.durable_reset()
        log.info(
            "The group's durables were reset (%s): %d partition(s) forget the old deliveries",
            kv.value.decode(errors="replace")[:200],
            len(self.runners),
        )

    def share_rate(self) -> None:
        """Take this member's share of the group's rate limit: limit x owned / partitions
        (ratelimit.py). Called after every reconcile, so on every ownership change: a
        partition counts from its runner's start to its stop, and no partition has two
        runners (claims), so the members' shares add up to the limit at most, also while
        partitions move. A stopping partition starts nothing new, so it counts no more."""
        limiter = self.limiter
        limit = self.config.max_messages_per_second
        if limiter is None or limit is None:
            return
        owned = sum(1 for r in self.runners.values() if not r.letting_go)
        rate = limit * (owned / self.config.partitions)  # never above the limit
        if rate != limiter.rate:
            limiter.set_rate(rate)
            log.debug(
                "Rate limit share: %.4g messages/s (%d of %d partitions, group limit %g/s)",
                rate,
                owned,
                self.config.partitions,
                limit,
            )

    def _notice_members(self) -> None:
        """A member joined or left: partitions are about to move. Pull briskly until
        they have, so that the ones we give up are released without waiting out a
        full-length pull (most of a planned hand-over's latency otherwise)."""
        ids = self.view.member_ids()
        if ids != self._member_ids:
            if self._member_ids is not None:
                self._start_brisk()
            self._member_ids = ids
        elif self._brisk_until and self.view.generation() > self._brisk_generation:
            # The leader has written the assignment that answers the change: what we
            # give up is stopping already (its last pull was a brisk one), and what we
            # keep gains nothing from short pulls, which only cost CPU on a host busy
            # with the hand-over (the unmoved partitions' pauses).
            self._brisk_until = 0.0

    def _start_brisk(self) -> None:
        """Pull briskly for BRISK_FOR, or until the next assignment is written."""
        self._brisk_until = time.monotonic() + BRISK_FOR
        self._brisk_generation = self.view.generation()

    def brisk(self) -> bool:
        """Partitions are about to move (see _notice_members)."""
        return bool(self._brisk_until) and time.monotonic() < self._brisk_until

    async def prepare_to_leave(self, timeout: float) -> None:
        """Before our member key goes: pull briskly, and wait (at most `timeout`) until
        no pull of full length is open. Once we leave, every partition stops, and each is
        released when its open pull has ended: a brisk one ends within BRISK_EXPIRES,
        where one sent before would keep the partition up to fetch_expires. The
        partitions go on consuming meanwhile; a dozing one has no pull open."""
        self._start_brisk()
        deadline = time.monotonic() + timeout
        while any(
            r.request is not None and r.request.expires > BRISK_EXPIRES
            for r in self.runners.values()
        ):
            if time.monotonic() >= deadline:
                log.info("Leaving with pulls still open (they did not end in %.1f s)", timeout)
                break
            await asyncio.sleep(0.02)  # polled: once per process, for 0.3 s at most

    def pull_expires(self) -> float:
        expires = self.config.fetch_expires
        return min(expires, BRISK_EXPIRES) if self.brisk() else expires

    async def _watch_deletions(self) -> None:
        """Rouse dozing partitions when their durable or the stream is deleted. A dozing
        partition pulls nothing, so it would notice only at the next publish or safety
        sweep, and the group would say nothing of the loss meanwhile. JetStream's
        advisories cost nothing until such an event."""
        stream = self.config.stream
        for subject in (
            f"$JS.EVENT.ADVISORY.STREAM.DELETED.{stream}",
            f"$JS.EVENT.ADVISORY.CONSUMER.DELETED.{stream}.*",
        ):
            await self.nc.subscribe(subject, cb=self._on_deleted)

    async def check_stream(self) -> None:
        """Look whether the group's stream was deleted and created again since we last
        looked (its creation time changed); if so, forget what we remember of the old
        one's deliveries (stream_epoch counts how often). The new one's sequences start
        again at 1: the settled ring would ack unhandled a new message that comes back
        with the sequence of an old one we settled, and a durable recreated "where it
        was" would start where the old stream was, past the new one's first messages
        (restart.py)."""
        now = time.monotonic()
        if now - self._stream_checked_at < STREAM_CHECK_SECONDS:
            return  # looked a moment ago (every partition recreating its durable asks)
        self._stream_checked_at = now
        try:
            info = await self.js.stream_info(self.config.stream)
        except NotFoundError:
            if self._stream_created is not None:
                self.forget_stream("it was deleted")
            return
        except Exception as exc:  # NATS away: the next look will tell
            log.debug("Stream info unavailable: %r", exc)
            return
        created, self._stream_created = self._stream_created, info.created
        # Its last sequence below one delivered to us: another stream (a stream's
        # sequences never go back), even if we never saw the old one's creation time.
        high = max((r.delivered_high for r in self.runners.values()), default=0)
        if (created is not None and created != info.created) or info.state.last_seq < high:
            self.forget_stream("it was created again")
            self._stream_created = info.created

    def forget_stream(self, why: str) -> None:
        """The stream is not the one whose deliveries we remember: forget them (as after
        a reset of the durables, follow_reset). Handlers may run again for messages
        already handled (at-least-once), never not at all."""
        self._stream_created = None
        self.stream_epoch += 1
        self.settled_seqs = SettledRing()
        for runner in self.runners.values():
            runner.durable_reset()
        log.warning(
            "Stream %s is not the one we consumed (%s): forgetting its deliveries "
            "(%d partition(s))",
            self.config.stream,
            why,
            len(self.runners),
        )

    async def _on_deleted(self, msg: Any) -> None:
        partition: int | None = None
        if msg.subject.startswith("$JS.EVENT.ADVISORY.STREAM."):
            self.forget_stream("it was deleted")
        if msg.subject.startswith("$JS.EVENT.ADVISORY.CONSUMER."):
            partition = self._partitions_by_durable.get(msg.subject.rsplit(".", 1)[-1])
            if partition is None:
                return  # not one of the partitions' durables
        for runner in list(self.runners.values()):
            if runner.dozing and partition in (None, runner.partition):
                runner.rouse()

    def check_connection(self) -> None:
        """Wake the dozing partitions if the connection dropped since the last check:
        nothing published meanwhile rang their alarms (nats-py subscribes them again on
        reconnecting), so each must pull once to see what it missed. Once it is back,
        wake the others too: they pull nothing while NATS is away."""
        nc = self.nc
        mark = (nc.is_connected, nc.stats.get("reconnects", 0))
        if mark != self._connection_mark:
            self._connection_mark = mark
            for runner in self.runners.values():
                if runner.dozing:
                    runner.rouse()
                elif mark[0]:
                    # Back: a runner waiting for the connection to pull (it sends nothing
                    # meanwhile, PartitionRunner._pull) need not wait out its backoff.
                    runner._wake()

    def _fence_all(self, why: str) -> None:
        """Stop every runner at once; one line for all of them."""
        fenced = sorted(p for p, r in self.runners.items() if not r.fenced)
        for p in fenced:
            self.runners[p].fence()
        if fenced:
            log.warning(
                "Fenced (%s): stopped consuming %d partitions at once: %s",
                why,
                len(fenced),
                ranges(fenced),
            )

    def _reconcile(self) -> None:
        me = self.config.member_id
        if self.membership.incarnation != self._incarnation:
            # A new lease: claims taken under the old one have expired with it.
            self._fence_all("a new lease")
            self._incarnation = self.membership.incarnation
        if not self.membership.safe():
            self._fence_all("the lease is not renewed")
            return
        targets = self.view.targets()
        claims = self.view.claims()
        lease = self.membership.lease_id
        self.handovers.new_pass()
        to_claim: dict[int, float | None] = {}  # partition -> its target's time
        ownership = self.ownership
        for p in range(self.config.partitions):
            target = targets.get(p)
            want = not self.leaving and target is not None and target.owner == me
            claim = claims.get(p)
            # Where the partition is on this member: one lookup (ownership.py).
            slot = ownership.slot(p)
            stage = Stage.FREE if slot is None else slot.stage
            current = slot.runner if slot is not None and stage is Stage.CONSUMING else None
            if stage is Stage.RELEASED:
                assert slot is not None
                if claim is not None and claim.create_revision == slot.revision:
                    # Deleted already; the view has not seen it yet. Taken for ours
                    # ("ours already" below), it would start a runner on a claim that
                    # no longer exists.
                    continue
                ownership.move(p, Stage.FREE)
                slot, stage = None, Stage.FREE
            # Claiming, or deleting a claim of ours: its task moves it on when done.
            under_way = stage is Stage.CLAIMING or stage is Stage.RELEASING
            if (
                current is not None
                and not current.letting_go
                and self.view.revision >= current.claim_revision
                and (claim is None or claim.create_revision != current.claim_revision)
            ):
                # The claim this runner consumes under is gone (the view has caught up
                # with its creation, and shows it no more): nobody may consume without
                # one. Stop, and claim again if the partition is still ours.
                log.warning("Partition %d: its claim is gone; stopping its consumer", p)
                current.stop()
                continue
            if want and current is None and not under_way:
                if stage is Stage.HANDLERS_STOPPING and claim is None:
                    assert slot is not None and slot.runner is not None
                    if slot.runner.inflight:
                        # The claim went with the old lease, but the handlers the fence
                        # cancelled still stop: a runner of ours now would run the
                        # partition's messages beside them. went_idle() pokes us.
                        continue
                self.handovers.taking([p])
                if claim is None:
                    # (From handlers stopping too: the claim went with the old lease.)
                    ownership.move(p, Stage.CLAIMING)
                    to_claim[p] = target.ts if target else None
                elif claim.member == me and claim.lease == lease:
                    # Ours already (we were fenced for a moment, or restarted in place).
                    if stage is Stage.HANDLERS_STOPPING:
                        assert slot is not None and slot.runner is not None
                        if slot.runner.inflight:
                            # The fence cancelled handlers that are still stopping (a
                            # rollback, say): a new runner now would run the partition's
                            # messages beside them. went_idle() pokes us when they end.
                            continue
                        ownership.move(p, Stage.FREE)
                    # Not a fresh claim: the runner before this one (fenced) left what it
                    # held to JetStream's redelivery, so the new one must wait for it.
                    # (That runner was done only once the server had ended its pull
                    # requests: PartitionRunner._outlast_fenced.)
                    self._start(p, claim.create_revision, None, fresh_claim=False)
            elif not want and current is not None and not current.letting_go:
                log.debug("Releasing partition %d", p)
                # (Leaving, the target is still us: no new owner to name yet.)
                new_owner = target.owner if target is not None and target.owner != me else ""
                self.handovers.releasing({p: new_owner})
                if current.progress.stalled_at is not None:
                    # Moved because it stalled: whatever it waits on may never come, so
                    # its running handlers are cancelled rather than waited for; what it
                    # held is given back in order as in any hand-over.
                    log.warning("Partition %d moved away while stalled", p)
                    current.abort()
                else:
                    current.stop()
            elif not want and current is None and not under_way:
                if self.handovers.is_taking(p):
                    self.handovers.abandoned(p)  # the target moved on before we started
                if stage is Stage.HANDLERS_STOPPING:
                    assert slot is not None and slot.runner is not None
                    if slot.runner.inflight:
                        continue  # a cancelled handler still runs: keep the claim
                    ownership.move(p, Stage.FREE)
                if claim is not None and claim.member == me and claim.lease == lease:
                    # Our claim, on our live lease, with no runner and no longer ours to
                    # consume: a runner fenced for a moment left it (a fence touches
                    # nothing), and the partition moved meanwhile. Nobody uses it and
                    # the lease will not expire it: release it, or the next owner waits
                    # forever.
                    log.info("Releasing partition %d (its claim outlived a fence)", p)
                    if ownership.move(p, Stage.RELEASING, revision=claim.create_revision):
                        self._spawn(self._release_later(p, claim.create_revision))
        if to_claim:
            self._spawn(self._claim_all(to_claim))

    async def _claim_all(self, targets: dict[int, float | None]) -> None:
        """Claim these partitions: CLAIM_BATCH at a time in one etcd transaction each,
        which succeeds when none of them is claimed (a member starting, or taking
        partitions released already); otherwise one by one, concurrently.

        One claim per transaction cost a member starting with 128 partitions 250 ms
        before it consumed all of them (16 etcd threads, each transaction ~30 ms while
        the first partitions kept the event loop busy); one transaction takes a few ms.
        """
        ps = sorted(targets)
        if len(ps) == 1:
            await self._claim(ps[0], targets[ps[0]])
            return
        singles: list[int] = []
        lease = self.membership.lease_id
        value = self.config.member_id.encode()
        passed = False
        try:
            for i in range(0, len(ps), CLAIM_BATCH):
                batch = ps[i : i + CLAIM_BATCH]
                keys = [self.config.keys.claim(p) for p in batch]
                try:
                    revision = await self.etcd.create_all_returning_revision(keys, value, lease)
                except Exception as exc:
                    # The next pass tries again (the view's next change, or within 1 s).
                    log.warning("Could not claim partitions %s (etcd: %r)", batch, exc)
                    for p in batch:
                        self._unclaim(p)
                    continue
                if revision is None:
                    singles.extend(batch)  # some are held still: one by one
                    continue
                for p in batch:
                    self._start(p, revision, targets[p])
                self._wake.set()
            passed = True
        finally:
            # Whatever was neither started nor left to _claim must not stay "claiming"
            # forever: after an unexpected error, nothing is left to _claim either.
            for p in ps:
                if p not in singles or not passed:
                    self._unclaim(p)
        await asyncio.gather(*(self._claim(p, targets[p]) for p in singles))

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
        except Exception as exc:  # the next pass tries again
            log.warning("Could not claim partition %d (etcd: %r)", p, exc)
        finally:
            self._unclaim(p)
            self._wake.set()

    def _unclaim(self, p: int) -> None:
        """A claim attempt ended without a runner: the partition is free again (the next
        pass tries again if it is still ours). Started, it is consuming: left alone."""
        if self.ownership.stage(p) is Stage.CLAIMING:
            self.ownership.move(p, Stage.FREE)

    def _start(
        self, p: int, claim_revision: int, target_ts: float | None, *, fresh_claim: bool = True
    ) -> None:
        runner = PartitionRunner(self, p, claim_revision, target_ts, fresh_claim=fresh_claim)
        if not self.ownership.move(p, Stage.CONSUMING, runner=runner):
            return  # a bug of ours, logged: a runner nobody lists must not run
        if self.paused:
            runner.pause()  # before its first pull
        runner.task = asyncio.create_task(runner.run(), name=f"partition-{p}")
        self.metrics.partitions_owned.set(len(self.runners))
        log.debug("Consuming partition %d", p)
        self.handovers.took(p)

    async def runner_done(self, runner: PartitionRunner) -> None:
        """The runner stopped fetching: make acks durable, then let the partition go."""
        after = Stage.FREE
        try:
            after = await self._let_go(runner)
        finally:
            # Whatever failed above, the runner is done: it must not stay listed as
            # consuming (a runner left here, stopping for ever with its claim on our live
            # lease, was a partition nobody would consume again). Every stage _let_go
            # returns is a move consuming allows (ownership._NEXT), so this one happens.
            runner.released()
            self.buffered -= runner.buffered
            runner.buffered = 0
            p = runner.partition
            if self.ownership.runner(p) is runner:
                self.ownership.move(p, after, runner=runner, revision=runner.claim_revision)
            self.metrics.partitions_owned.set(len(self.runners))
            self._wake.set()

    async def _let_go(self, runner: PartitionRunner) -> Stage:
        """Flush our acks and delete the claim (unless fenced). Returns the partition's
        next stage, which runner_done moves it to as it forgets the runner."""
        p = runner.partition
        after = Stage.FREE  # fenced: the claim is left as it is (reconcile sees to it)
        if not runner.fenced:
            # Without NATS the flush can only time out: release at once, so that a member
            # cut from NATS hands its partitions over in seconds. Acks it could not
            # deliver mean redeliveries (at-least-once), never a loss.
            try:
                if self.nats_reachable():
                    await round_trip(self.nc, 5.0)  # not nc.flush(): see round_trip
                else:
                    log.warning("Releasing partition %d without flushing acks: NATS is away", p)
            except Exception:
                log.warning("Flushing acks before releasing partition %d failed", p)
            try:
                await self._release(p, runner.claim_revision, runner.handback)
            except Exception as exc:
                # Not "the lease will expire it": our lease is alive, so the claim would
                # stay, and the next owner would wait for it forever. Retry until it is
                # gone, whatever the error (a refusal, say a permission an operator took
                # away for a moment, is no reason to give the partition up for good);
                # meanwhile the partition counts as being claimed, so that we do not
                # start it again under the claim we are deleting.
                _log_etcd_error(exc, "Could not delete claim %d (%s); retrying", p)
                # (Moved to releasing by runner_done before this task first looks.)
                after = Stage.RELEASING
                self._spawn(self._release_later(p, runner.claim_revision, runner.handback))
                self.handovers.abandoned(p)  # _release_later says when it is done
            else:
                after = Stage.RELEASED
                self.handovers.released(p)
            log.debug(
                "Released partition %d %.0f ms after the stop",
                p,
                1000 * (time.monotonic() - runner.stop_requested_at),
            )
        if runner.fenced:
            self.handovers.abandoned(p)
            if runner.inflight and after is Stage.FREE:
                # Its handlers were cancelled but have not stopped yet: the claim must
                # outlive them (see _reconcile), or the next owner starts alongside.
                # (Fenced only after the claim's deletion, it has none running: its
                # hand-over waited for them.)
                after = Stage.HANDLERS_STOPPING
        # (runner_done then forgets the runner: given back, or left to JetStream's
        # redelivery when fenced, what it held is no longer ours.)
        return after

    async def _release(self, p: int, claim_revision: int, handback: dict[int, int] | None) -> bool:
        """Delete claims/p (the incarnation we held); with `handback` (an orderly
        hand-over), write the hand-over record in the same transaction (none: leave it)."""
        claim = self.config.keys.claim(p)
        if handback is None:
            return await self.etcd.delete_if_created_at(claim, claim_revision)
        # Written even when empty: the next owner reads its revision as the sign of an
        # orderly hand-over (GroupView.handed_over_cleanly), and waits for exactly the
        # sequences it lists (takeover.Gate.for_given_back): none when empty.
        value = json.dumps({str(seq): c for seq, c in sorted(handback.items())}).encode()
        return await self.etcd.release_claim(
            claim, claim_revision, self.config.keys.handback(p), value
        )

    async def _release_later(
        self, p: int, claim_revision: int, handback: dict[int, int] | None = None
    ) -> None:
        """Delete claims/p (the incarnation we held) once etcd answers again."""
        delay = 0.2
        try:
            while True:
                await asyncio.sleep(delay)
                claim = self.view.claims().get(p)
                if claim is None or claim.create_revision != claim_revision:
                    return  # gone already (deleted, or expired with an old lease)
                try:
                    if await self._release(p, claim_revision, handback):
                        log.info("Released partition %d", p)
                    return
                except Exception as exc:
                    _log_etcd_error(exc, "Could not delete claim %d (%s); retrying", p)
                    delay = min(delay * 2, 5.0)
        finally:
            if self.ownership.stage(p) is Stage.RELEASING:
                self.ownership.move(p, Stage.FREE)
            self._wake.set()

    async def drain(self, timeout: float) -> bool:
        """Leave: release every partition; True if all were released in time."""
        self.leaving = True
        self._wake.set()
        deadline = time.monotonic() + timeout
        while self.ownership.busy() and time.monotonic() < deadline:
            self._reconcile()
            await asyncio.sleep(0.05)
        drained = not self.runners
        runners = list(self.runners.values())
        if not drained:
            # Handlers that outlived the drain timeout: stop them (as a fence does)
            # before the caller revokes the lease and so hands the partitions to the
            # next owners, which must not start while these still run.
            tasks = [r.task for r in runners if r.task is not None]
            for runner in runners:
                runner.fence()
            if tasks:
                await asyncio.wait(tasks, timeout=2.0)
        # The cancelled handlers run in the dispatcher's tasks, and may take a moment to
        # stop (a rollback): wait for them too, and for those an earlier fence cancelled
        # (their partitions wait in HANDLERS_STOPPING), or the lease goes (and with it
        # the partitions) while they still run. Not for ever: one deaf to cancellation
        # ends with the process.
        runners += [
            slot.runner
            for slot in self.ownership.in_stage(Stage.HANDLERS_STOPPING)
            if slot.runner is not None
        ]
        deadline = time.monotonic() + 2.0
        for runner in runners:
            # went_idle() wakes it when its last handler has stopped.
            while runner.inflight and (left := deadline - time.monotonic()) > 0:
                await runner.sleep_until_woken(min(left, 0.1))
        return drained

    # -- progress ---------------------------------------------------------------------

    def check_stalls(self) -> None:
        """Find partitions with work and no progress for stall_after (progress.py); say
        so once per episode. The stats carry them to the leader, which moves them."""
        now = time.monotonic()
        after = self.config.stall_after
        # Without NATS or a sure lease nothing can progress, and that is said already
        # (nats_ok in the stats, the fence): it is not a silent stall, and restarting
        # members through liveness during an outage would only add to it.
        excused = not self.nats_reachable() or not self.membership.safe()
        # A handler still within handler_timeout is progress under way: a legitimately
        # long one (its partition's buffer full of its project's later messages) must
        # not get its partition moved, and its run cancelled, every stall_after. Past
        # the timeout it is cancelled (_watch_handlers). With no timeout, a handler that
        # runs past stall_after with nothing else moving is a stall.
        busy: set[int] = set()
        # Lanes waiting for the rate limit (ratelimit.py) within the last stall period: a
        # partition with nothing running waits for them, not on something stuck. Its
        # messages are kept alive meanwhile; moving it would only move the wait (the
        # group's limit is the same everywhere). A running handler is still watched.
        limiter = self.limiter
        throttled = limiter is not None and (
            limiter.waiting > 0 or now - limiter.throttled_at < after
        )
        if self.config.handler_timeout:
            clock = time.perf_counter()
            for _, source, held in self.dispatcher.running_heads():
                if held.started and clock - held.started < self.config.handler_timeout:
                    busy.add(source.partition)
        for p, r in self.runners.items():
            has_work = (
                r.has_work()
                and not excused
                and p not in busy
                and not (throttled and not r.inflight)
                and not r.waits_deliberately(now)
            )
            change = r.progress.observe(r.progress_mark(), has_work, now, after)
            if change is Change.STALLED:
                log.warning(
                    "Partition %d is stalled: no progress for %.0f s with work to do "
                    "(%d held, %d pending on the server); waiting on %s. Reporting it, so "
                    "that the leader moves it to another member",
                    p,
                    now - r.progress.since,
                    r.buffered,
                    r.server_lag,
                    r.waiting_on(),
                )
            elif change is Change.RECOVERED:
                log.warning("Partition %d makes progress again", p)
        for slot in self._deaf(now):
            if not slot.reported:
                slot.reported = True
                log.warning(
                    "Partition %d: %d handler(s) cancelled %.0f s ago still run (deaf to "
                    "cancellation); its claim stays ours until they stop, so nobody else "
                    "can consume it: reporting it stalled (liveness fails after %.0f s)",
                    slot.partition,
                    slot.runner.inflight if slot.runner is not None else 0,
                    now - slot.since,
                    WEDGED_AFTER_STALLS * after,
                )
        self.metrics.partitions_stalled.set(len(self.stalled()))

    def _deaf(self, now: float) -> list[Slot]:
        """Partitions kept for handlers that were cancelled (a fence, a stalled partition
        moved away) stall_after ago or more and still run: only the end of the process
        stops them, so they are stalls too (reported, not ready, then wedged)."""
        return [
            slot
            for slot in self.ownership.in_stage(Stage.HANDLERS_STOPPING)
            if now - slot.since >= self.config.stall_after
        ]

    def stalled(self) -> list[int]:
        stalled = {p for p, r in self.runners.items() if r.progress.stalled_at is not None}
        stalled.update(slot.partition for slot in self._deaf(time.monotonic()))
        return sorted(stalled)

    def wedged(self) -> bool:
        """A partition stalled for WEDGED_AFTER_STALLS stall periods: the leader should
        have moved it long ago, so something here is stuck for good (liveness fails).
        So are handlers that have ignored their cancellation that long."""
        now = time.monotonic()
        bound = WEDGED_AFTER_STALLS * self.config.stall_after
        if any(now - slot.since >= bound for slot in self._deaf(now)):
            return True
        return any(r.progress.stalled_for(now) >= bound for r in self.runners.values())

    def poke(self) -> None:
        """Reconcile again soon (something it waits for has happened)."""
        self._wake.set()

    def owned(self) -> list[int]:
        return sorted(self.runners)

    def lag_sources(self) -> tuple[list[int], int]:
        """The owned partitions whose lag only their durable knows, and what the others
        (dozing: nothing outstanding on the server but what we hold) hold."""
        awake = sorted(p for p, r in self.runners.items() if not r.dozing)
        held = sum(r.buffered for r in self.runners.values() if r.dozing)
        return awake, held
