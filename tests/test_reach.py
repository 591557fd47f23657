"""The member's record of its HTTP handler's reachability (reach.py): one episode, said
when it starts, while it lasts and when it ends, and told to the runtime (pure)."""

from __future__ import annotations

import logging

import pytest

from shoal.consumer.reach import LOG_EVERY, Reach


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
