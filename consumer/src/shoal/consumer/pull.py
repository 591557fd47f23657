"""One pull request of a partition, from its send to its end.

A `PullRequest` owns what it reserved of the member's pull budget (Worker.reserved) and
its end: it gives back what did not arrive whatever way it ends (its batch, a status, a
fence, taken for lost, or a publish that raised), in one place. (The reservation and its
return once lived in two functions, and a publish that raised between them leaked it
for good: the member stopped pulling, its claims held and its probes green.)

`RequestWatch` ends a request as "lost" when its end can no longer come, and
`AnswerClock` is the member's evidence for that (see RequestWatch).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.consumer.worker import Worker

__all__ = ["AnswerClock", "PullRequest", "RequestWatch"]


class PullRequest:
    """A pull request for up to `room` messages, expiring after `expires` seconds.

    Its reply subject (`inbox`, Worker.inbox_for) is its own, so that its statuses reach
    it and no other request. Its messages cannot be told apart that way (a JetStream
    message keeps its own subject): they go by durable to the partition's runner, which
    counts them against its open request; that is exact because a partition never has
    more than one request of this member open on the server (partition.py's docstring).
    """

    __slots__ = ("due", "end", "expires", "inbox", "over", "remaining", "worker")

    def __init__(self, worker: Worker, room: int, expires: float) -> None:
        self.worker = worker
        self.expires = expires
        # When the server ends it at the latest (monotonic), once it is sent.
        self.due = 0.0
        self.inbox = ""
        # Messages it may still bring, reserved in the budget. Each arrival moves one from
        # reserved to held (PartitionRunner.deliver, inline: once per message).
        self.remaining = room
        worker.reserved += room
        # How it ended: "batch", a status ("404", "408", "409", "503", ...), "lost",
        # "fenced" or "unsent".
        self.end: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # The server ended it (its batch, or a status): nothing more can come for it.
        # Not so for an end of ours ("fenced", "lost"): until then it may still deliver.
        self.over = False

    def finish(self, status: str) -> None:
        """It ended (the first end counts)."""
        if not self.end.done():
            self.end.set_result(status)

    def close(self) -> None:
        """Give back what it reserved and did not bring. Idempotent."""
        if self.remaining:
            w = self.worker
            w.reserved -= self.remaining
            self.remaining = 0
            if w.starved:
                w.wake_starved()


def _end_as(end: asyncio.Future[str], status: str) -> None:
    if not end.done():
        end.set_result(status)


class RequestWatch:
    """Ends a pull request as "lost" when its end status cannot come any more.

    The server always ends a request (its batch, or 408 at its expiry) unless the
    connection went away with it, or the server that held it did: in a NATS cluster a
    pull request waits on the durable's leader, and when that node dies the request dies
    with it while our own connection (to another node) stays up. Taking a request for
    lost merely because its end is late is worse than waiting: a member short of CPU
    reads late, and each request it gave up on while the server was still filling it
    brings messages nobody accounted for, so the member reads later still, and held
    messages outlive their ack_wait (redeliveries, duplicates). So a late request is given
    up only on evidence: the connection dropped or reconnected since it was sent, or the
    member has read the answer to a request that the servers ended well after this one
    was due (:attr:`AnswerClock.upto`), so it is not reading late; or after a generous
    bound.
    """

    LATE_CHECK = 1.0
    # How much later than this request's due end another request must have been answered
    # for this one to count as lost (routes between cluster nodes reorder a little).
    ANSWERED_MARGIN = 1.0
    GIVE_UP_AFTER = 15.0

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        nc: Any,
        end: asyncio.Future[str],
        expires: float,
        answers: AnswerClock,
    ) -> None:
        self.loop = loop
        self.nc = nc
        self.end = end
        self.answers = answers
        self.reconnects = nc.stats.get("reconnects", 0)
        self.sent_at = loop.time()
        self.due = self.sent_at + expires
        self.deadline = self.due + self.GIVE_UP_AFTER
        self.timer = loop.call_later(expires + self.LATE_CHECK, self._check)

    def _check(self) -> None:
        if self.end.done():
            return
        dropped = not self.nc.is_connected or self.nc.stats.get("reconnects", 0) != self.reconnects
        outrun = self.answers.upto >= self.due + self.ANSWERED_MARGIN
        if dropped or outrun or self.loop.time() >= self.deadline:
            _end_as(self.end, "lost")
        else:
            self.timer = self.loop.call_later(self.LATE_CHECK, self._check)

    def ended(self, status: str) -> None:
        """The request ended with `status` (not "lost"): the server answered it."""
        self.answers.answered(self.sent_at, self.due, status)

    def cancel(self) -> None:
        self.timer.cancel()


class AnswerClock:
    """The latest time at which, as far as this member has read, a server answered one
    of its pull requests: for an expiry (408) the request's due end, for any other end
    the time the request was sent (the server answered after that). One per member."""

    def __init__(self) -> None:
        self.upto = 0.0

    def answered(self, sent_at: float, due: float, status: str) -> None:
        when = due if status == "408" else sent_at
        if when > self.upto:
            self.upto = when
