"""When a pull request counts as lost (partition.RequestWatch): only on evidence.

A stand-in connection object gives the two facts the watch reads (connected, reconnect
count); the loop and its timers are real, with short expiries.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from shoal.consumer.pull import AnswerClock, RequestWatch


@dataclass
class Connection:
    is_connected: bool = True
    stats: dict[str, int] = field(default_factory=lambda: {"reconnects": 0})


@pytest.fixture
def fast_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RequestWatch, "LATE_CHECK", 0.05)
    monkeypatch.setattr(RequestWatch, "ANSWERED_MARGIN", 0.1)
    monkeypatch.setattr(RequestWatch, "GIVE_UP_AFTER", 0.6)


async def _watch(nc: Connection, answers: AnswerClock) -> tuple[asyncio.Future[str], RequestWatch]:
    loop = asyncio.get_running_loop()
    end: asyncio.Future[str] = loop.create_future()
    return end, RequestWatch(loop, nc, end, 0.05, answers)


@pytest.mark.usefixtures("fast_watch")
async def test_a_late_request_is_not_lost_without_evidence() -> None:
    end, watch = await _watch(Connection(), AnswerClock())
    await asyncio.sleep(0.4)
    assert not end.done(), "given up before the bound with no evidence"
    async with asyncio.timeout(1.0):
        assert await end == "lost"  # the generous bound
    watch.cancel()


@pytest.mark.usefixtures("fast_watch")
async def test_lost_once_a_later_request_was_answered() -> None:
    answers = AnswerClock()
    end, watch = await _watch(Connection(), answers)
    loop = asyncio.get_running_loop()
    # Another request, sent later, expired (408) well after ours was due and we read it:
    # the member is not reading late, so our end is not coming.
    later = loop.time() + 0.3
    answers.answered(later - 0.05, later, "408")
    async with asyncio.timeout(0.3):
        assert await end == "lost"
    watch.cancel()


@pytest.mark.usefixtures("fast_watch")
async def test_an_answer_due_about_when_ours_was_is_no_evidence() -> None:
    answers = AnswerClock()
    end, watch = await _watch(Connection(), answers)
    # Answered, but due within the margin of ours: routes may reorder that much.
    answers.answered(watch.due - 0.05, watch.due + 0.05, "408")
    # A batch end proves only that the server answered after that request was sent.
    answers.answered(watch.due + 0.05, watch.due + 5.0, "batch")
    await asyncio.sleep(0.3)
    assert not end.done()
    watch.cancel()


@pytest.mark.usefixtures("fast_watch")
async def test_lost_after_a_reconnect() -> None:
    nc = Connection()
    end, watch = await _watch(nc, AnswerClock())
    nc.stats["reconnects"] = 1
    async with asyncio.timeout(0.3):
        assert await end == "lost"
    watch.cancel()


def test_the_clock_only_moves_forward() -> None:
    answers = AnswerClock()
    answers.answered(10.0, 10.3, "408")
    answers.answered(5.0, 5.3, "408")
    answers.answered(11.0, 11.3, "batch")
    assert answers.upto == 11.0
