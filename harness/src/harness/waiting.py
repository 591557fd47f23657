"""Waiting for something to happen: the one polling helper of tests, harness and benchmarks.

    status = eventually(read_status, 30, "the group to settle", until=is_settled)

`eventually` calls `check()` every `interval` seconds until `until(value)` holds (by
default: until the value is truthy) and returns that value. When `timeout` runs out it
raises `WaitTimeout`, whose message names what it waited for and the last value `check()`
returned (or the last exception it raised, of the types in `retry_on`): a failure shows
the state things were stuck in, not just "timed out". `eventually_async` is the same for
a check that is a coroutine function.

Let `check` return the state and `until` judge it (rather than one lambda returning a
bool), so that the last observed state is worth reading; `describe` renders it for the
message (default `repr`; e.g. the tail of a log).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")

# Long states (a 128-partition status, a member's log) are cut here in the message; the
# whole last value stays on the exception (`WaitTimeout.last`).
MAX_SHOWN = 4000


class WaitTimeout(AssertionError, TimeoutError):
    """`eventually` ran out of time.

    An AssertionError, so pytest reports a failed expectation; also a TimeoutError, which
    the hand-written loops it replaces raised, so code catching that still does.
    """

    def __init__(self, what: str, timeout: float, last: object, shown: str) -> None:
        super().__init__(
            f"timed out after {timeout:g} s waiting for {what}; last observed: {shown}"
        )
        self.what = what
        self.timeout = timeout
        self.last = last


class _Poll(Generic[T]):
    """What both twins share: the deadline, the last observation, the message."""

    def __init__(self, timeout: float, what: str, describe: Callable[[T], str]) -> None:
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.what = what
        self.describe = describe
        self.last: tuple[T] | BaseException | None = None  # a value (boxed) or an exception

    def pause(self, interval: float) -> float:
        """Seconds to sleep before the next check; raises WaitTimeout once time is up.

        The last sleep ends at the deadline, so the last check runs at the deadline.
        """
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise self.timed_out() from (
                self.last if isinstance(self.last, BaseException) else None
            )
        return min(interval, remaining)

    def timed_out(self) -> WaitTimeout:
        if isinstance(self.last, tuple):
            last: object = self.last[0]
            shown = self.describe(self.last[0])
        else:
            last = self.last
            shown = f"{type(last).__name__}: {last}"
        if len(shown) > MAX_SHOWN:
            shown = shown[:MAX_SHOWN] + f"... ({len(shown) - MAX_SHOWN} more characters)"
        return WaitTimeout(self.what, self.timeout, last, shown)


def eventually(
    check: Callable[[], T],
    timeout: float,
    what: str,
    *,
    until: Callable[[T], object] = bool,
    interval: float = 0.1,
    retry_on: tuple[type[Exception], ...] = (),
    describe: Callable[[T], str] = repr,
) -> T:
    """Call `check()` until `until(value)` holds, and return that value.

    `what` completes "waiting for ...". Exceptions of the `retry_on` types count as "not
    yet" (e.g. a server that does not answer yet); any other exception propagates at
    once. On timeout: WaitTimeout with the last value (through `describe`) or exception.
    `check` runs at least once, and no sleep runs past the deadline: the last check runs
    at the deadline (unless the one before ended after it).
    """
    poll = _Poll(timeout, what, describe)
    while True:
        try:
            value = check()
        except retry_on as exc:
            poll.last = exc
        else:
            if until(value):
                return value
            poll.last = (value,)
        time.sleep(poll.pause(interval))


async def eventually_async(
    check: Callable[[], Awaitable[T]],
    timeout: float,
    what: str,
    *,
    until: Callable[[T], object] = bool,
    interval: float = 0.1,
    retry_on: tuple[type[Exception], ...] = (),
    describe: Callable[[T], str] = repr,
) -> T:
    """`eventually` for a check that is a coroutine function (awaited on every poll)."""
    poll = _Poll(timeout, what, describe)
    while True:
        try:
            value = await check()
        except retry_on as exc:
            poll.last = exc
        else:
            if until(value):
                return value
            poll.last = (value,)
        await asyncio.sleep(poll.pause(interval))
