"""A member's share of its group's rate limit (spec.nats.consumer.maxMessagesPerSecond).

The group as a whole starts at most `limit` handler runs a second. Each member takes the
share of the partitions it consumes, `limit x owned / partitions` (Worker.share_rate,
updated on every ownership change): no partition is consumed by two members, so the
shares never add up to more than the limit, and they follow scale-ups, scale-downs and
hand-overs without the members talking to each other.

`RateLimiter` is a token bucket: tokens accrue at `rate` a second, up to a small burst
(`BURST_SECONDS` of the rate, at least one token), and each handler run takes one. Who
finds none waits in line, and the line is served in arrival order (the dispatcher's lanes
wait here before they take a project, dispatch.py, so the ready projects are served in
their order too). Only the head of the line sleeps; the others wait on a future each, so
a long line costs nothing per token but one wake-up.

The rate can change at any time (set_rate): tokens accrued so far are kept (up to the new
burst), and the head sees the new rate within MAX_NAP at the latest. Rate 0 (a member that
owns nothing) hands out nothing until it changes.

Pure logic but for `sleep` (asyncio.sleep) and `clock` (time.monotonic), both injectable
so that tests run it on a fake clock.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable

__all__ = ["BURST_SECONDS", "MAX_NAP", "RateLimiter"]

# The burst: this much of the rate may be taken at once after a quiet spell. Small, so
# that a 10 s window never sees more than the limit plus 0.5 %; large enough to absorb
# the event loop's late wake-ups (tokens that accrue while the head oversleeps are kept
# up to the burst, so a late wake-up costs no rate).
BURST_SECONDS = 0.05
# The head of the line never sleeps longer than this in one go: a raised rate (the member
# took partitions) applies within it, and a member at rate 0 checks this often.
MAX_NAP = 0.1
# Tokens are floats: 0.01 s at 100/s may earn 0.9999999999999. That much short of a token
# counts as one (rather than a nap of 1e-15 s, which a clock at 1,000 s cannot even add).
EPSILON = 1e-9
# ...and no nap is shorter than this.
MIN_NAP = 1e-6


class RateLimiter:
    __slots__ = (
        "_clock",
        "_sleep",
        "_stamp",
        "_waiters",
        "burst_seconds",
        "capacity",
        "rate",
        "throttled_at",
        "tokens",
    )

    def __init__(
        self,
        rate: float,
        *,
        burst_seconds: float = BURST_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._clock = clock
        self._sleep = sleep
        self.burst_seconds = burst_seconds
        self.rate = 0.0
        self.capacity = 1.0
        # Starts empty: a member that starts (or takes partitions) earns its burst first,
        # so that a scale-up adds no burst to the group's rate.
        self.tokens = 0.0
        self._stamp = clock()
        self._waiters: deque[asyncio.Future[None]] = deque()
        # When a taker last had to wait (the stall check: Worker.check_stalls).
        self.throttled_at = -math.inf
        self.set_rate(rate)

    @property
    def waiting(self) -> int:
        """Takers in line now."""
        return len(self._waiters)

    def set_rate(self, rate: float) -> None:
        """Tokens a second from now on (what accrued so far at the old rate is kept, up
        to the new burst)."""
        if not math.isfinite(rate) or rate < 0:
            raise ValueError(f"a rate must be a finite number >= 0, not {rate!r}")
        self._refill(self._clock())
        self.rate = rate
        self.capacity = max(1.0, rate * self.burst_seconds)
        self.tokens = min(self.tokens, self.capacity)

    def _refill(self, now: float) -> None:
        elapsed = now - self._stamp
        if elapsed > 0:
            self.tokens = min(self.capacity, self.tokens + elapsed * self.rate)
            self._stamp = now

    def try_take(self) -> bool:
        """Take a token if one is free now and nobody is in line (who came first is
        served first); False otherwise, and nothing is taken."""
        if self._waiters:
            return False
        self._refill(self._clock())
        if self.tokens >= 1.0 - EPSILON:
            self.tokens = max(0.0, self.tokens - 1.0)
            return True
        return False

    def refund(self) -> None:
        """Give back a token that was taken and not used (up to the burst)."""
        self.tokens = min(self.capacity, self.tokens + 1.0)

    def delay(self) -> float:
        """Seconds until the next token, at the current rate (inf at rate 0)."""
        self._refill(self._clock())
        if self.tokens >= 1.0 - EPSILON:
            return 0.0
        if self.rate <= 0:
            return math.inf
        return (1.0 - self.tokens) / self.rate

    async def take(self) -> None:
        """Take a token, waiting in line for it behind those who asked before."""
        if self.try_take():
            return
        waiters = self._waiters
        me: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(me)
        self.throttled_at = self._clock()
        try:
            if waiters[0] is not me:
                # The one ahead resolves this when it leaves the line (finally, below).
                await me
            while True:
                wait = self.delay()
                if wait == 0.0:
                    self.tokens = max(0.0, self.tokens - 1.0)
                    return
                await self._sleep(min(max(wait, MIN_NAP), MAX_NAP))
        finally:
            if waiters and waiters[0] is me:
                waiters.popleft()
                if waiters and not waiters[0].done():
                    waiters[0].set_result(None)  # the next in line is the head now
            else:
                # Cancelled while in line (not the head): leave it.
                try:
                    waiters.remove(me)
                except ValueError:
                    pass
