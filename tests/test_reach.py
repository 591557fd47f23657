"""The member's record of its HTTP handler's reachability (reach.py): one episode, said
when it starts, while it lasts and when it ends, and told to the runtime; and the
worker's wait for it (pure)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from shoal.consumer.dispatch import Held
from shoal.consumer.reach import LOG_EVERY, Reach
from shoal.consumer.worker import UNREACHABLE_RETRY_MAX, Worker, backoff


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_episode_is_said_once_then_every_log_every_and_at_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    told: list[str | None] = []
    reach = Reach(told.append, clock=clock)
    assert reach.ok
    caplog.set_level(logging.INFO, logger="shoal.consumer.reach")

    assert reach.refused("POST u: refused")
    for _ in range(50):  # every message that cannot be sent, and the probe's tries
        assert not reach.refused("POST u: refused")
        assert not reach.refused("POST u: refused", message=False)
    assert not reach.ok and reach.waits == 51
    assert told == ["POST u: refused"]
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["Cannot reach the handler"]

    clock.now += LOG_EVERY
    reach.refused("POST u: refused", message=False)
    assert "Still cannot reach the handler, for 30 s" in caplog.records[-1].getMessage()
    assert told == ["POST u: refused"]  # the same episode, the same reason: nothing new

    reach.refused("POST u: no such name")  # the reason changed: told again
    assert told == ["POST u: refused", "POST u: no such name"]

    clock.now += 12.5
    reach.reached()
    reach.reached()  # (and again: nothing more)
    assert reach.ok and reach.waits == 0
    assert told[-1] is None and len(told) == 3
    assert "accepts connections again, after 42.5 s unreachable (52 message tries" in (
        caplog.records[-1].getMessage()
    )

    assert reach.refused("POST u: refused")  # a new episode
    assert told[-1] == "POST u: refused"


def test_a_listener_that_raises_does_not_fail_the_message_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(why: str | None) -> None:
        raise RuntimeError("etcd client gone")

    reach = Reach(broken)
    assert reach.refused("POST u: refused")
    reach.reached()
    assert reach.ok
    assert "Reporting the handler's reachability failed" in caplog.text


def test_a_message_held_back_for_hours_keeps_a_bounded_backoff() -> None:
    """Worker._unreached's delay doubles from 0.2 s up to 2 s per try: the 1,025th try
    (34 minutes of a sidecar in CrashLoopBackOff) computed 2.0 ** 1024 and raised
    OverflowError, which ended the deliberate wait: the partition stalled, liveness
    restarted the member, and each restart cost the held messages an attempt."""
    worker = SimpleNamespace(_reach=Reach())
    runner = SimpleNamespace(retry_until=0.0)
    held = Held(None, "p", 1, 1, 0.0)
    held.unreached = 5_000
    delay = Worker._unreached(worker, runner, held, "refused")  # type: ignore[arg-type]
    assert delay == UNREACHABLE_RETRY_MAX
    assert runner.retry_until > 0 and worker._reach.waits == 1
    assert backoff(0.5, 10**6, 10.0) == 10.0 and backoff(0.5, 1, 10.0) == 0.5
