"""The dispatcher (dispatch.py) alone: how many lanes a burst of ready projects wakes.

The ordering, retry and hand-over guarantees are proven against a real server in
test_ordering.py and the hand-over tests; these check the scheduling in between."""

from __future__ import annotations

import asyncio
from typing import Any

from shoal.consumer.dispatch import SETTLED, Dispatcher, Held, Outcome, ProjectQueue


class Partition:
    """A dispatch.Source that only counts."""

    def __init__(self) -> None:
        self.partition = 0
        self.stopping = False
        self.inflight = 0
        self.projects: dict[str, ProjectQueue] = {}
        self.done: list[int] = []

    def settled(self, held: Held) -> None:
        self.done.append(held.seq)

    def went_idle(self) -> None:
        pass


def burst(dispatcher: Dispatcher, source: Partition, projects: int, each: int = 1) -> None:
    seq = 0
    for _ in range(each):
        for p in range(projects):
            seq += 1
            dispatcher.submit(source, Held(None, f"p{p}", seq, 1, 0.0))


async def run_until(source: Partition, count: int) -> None:
    for _ in range(10_000):
        if len(source.done) >= count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{len(source.done)} of {count} done")


async def test_awaiting_handlers_of_a_burst_all_run_at_once() -> None:
    running = 0
    most = 0
    release = asyncio.Event()

    async def execute(source: Any, held: Held) -> Outcome | float:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await release.wait()
        running -= 1
        return SETTLED

    dispatcher = Dispatcher(execute, max_concurrency=50)
    dispatcher.start()
    source = Partition()
    try:
        await asyncio.sleep(0)  # the lanes are idle
        burst(dispatcher, source, projects=80)
        for _ in range(20):
            await asyncio.sleep(0)
        assert most == 50, "every lane takes a project of the burst"
        release.set()
        await run_until(source, 80)
    finally:
        await dispatcher.stop()


async def test_handlers_that_never_await_leave_the_other_lanes_asleep() -> None:
    async def execute(source: Any, held: Held) -> Outcome | float:
        return SETTLED

    dispatcher = Dispatcher(execute, max_concurrency=50)
    dispatcher.start()
    source = Partition()
    loop = asyncio.get_running_loop()
    # Waking a task is a callback on the loop (its future's done callback).
    callbacks = 0
    call_soon = loop.call_soon

    def counting_call_soon(*args: Any, **kwargs: Any) -> Any:
        nonlocal callbacks
        callbacks += 1
        return call_soon(*args, **kwargs)

    try:
        await asyncio.sleep(0)
        loop.call_soon = counting_call_soon  # type: ignore[method-assign,assignment]
        seq = 0
        for _ in range(10):  # ten reads of 40 messages, of 40 projects, each
            for p in range(40):
                seq += 1
                dispatcher.submit(source, Held(None, f"p{p}", seq, 1, 0.0))
            await asyncio.sleep(0)
        await run_until(source, 400)
        # A handful per read: one lane woken runs them all. Waking a lane per ready
        # project took more than 40 per read, and all but one found nothing to run.
        assert callbacks <= 10 * 5
    finally:
        loop.call_soon = call_soon  # type: ignore[method-assign]
        await dispatcher.stop()


async def test_one_project_runs_in_order_whatever_wakes() -> None:
    async def execute(source: Any, held: Held) -> Outcome | float:
        await asyncio.sleep(0)
        return SETTLED

    dispatcher = Dispatcher(execute, max_concurrency=8)
    dispatcher.start()
    source = Partition()
    try:
        burst(dispatcher, source, projects=3, each=20)
        await run_until(source, 60)
        for p in range(3):
            seqs = [s for s in source.done if (s - 1) % 3 == p]
            assert seqs == sorted(seqs)
    finally:
        await dispatcher.stop()


async def test_a_lane_that_ends_unexpectedly_is_replaced_and_its_message_runs_again(
    caplog: Any,
) -> None:
    """A cancel that gets past the lane's bookkeeping (nobody fenced it) ends the lane:
    one lane fewer for good, and the project it ran waited behind it forever. The
    dispatcher replaces the lane and runs the project's head again."""
    runs: dict[int, int] = {}

    async def execute(source: Any, held: Held) -> Outcome | float:
        runs[held.seq] = runs.get(held.seq, 0) + 1
        if held.seq == 1 and runs[1] == 1:
            raise asyncio.CancelledError  # as if the process were stopping
        return SETTLED

    dispatcher = Dispatcher(execute, max_concurrency=1)
    dispatcher.start()
    source = Partition()
    try:
        burst(dispatcher, source, projects=3)
        await run_until(source, 3)
        assert sorted(source.done) == [1, 2, 3]
        assert runs[1] == 2
        assert "Dispatch lane 0 was cancelled unexpectedly; replacing it" in caplog.text
        assert len(dispatcher._lanes) == 1 and not dispatcher._lanes[0].done()
    finally:
        await dispatcher.stop()
