"""The rate limiter (shoal.consumer.ratelimit) on a fake clock, alone and in the dispatcher.

Exact where a token bucket is exact: tokens at k / rate, a burst of BURST_SECONDS of the
rate at most, takers served in arrival order, rate changes applied within MAX_NAP. The
group-wide limit with real members is proven in test_ratelimit_group.py.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.consumer.dispatch import SETTLED, Dispatcher, Held, Outcome, ProjectQueue
from shoal.consumer.ratelimit import BURST_SECONDS, MAX_NAP, RateLimiter


class Clock:
    """A monotonic clock that moves only when told, and a sleep that moves it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.naps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        assert seconds > 0, seconds
        self.naps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


def limiter(rate: float, clock: Clock, **kwargs: Any) -> RateLimiter:
    return RateLimiter(rate, clock=clock, sleep=clock.sleep, **kwargs)


# -- the bucket ------------------------------------------------------------------------


def test_starts_empty_and_earns_one_token_per_interval() -> None:
    clock = Clock()
    lim = limiter(100, clock)
    assert not lim.try_take()  # a member earns its first token before it runs anything
    assert lim.delay() == pytest.approx(0.01)
    clock.now += 0.01
    assert lim.try_take()
    assert not lim.try_take()
    clock.now += 0.005
    assert not lim.try_take()
    clock.now += 0.005
    assert lim.try_take()


def test_the_burst_is_small_and_at_least_one() -> None:
    clock = Clock()
    lim = limiter(1000, clock)
    clock.now += 3600  # an hour idle earns no more than the burst
    taken = 0
    while lim.try_take():
        taken += 1
    assert taken == int(1000 * BURST_SECONDS) == 50
    slow = limiter(0.5, clock)  # below one token per burst: the burst is one token
    clock.now += 3600
    assert slow.try_take() and not slow.try_take()


def test_a_new_rate_keeps_what_was_earned_up_to_its_burst() -> None:
    clock = Clock()
    lim = limiter(100, clock)
    clock.now += 0.035  # 3.5 tokens at 100/s
    lim.set_rate(1000)
    assert lim.tokens == pytest.approx(3.5)
    clock.now += 0.001  # one more at 1000/s
    assert lim.tokens == pytest.approx(3.5)  # (only counted when looked at)
    assert lim.delay() == 0.0 and lim.tokens == pytest.approx(4.5)
    lim.set_rate(10)  # burst 1 at 10/s: what was earned is cut to it
    assert lim.tokens == pytest.approx(1.0)


def test_rate_zero_hands_out_nothing_until_it_changes() -> None:
    clock = Clock()
    lim = limiter(0, clock)
    clock.now += 100
    assert not lim.try_take()
    assert lim.delay() == math.inf
    lim.set_rate(50)
    clock.now += 0.02
    assert lim.try_take()


@pytest.mark.parametrize("rate", [-1.0, math.nan, math.inf])
def test_a_rate_must_be_finite_and_not_negative(rate: float) -> None:
    with pytest.raises(ValueError, match="finite number >= 0"):
        RateLimiter(rate)
    with pytest.raises(ValueError, match="finite number >= 0"):
        RateLimiter(1).set_rate(rate)


def test_a_refund_is_capped_at_the_burst() -> None:
    clock = Clock()
    lim = limiter(100, clock)  # burst 5
    clock.now += 1
    assert lim.try_take()
    lim.refund()
    lim.refund()
    assert lim.tokens == pytest.approx(5.0)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["advance", "take", "rate", "refund"]),
            st.floats(0, 2, allow_nan=False),
            st.floats(0, 5000, allow_nan=False),
        ),
        max_size=200,
    )
)
def test_no_window_takes_more_than_its_rate_plus_one_burst(
    steps: list[tuple[str, float, float]],
) -> None:
    """Whatever the order of time passing, takes, rate changes and refunds: from any
    moment on, what was taken minus what was given back is at most what the rates in
    force earned since, plus the tokens held at that moment (never more than a burst)."""
    clock = Clock()
    lim = limiter(100, clock)
    marks: list[tuple[int, float]] = []  # (net takes so far, tokens earnable so far)
    net = 0
    earned = 0.0
    biggest_burst = lim.capacity
    for kind, seconds, value in steps:
        marks.append((net, earned))
        if kind == "advance":
            earned += seconds * lim.rate
            clock.now += seconds
        elif kind == "take":
            for _ in range(int(value) % 64):
                if lim.try_take():
                    net += 1
        elif kind == "rate":
            lim.set_rate(value)
            biggest_burst = max(biggest_burst, lim.capacity)
        else:
            lim.refund()
            net -= 1
        assert 0.0 <= lim.tokens <= lim.capacity + 1e-9
    for net0, earned0 in marks:
        assert net - net0 <= (earned - earned0) + biggest_burst + 1e-6


# -- waiting in line -------------------------------------------------------------------


async def test_takers_are_served_in_arrival_order_one_interval_apart() -> None:
    clock = Clock()
    lim = limiter(100, clock)
    served: list[tuple[int, float]] = []

    async def taker(i: int) -> None:
        await lim.take()
        served.append((i, clock.now))

    await asyncio.gather(*(taker(i) for i in range(20)))
    assert [i for i, _ in served] == list(range(20))
    start = 1000.0
    for k, (_, at) in enumerate(served):
        assert at == pytest.approx(start + (k + 1) * 0.01)
    assert lim.waiting == 0
    assert start <= lim.throttled_at <= start + 0.01  # when the last taker joined the line


async def test_nobody_jumps_the_line() -> None:
    """A token that comes free while others wait goes to the first of them, not to a
    try_take (the dispatcher's fast path) of somebody who just arrived."""
    clock = Clock()
    lim = limiter(100, clock)
    first = asyncio.ensure_future(lim.take())
    await asyncio.sleep(0)  # first is in line, its head asleep
    assert lim.waiting == 1
    clock.now += 1  # plenty of tokens now
    assert not lim.try_take()
    await first
    assert lim.try_take()


async def test_a_raised_rate_applies_within_one_nap() -> None:
    clock = Clock()
    lim = limiter(1, clock)  # one token a second
    taken = asyncio.ensure_future(lim.take())
    await asyncio.sleep(0)
    assert clock.naps == [MAX_NAP]  # the head never sleeps longer than MAX_NAP
    lim.set_rate(1000)
    await taken
    # Woken after its nap, it finds what the new rate earned meanwhile.
    assert clock.now == pytest.approx(1000 + MAX_NAP)


async def test_rate_zero_keeps_the_line_waiting_until_a_share_comes() -> None:
    clock = Clock()
    lim = limiter(0, clock)
    taken = asyncio.ensure_future(lim.take())
    for _ in range(50):
        await asyncio.sleep(0)
    assert not taken.done() and clock.now == pytest.approx(1000 + 50 * MAX_NAP, rel=1e-3)
    lim.set_rate(100)
    await taken


@pytest.mark.parametrize("leaver", [0, 3, 9])
async def test_a_cancelled_taker_leaves_the_line_and_the_rest_go_on_in_order(
    leaver: int,
) -> None:
    clock = Clock()
    lim = limiter(100, clock)
    served: list[int] = []

    async def taker(i: int) -> None:
        await lim.take()
        served.append(i)

    tasks = [asyncio.ensure_future(taker(i)) for i in range(10)]
    await asyncio.sleep(0)
    assert lim.waiting == 10
    tasks[leaver].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert served == [i for i in range(10) if i != leaver]
    assert lim.waiting == 0
    # The leaver took nothing: nine tokens over nine intervals.
    assert clock.now == pytest.approx(1000 + 9 * 0.01)


async def test_a_head_woken_and_cancelled_in_the_same_turn_passes_the_line_on() -> None:
    clock = Clock()
    lim = limiter(100, clock)
    a = asyncio.ensure_future(lim.take())
    b = asyncio.ensure_future(lim.take())
    c = asyncio.ensure_future(lim.take())
    await asyncio.sleep(0)
    # b is resolved (made head) as a leaves with its token; cancelled before it runs.
    await a
    b.cancel()
    await asyncio.gather(b, c, return_exceptions=True)
    assert b.cancelled() and c.done() and not c.cancelled()
    assert lim.waiting == 0


async def test_a_long_run_keeps_the_rate_exactly() -> None:
    """20,000 takes by 50 takers at 2,000/s: 10 s, and no 1 s window above 2,000 plus
    the burst (100)."""
    clock = Clock()
    lim = limiter(2000, clock)
    stamps: list[float] = []

    async def taker() -> None:
        for _ in range(400):
            await lim.take()
            stamps.append(clock.now)

    await asyncio.gather(*(taker() for _ in range(50)))
    assert len(stamps) == 20_000
    assert stamps[-1] - 1000 == pytest.approx(10.0, rel=1e-6)
    stamps.sort()
    j = 0
    for i, t in enumerate(stamps):
        while stamps[j] <= t - 1.0:
            j += 1
        assert i - j + 1 <= 2000 + 2000 * BURST_SECONDS


# -- in the dispatcher -----------------------------------------------------------------


class Partition:
    """A dispatch.Source that records what ran."""

    def __init__(self, partition: int = 0) -> None:
        self.partition = partition
        self.stopping = False
        self.inflight = 0
        self.projects: dict[str, ProjectQueue] = {}
        self.done: list[tuple[str, int]] = []

    def settled(self, held: Held) -> None:
        self.done.append((held.project, held.seq))

    def went_idle(self) -> None:
        pass


async def wait_for(check: Any, clock: Clock, what: str) -> None:
    for _ in range(100_000):
        if check():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not {what} (fake clock at {clock.now - 1000:.3f} s)")


async def test_the_dispatcher_runs_at_the_rate_in_ready_order_and_project_order() -> None:
    clock = Clock()
    lim = limiter(100, clock)
    started: list[tuple[float, str, int]] = []

    async def execute(source: Any, held: Held) -> Outcome | float:
        started.append((clock.now, held.project, held.seq))
        await asyncio.sleep(0)
        return SETTLED

    dispatcher = Dispatcher(execute, max_concurrency=8, limiter=lim)
    source = Partition()
    seq = 0
    for _ in range(5):
        for p in range(10):
            seq += 1
            dispatcher.submit(source, Held(None, f"p{p}", seq, 1, 0.0))
    dispatcher.start()
    try:
        await wait_for(lambda: len(source.done) == 50, clock, "all 50 run")
    finally:
        await dispatcher.stop()
    # One start per token: 50 at 100/s, the first after one interval.
    times = [t - 1000 for t, _, _ in started]
    assert times == pytest.approx([0.01 * (k + 1) for k in range(50)])
    # Each project's messages in stream order; the projects round-robin in ready order.
    for p in range(10):
        seqs = [s for _, proj, s in started if proj == f"p{p}"]
        assert seqs == sorted(seqs)
    assert [proj for _, proj, _ in started[:10]] == [f"p{p}" for p in range(10)]


async def test_a_stopping_source_needs_no_token_and_a_spare_one_goes_back() -> None:
    """What is left for a hand-over is skipped without a token (a member whose share is
    0 skips it at all); a lane that got a token for a project that is then left to its
    hand-over gives it back when nothing else is ready."""
    clock = Clock()
    lim = limiter(0, clock)  # owns nothing now
    ran: list[int] = []

    async def execute(source: Any, held: Held) -> Outcome | float:
        ran.append(held.seq)
        return SETTLED

    dispatcher = Dispatcher(execute, max_concurrency=2, limiter=lim)
    leaving = Partition(1)
    for seq in range(5):
        dispatcher.submit(leaving, Held(None, f"p{seq}", seq, 1, 0.0))
    leaving.stopping = True
    dispatcher.start()
    try:
        await wait_for(lambda: not dispatcher._ready, clock, "the ready queue emptied")
        assert ran == [] and lim.waiting == 0
        # A token for a project whose source stops while the lane waits for it.
        lim.set_rate(10)
        staying = Partition(2)
        dispatcher.submit(staying, Held(None, "x", 100, 1, 0.0))
        await wait_for(lambda: lim.waiting == 1, clock, "a lane in line")
        staying.stopping = True
        await wait_for(lambda: lim.waiting == 0, clock, "the lane served")
        await wait_for(lambda: not dispatcher._ready, clock, "the ready queue emptied")
        for _ in range(10):
            await asyncio.sleep(0)
        assert ran == []
        assert lim.tokens == pytest.approx(1.0)  # given back
    finally:
        await dispatcher.stop()
