"""Run a member's messages concurrently across projects, one after another within a project.

Ordering is per project (DESIGN "JetStream and the data path"): the messages of one
project run strictly in stream order, each only after the previous one finished; messages
of different projects run side by side, at most `max_concurrency` at a time per member.
A message whose handler failed stays at the head of its project's queue and is retried
there, after a backoff, before any later message of that project; the other projects go
on meanwhile.

The pieces:
- `Held`: one fetched message, from delivery until it is acked, dead-lettered or given
  back; `kept` is when JetStream last heard of it (delivery or in-progress ack).
- `ProjectQueue`: the held messages of one project, in stream order.
- `Dispatcher`: a ready queue of projects whose head may run now, and a fixed pool of
  `max_concurrency` lanes (tasks) taking projects from it. No task is created per message:
  a lane runs a project's head, acks it, puts the project back at the end of the ready
  queue if it has more, and takes the next project.

With a rate limit (spec.nats.consumer.maxMessagesPerSecond: ratelimit.py), a lane takes a
token before it takes a project from the ready queue. A lane waiting for one holds no
project and runs nothing: per-project order is untouched, a hand-over or a pause does not
wait for it (they wait for running handlers only), and the message it will run waits in
its project's queue, where the worker's in-progress acks keep it alive
(Worker.keep_held_alive). Lanes wait in line, so the ready projects are served in their
order. Without a limit the lane pays one `is not None` per message.

What running a message means (the handler, acks, dead letters, fencing) is the caller's
`execute` function; what a partition's queues are for (pulling, hand-over) is the
`Source`'s (partition.PartitionRunner). This module only orders and schedules.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any, Protocol

from shoal.consumer.ratelimit import RateLimiter

log = logging.getLogger(__name__)

# A lane that ran this many messages without waiting (handlers that never await, e.g.
# a noop) lets the event loop run, so that reading from NATS and timers are not starved.
YIELD_EVERY = 64
# Emptied project queues kept for reuse: with fast handlers a project's queue empties, and
# was dropped, after nearly every message (3 % of a noop member's CPU in allocations).
SPARE_QUEUES = 1024


class Held:
    """A fetched message of one project, held until it is settled or given back."""

    __slots__ = (
        "credit",
        "delivered",
        "failures",
        "kept",
        "msg",
        "project",
        "said",
        "seq",
        "settle_failures",
        "since",
        "started",
        "timed_out",
        "unreached",
        "verdict",
    )

    def __init__(self, msg: Any, project: str, seq: int, delivered: int, now: float) -> None:
        self.msg = msg
        self.project = project
        self.seq = seq  # stream sequence
        self.delivered = delivered  # JetStream's delivery count for this delivery
        # Earlier deliveries that were not one attempt each (hand-overs: Keys.handbacks):
        # attempts before this delivery = delivered - 1 - credit.
        self.credit = 0
        self.failures = 0  # handler failures here, retried in place
        self.unreached = 0  # tries that never reached the handler (not attempts)
        self.kept = now  # last time JetStream heard of it (delivery or in-progress ack)
        self.since = now  # when it was delivered here (shoal_oldest_held_seconds)
        self.said = False  # its long wait was logged (Worker.keep_held_alive)
        # What the handler's run decided, until it is carried out: (ACKED, ""),
        # (DEAD_LETTER, reason), (TERMINATED, reason: copied to the dead letters
        # already), (NAKED, delay). None: the handler has not run to a decision yet.
        self.verdict: tuple[str, str] | None = None
        self.settle_failures = 0  # tries to carry out the verdict that failed
        # When its handler started (time.perf_counter), 0 while none runs; and whether the
        # handler timeout's sweep cancelled that run (worker.Worker._watch_handlers).
        self.started = 0.0
        self.timed_out = False


# Held.verdict's kinds (compared with `is`: one object each).
ACKED = "ack"
DEAD_LETTER = "dead-letter"
TERMINATED = "terminate"
NAKED = "nak"
ACK_VERDICT = (ACKED, "")


class Source(Protocol):
    """What the dispatcher needs of a partition (partition.PartitionRunner)."""

    partition: int
    stopping: bool
    inflight: int
    projects: dict[str, ProjectQueue]

    def settled(self, held: Held) -> None:
        """`held` is done with (acked or dead-lettered): its buffer slot is free."""

    def went_idle(self) -> None:
        """No handler of this source runs any more."""


class ProjectQueue:
    __slots__ = ("pending", "project", "running", "scheduled", "source")

    def __init__(self, source: Source, project: str) -> None:
        self.source = source
        self.project = project
        self.pending: deque[Held] = deque()
        self.scheduled = False  # in the ready queue, or waiting for a retry timer
        self.running = False  # a lane runs its head now


class Outcome(Enum):
    """What `execute` made of a message, when it is not a retry: a retry is the delay,
    in seconds, before the head of its project runs again, in place."""

    SETTLED = "settled"  # acked, dead-lettered, or handed to JetStream for redelivery
    ABANDONED = "abandoned"  # fenced or released mid-way: left to the hand-over


SETTLED = Outcome.SETTLED
ABANDONED = Outcome.ABANDONED
# After an unexpected error of execute() itself (a bug): retry the head this much later.
BUG_RETRY_DELAY = 1.0
Execute = Callable[[Any, Held], Awaitable[Outcome | float]]


class Dispatcher:
    def __init__(
        self, execute: Execute, max_concurrency: int, limiter: RateLimiter | None = None
    ) -> None:
        self._execute = execute
        self.max_concurrency = max_concurrency
        # None: no rate limit (and no cost). Fixed for the dispatcher's life; its rate
        # changes (Worker.share_rate), the object does not.
        self.limiter = limiter
        self._ready: deque[ProjectQueue] = deque()
        self._idle: deque[asyncio.Future[None]] = deque()
        self._lanes: list[asyncio.Task[None]] = []
        # lane (task) -> the project whose head it runs now (for fencing, and the
        # handler timeout's sweep: running_heads)
        self._running: dict[asyncio.Task[None], ProjectQueue] = {}
        self._cancelling: set[asyncio.Task[None]] = set()
        self._spare: list[ProjectQueue] = []
        self._waking = False  # a _wake_idle call is due
        self.running = 0
        self._stopping = False
        # lane -> the project it ran last (for a lane that ends unexpectedly: _lane_ended)
        self._last_run: dict[asyncio.Task[None], ProjectQueue] = {}

    def start(self) -> None:
        self._stopping = False
        self._lanes = [self._new_lane(i) for i in range(self.max_concurrency)]

    def _new_lane(self, index: int) -> asyncio.Task[None]:
        task = asyncio.create_task(self._lane(), name=f"dispatch-{index}")
        task.add_done_callback(functools.partial(self._lane_ended, index))
        return task

    def _lane_ended(self, index: int, task: asyncio.Task[None]) -> None:
        """A lane ends only when the dispatcher stops. One that ended otherwise (a bug of
        ours, or a handler's cancel that got past the lane's bookkeeping) is replaced:
        without it the member runs one handler fewer at a time for good, and with one
        lane, none; and the project whose message it ran would wait behind it forever."""
        if self._stopping or index >= len(self._lanes) or self._lanes[index] is not task:
            return
        if task.cancelled() and task.cancelling():
            return  # cancelled by whoever runs us: the process is stopping
        if task.cancelled():
            log.error("Dispatch lane %d was cancelled unexpectedly; replacing it", index)
        else:
            log.error(
                "Dispatch lane %d ended unexpectedly; replacing it",
                index,
                exc_info=task.exception(),
            )
        queue = self._last_run.pop(task, None)
        if (
            queue is not None
            and queue.pending
            and not (queue.running or queue.scheduled or queue.source.stopping)
        ):
            # What it was running when it ended is still its project's head: run it
            # again (nothing else would schedule it).
            self._schedule(queue)
        self._lanes[index] = self._new_lane(index)

    async def stop(self) -> None:
        self._stopping = True
        for task in self._lanes:
            task.cancel()
        await asyncio.gather(*self._lanes, return_exceptions=True)
        self._lanes = []

    def submit(self, source: Source, held: Held) -> None:
        """Queue a fetched message behind the earlier ones of its project."""
        queue = source.projects.get(held.project)
        if queue is None:
            if self._spare:
                queue = self._spare.pop()
                queue.source = source
                queue.project = held.project
            else:
                queue = ProjectQueue(source, held.project)
            source.projects[held.project] = queue
        queue.pending.append(held)
        if not queue.scheduled and not queue.running:
            self._schedule(queue)

    def _schedule(self, queue: ProjectQueue) -> None:
        queue.scheduled = True
        self._ready.append(queue)
        if self._idle and not self._waking:
            self._waking = True
            asyncio.get_running_loop().call_soon(self._wake_idle, None)

    def _wake_idle(self, asker: asyncio.Task[None] | None) -> None:
        """Wake idle lanes for the ready projects, after the current turn of the event
        loop: one for each if `asker`, a lane that took a project and left others
        ready, is still in its handler (the handler awaits: the others need lanes of
        their own); otherwise one, if any project is still ready.

        Not one per project as it becomes ready: a lane whose handler never awaits
        runs on through the ready projects in the same turn, so a read of many
        messages needs one lane woken, not one per message. (A lane woken per
        project cost a future and a task step for 0.4-1 of every message read at once,
        bench/hotpath.py, and nearly all of those lanes found nothing left to run.)
        """
        self._waking = False
        ready = len(self._ready)
        if asker is None or asker not in self._running:
            ready = min(ready, 1)
        idle = self._idle
        while ready and idle:
            waiter = idle.popleft()
            if not waiter.done():
                waiter.set_result(None)
                ready -= 1

    def _retry_due(self, queue: ProjectQueue) -> None:
        queue.scheduled = False
        if queue.pending and not queue.source.stopping:
            self._schedule(queue)

    def cancel_running(self, source: Source) -> int:
        """Cancel the handlers running for `source` now (fenced, or aborted); how many."""
        cancelled = 0
        me = asyncio.current_task()
        for task, running in self._running.items():
            # Not the caller's own task: a handler that raised Fenced is already stopping.
            if running.source is source and task is not me and task not in self._cancelling:
                self._cancelling.add(task)
                task.cancel()
                cancelled += 1
        return cancelled

    def running_heads(self) -> list[tuple[asyncio.Task[None], Source, Held]]:
        """(lane task, its source, the message) for every handler running now."""
        return [
            (task, queue.source, queue.pending[0])
            for task, queue in self._running.items()
            if queue.pending
        ]

    async def _lane(self) -> None:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        assert me is not None
        ready = self._ready
        limiter = self.limiter
        token = False  # this lane holds a token of the limiter it has not used yet
        streak = 0
        while True:
            if not ready:
                if token:
                    # Got one for a project that turned out to be left for its hand-over.
                    assert limiter is not None
                    limiter.refund()
                    token = False
                streak = 0
                waiter: asyncio.Future[None] = loop.create_future()
                self._idle.append(waiter)
                await waiter
                continue
            if limiter is not None and not token:
                # Skip what is left for a hand-over first: it needs no token, and a member
                # whose share is 0 (it owns nothing now) would otherwise wait for ever.
                head = ready[0]
                if head.source.stopping or not head.pending:
                    ready.popleft()
                    head.scheduled = False
                    continue
                if not limiter.try_take():
                    # Wait in line holding nothing (see the module's docstring); then look
                    # at the ready queue again: it may have changed meanwhile.
                    await limiter.take()
                token = True
                continue
            queue = ready.popleft()
            queue.scheduled = False
            source = queue.source
            if source.stopping or not queue.pending:
                continue  # left for the hand-over, which gives unstarted messages back
            token = False  # (spent on this run)
            held = queue.pending[0]
            if ready and self._idle and not self._waking:
                # Others are ready: if this handler awaits, they need lanes of their own.
                self._waking = True
                loop.call_soon(self._wake_idle, me)
            queue.running = True
            source.inflight += 1
            self.running += 1
            self._running[me] = self._last_run[me] = queue
            try:
                outcome = await self._execute(source, held)
                if me in self._cancelling and me.cancelling():
                    # Fenced, and the handler swallowed the cancel (or turned it into an
                    # error that execute handled): take it back. Left standing, the
                    # lane's next fence would find cancelling() at 2, take it for the
                    # dispatcher stopping, and end the lane for good.
                    me.uncancel()
            except asyncio.CancelledError:
                if me not in self._cancelling or me.cancelling() > 1:
                    # The dispatcher (or the process) is stopping, perhaps while a fenced
                    # handler was still cleaning up: swallowing this one would leave a
                    # task that never ends, and asyncio.run would wait for it forever.
                    raise
                # Only our source was fenced: this handler is abandoned, the lane goes on.
                me.uncancel()
                outcome = ABANDONED
            except Exception:
                # execute() handles the handler's and the settling's errors; this is a
                # bug of ours. Retry the message later rather than lose a lane, or
                # leave its project stalled behind it (nothing would reschedule it,
                # and in-progress acks would keep JetStream from redelivering it).
                log.exception("Running a message of partition %d failed", source.partition)
                outcome = BUG_RETRY_DELAY
            finally:
                self._cancelling.discard(me)
                del self._running[me]
                self.running -= 1
                queue.running = False
                source.inflight -= 1
            if outcome is SETTLED:
                queue.pending.popleft()
                source.settled(held)
            if source.inflight == 0 and source.stopping:
                source.went_idle()
            if not queue.pending:
                if source.projects.get(queue.project) is queue:
                    del source.projects[queue.project]
                    # Nothing refers to it now: not scheduled (it was running), no retry
                    # timer (nothing pending), and its source no longer lists it.
                    if not queue.scheduled and len(self._spare) < SPARE_QUEUES:
                        self._spare.append(queue)
            elif outcome is SETTLED:
                if not source.stopping:
                    self._schedule(queue)
            elif not isinstance(outcome, Outcome) and not source.stopping:
                queue.scheduled = True
                loop.call_later(outcome, self._retry_due, queue)
            streak += 1
            if streak >= YIELD_EVERY:
                streak = 0
                await asyncio.sleep(0)
