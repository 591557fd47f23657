"""Waiting quietly for a server that is gone: capped exponential backoff, and a log line
at most every so often per cause.

A member whose etcd (or NATS) is down can do nothing useful until it is back. Retrying
at a fixed short interval and logging every failure turned each member into a CPU hog
and its log into noise for exactly as long as the outage lasted.
"""

from __future__ import annotations

import logging
import random
import time

# At most one line per cause this often while a failure lasts.
LOG_EVERY = 10.0


class Backoff:
    """Delays that double from `first` up to `cap`, with +-25 % jitter (so that the
    members of a group do not retry in step); `reset()` once the call works again."""

    def __init__(self, first: float, cap: float) -> None:
        self.first = first
        self.cap = cap
        self._next = first

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self.cap)
        return delay * random.uniform(0.75, 1.25)

    def reset(self) -> None:
        self._next = self.first


class QuietLog:
    """Logs a repeated failure once, then at most every `every` seconds, with how many
    times it happened meanwhile; `recovered()` ends the episode."""

    def __init__(self, logger: logging.Logger, every: float = LOG_EVERY) -> None:
        self.logger = logger
        self.every = every
        self._last = -float("inf")
        self._since = 0.0
        self._suppressed = 0

    @property
    def failing(self) -> bool:
        return self._since > 0

    def failed(self, level: int, message: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if not self._since:
            self._since = now
        if now - self._last < self.every:
            self._suppressed += 1
            return
        if self._suppressed:
            message += " (%d more like it in the last %.0f s; failing for %.0f s)"
            args = (*args, self._suppressed, now - self._last, now - self._since)
        self.logger.log(level, message, *args, exc_info=True if exc_info else None)
        self._last = now
        self._suppressed = 0

    def recovered(self) -> float:
        """End the episode; how long it lasted (0 if nothing failed)."""
        lasted = time.monotonic() - self._since if self._since else 0.0
        self._since = 0.0
        self._suppressed = 0
        self._last = -float("inf")
        return lasted
