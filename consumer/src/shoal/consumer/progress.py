"""Whether an owned partition makes progress: the member's stall check.

Liveness and readiness prove that the event loop runs; they do not prove that messages
move. A partition is **stalled** when it has work (messages pending in its durable, or
held by this member) and has made no progress (no message arrived, no pull request was
answered, no message was settled; while it holds messages, only a handler's end counts,
PartitionRunner.progress_mark) for `stall_after` seconds; a handler still running
within handlerTimeoutSeconds, a retry's backoff and a takeover's wait count as progress
under way. Whatever the cause (a
bug of ours, a pull budget spent for good, a runner waiting on something that never
comes), the member says so once, exports it, reports it to the leader through its
member key, and turns unready; the leader moves the partition to another member
(election.py, assignor.relieve_stalls). A member that stays stalled much longer than
that is wedged, and its liveness probe restarts it (ready.py).

This module is the pure decision; the worker feeds it counters it keeps anyway (no
clock read per message).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["WEDGED_AFTER_STALLS", "Change", "Progress"]

# A member whose partition stays stalled this many stall_after periods (the leader should
# have moved it after one, plus a few seconds) is wedged: liveness fails, the pod restarts.
WEDGED_AFTER_STALLS = 3


class Change(Enum):
    STALLED = "stalled"
    RECOVERED = "recovered"


@dataclass
class Progress:
    """One owned partition's progress, as the last checks saw it."""

    mark: tuple[int, ...] = ()  # the counters that move with progress, at the last change
    since: float = 0.0  # when they last moved (or the partition last had no work)
    stalled_at: float | None = None  # when it was found stalled; None while it is not
    working: bool = False  # it had work at the last check

    def observe(
        self, mark: tuple[int, ...], has_work: bool, now: float, stall_after: float
    ) -> Change | None:
        """Take one check's counters; say whether the partition just stalled or recovered."""
        if mark != self.mark or not has_work or not self.working:
            # Progress, or no work (idle is not stalled), or work just appeared: the
            # clock starts now.
            self.working = has_work
            self.mark = mark
            self.since = now
            if self.stalled_at is not None:
                self.stalled_at = None
                return Change.RECOVERED
            return None
        if self.stalled_at is None and now - self.since >= stall_after:
            self.stalled_at = now
            return Change.STALLED
        return None

    def stalled_for(self, now: float) -> float:
        """How long without progress, if it is stalled (0 otherwise)."""
        return now - self.since if self.stalled_at is not None else 0.0
