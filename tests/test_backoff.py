"""Backoff and QuietLog: how a member waits for a server that is gone."""

from __future__ import annotations

import logging
import time

import pytest

from shoal.clients.backoff import Backoff, QuietLog


def test_backoff_doubles_up_to_its_cap_with_jitter_and_resets() -> None:
    b = Backoff(0.5, 5.0)
    delays = [b.next() for _ in range(8)]
    for delay, nominal in zip(delays, [0.5, 1, 2, 4, 5, 5, 5, 5], strict=True):
        assert 0.75 * nominal <= delay <= 1.25 * nominal
    b.reset()
    assert b.next() <= 0.625


def test_quiet_log_says_a_repeated_failure_once_per_period(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])  # the clock QuietLog reads
    quiet = QuietLog(logging.getLogger("test.quiet"), every=10.0)
    with caplog.at_level(logging.WARNING, logger="test.quiet"):
        for _ in range(25):  # 25 failures, one every 0.5 s: 12.5 s
            quiet.failed(logging.WARNING, "keep-alive failed (%s)", "refused")
            now[0] += 0.5
        assert quiet.failing
        lines = [r.getMessage() for r in caplog.records]
        assert lines[0] == "keep-alive failed (refused)"
        assert len(lines) == 2
        assert "19 more like it in the last 10 s; failing for 10 s" in lines[1]
        assert quiet.recovered() == pytest.approx(12.5)
        assert not quiet.failing
        quiet.failed(logging.WARNING, "keep-alive failed (%s)", "again")
        assert caplog.records[-1].getMessage() == "keep-alive failed (again)"
