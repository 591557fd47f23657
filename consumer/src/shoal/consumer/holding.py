"""How many fetched messages a member may hold: about a second of its own throughput.

A member holds what its pulls brought until a handler slot takes it. Holding too little
starves the pipeline: with one member owning 128 partitions, a fixed budget of 1,024 left
each pull ~8 messages, and a noop member read at 0.59x a plain consumer (0.85x with
8,192). Holding too much is as bad for slow handlers: a held message runs its ack_wait
on the server while it waits, and the worker must keep it alive with in-progress acks.

So the budget follows the member's measured settle rate: `hold_seconds` of it (a second
by default, well inside any ack_wait), never below `floor` (one idle pull per owned
partition plus a batch, or nothing could pull) nor above `ceiling` (max_buffered, the
memory bound). A fast handler gets a deep buffer, a slow one a shallow one, without a
setting to tune. The rate is an exponentially weighted average over `interval` windows,
so one quiet window does not collapse the budget.

A window also ends early, once the member has settled its whole budget in it (and at
least `min_window` has passed): the budget is then too small by far, at least
`interval / elapsed` times, and waiting out the interval would keep a member that
starts on a backlog at the floor (576 messages for 128 partitions) for its first quarter
second. With a noop handler that was a third of a 50,000-message drain.
"""

from __future__ import annotations

# A partition's own budget (the same rule, per partition): half a second of its settle
# rate. With a noop handler one member's 128 partitions settle some 500 messages a second
# each, hold up to fetch_batch (256) and pull about half of it at a time (a plain reader
# pulls 256); with a 20 ms handler and 1,000 projects, some 100 each, and they keep the
# floor (64). Half a second, not a second: at a second the I/O-bound partitions would
# hold 128 or more each, and the first to pull would take the member's budget from the
# others.
PARTITION_HOLD_SECONDS = 0.5


class HoldBudget:
    def __init__(
        self,
        ceiling: int,
        *,
        hold_seconds: float = 1.0,
        interval: float = 0.25,
        min_window: float = 0.02,
    ) -> None:
        self.ceiling = ceiling
        self.hold_seconds = hold_seconds
        self.interval = interval
        self.min_window = min_window
        self.budget = 0  # the last limit given
        self.rate = 0.0  # messages settled per second, smoothed
        self._count = 0
        self._mark: float | None = None

    def settled(self) -> None:
        self._count += 1

    def limit(self, floor: int, now: float) -> int:
        """The budget at monotonic time `now`, given the floor the caller needs."""
        if self._mark is None:
            self._mark = now
        elif (elapsed := now - self._mark) >= self.interval or (
            self._count >= self.budget and elapsed >= self.min_window
        ):
            window = self._count / elapsed
            # Half the weight on the newest window: the budget doubles within a few
            # windows when a backlog arrives, and halves as fast when it is gone.
            self.rate = window if self.rate == 0.0 else 0.5 * self.rate + 0.5 * window
            self._count = 0
            self._mark = now
        wanted = int(self.rate * self.hold_seconds)
        self.budget = max(floor, min(self.ceiling, wanted))
        return self.budget
