"""harness.waiting: poll until a condition holds, or fail with the last observed state."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from harness.waiting import MAX_SHOWN, WaitTimeout, eventually, eventually_async

T = TypeVar("T")


def counter(values: list[T]) -> tuple[Callable[[], T], list[int]]:
    """A check that returns `values` one per call (the last one forever), and its calls."""
    calls = [0]
    it: Iterator[T] = itertools.chain(values, itertools.repeat(values[-1]))

    def check() -> T:
        calls[0] += 1
        return next(it)

    return check, calls


def test_returns_the_first_truthy_value() -> None:
    falsy_then_truthy: list[object] = [None, 0, [], {"ready": True}]
    check, calls = counter(falsy_then_truthy)
    assert eventually(check, 5, "readiness", interval=0.001) == {"ready": True}
    assert calls == [4]


def test_a_true_check_is_called_once_and_never_sleeps() -> None:
    check, calls = counter(["done"])
    started = time.monotonic()
    assert eventually(check, 5, "anything", interval=10) == "done"
    assert calls == [1] and time.monotonic() - started < 1


def test_until_judges_the_value_and_the_value_is_returned() -> None:
    check, _ = counter([1, 2, 3, 4])
    assert eventually(check, 5, "three", until=lambda n: n == 3, interval=0.001) == 3


def test_timeout_fails_with_what_and_the_last_value() -> None:
    check, calls = counter([{"members": 1}, {"members": 2}])
    with pytest.raises(WaitTimeout) as raised:
        eventually(check, 0.1, "3 members", until=lambda s: s["members"] == 3, interval=0.01)
    error = raised.value
    assert isinstance(error, AssertionError) and isinstance(error, TimeoutError)
    assert "waiting for 3 members" in str(error)
    assert "last observed: {'members': 2}" in str(error)
    assert error.last == {"members": 2} and error.what == "3 members"
    assert calls[0] >= 3


def test_describe_renders_the_last_value() -> None:
    log = "starting\n" * 1000 + "still starting"
    with pytest.raises(WaitTimeout, match=r"last observed: \.\.\.still starting$"):
        eventually(
            lambda: log,
            0.05,
            "'ready' in the log",
            until=lambda t: "ready" in t,
            describe=lambda t: "..." + t[-14:],
            interval=0.01,
        )


def test_a_long_last_state_is_cut_in_the_message_but_kept_whole() -> None:
    state = ["x" * 100] * 100
    with pytest.raises(WaitTimeout) as raised:
        eventually(lambda: state, 0.01, "nothing", until=lambda s: False, interval=0.01)
    assert len(str(raised.value)) < MAX_SHOWN + 200
    assert "more characters" in str(raised.value)
    assert raised.value.last == state


def test_timeout_is_kept_and_the_last_check_runs_at_the_deadline() -> None:
    started = time.monotonic()
    # True only from the deadline on: found by the check at the deadline, although the
    # interval is far longer than the timeout (the last sleep is cut to the deadline).
    value = eventually(lambda: time.monotonic() - started >= 0.2, 0.2, "the deadline", interval=5)
    assert value is True
    assert time.monotonic() - started < 1


def test_retry_on_exceptions_count_as_not_yet() -> None:
    attempts = [0]

    def connect() -> str:
        attempts[0] += 1
        if attempts[0] < 3:
            raise ConnectionRefusedError("refused")
        return "connected"

    assert eventually(connect, 5, "a connection", retry_on=(OSError,), interval=0.001) == (
        "connected"
    )
    assert attempts == [3]


def test_the_last_exception_is_reported_and_chained() -> None:
    def connect() -> str:
        raise ConnectionRefusedError("refused")

    with pytest.raises(WaitTimeout) as raised:
        eventually(connect, 0.05, "a connection", retry_on=(OSError,), interval=0.01)
    assert "last observed: ConnectionRefusedError: refused" in str(raised.value)
    assert isinstance(raised.value.__cause__, ConnectionRefusedError)
    assert raised.value.last is raised.value.__cause__


def test_other_exceptions_propagate_at_once() -> None:
    calls = [0]

    def broken() -> bool:
        calls[0] += 1
        raise KeyError("bug")

    with pytest.raises(KeyError):
        eventually(broken, 5, "never", retry_on=(OSError,), interval=0.001)
    assert calls == [1]


async def test_async_returns_the_value_the_check_awaited() -> None:
    check, calls = counter([None, None, "ok"])

    async def acheck() -> object:
        return check()

    assert await eventually_async(acheck, 5, "ok", interval=0.001) == "ok"
    assert calls == [3]


async def test_async_timeout_fails_with_what_and_the_last_value() -> None:
    async def messages_left() -> int:
        return 7

    with pytest.raises(WaitTimeout) as raised:
        await eventually_async(
            messages_left, 0.05, "the stream to drain", until=lambda n: n == 0, interval=0.01
        )
    assert "waiting for the stream to drain; last observed: 7" in str(raised.value)


async def test_async_retry_on_and_describe() -> None:
    attempts = [0]

    async def status() -> dict[str, int]:
        attempts[0] += 1
        if attempts[0] == 1:
            raise OSError("not yet listening")
        return {"left": 3}

    with pytest.raises(WaitTimeout, match=r"last observed: 3 left$"):
        await eventually_async(
            status,
            0.05,
            "nothing left",
            until=lambda s: s["left"] == 0,
            retry_on=(OSError,),
            describe=lambda s: f"{s['left']} left",
            interval=0.01,
        )
    assert attempts[0] >= 2
