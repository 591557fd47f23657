"""The benchmarks' process readings: CPU per thread name, from /proc."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

import pytest

from harness.bench import cpu_seconds, thread_cpu

PR_SET_NAME = 15


def _burn(name: bytes, seconds: float, ready: threading.Event, done: threading.Event) -> None:
    # Named as the kernel sees it (Python's own thread names never reach /proc).
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name, 0, 0, 0)
    ready.set()
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    done.wait(30)  # alive while the test reads it: an ended thread leaves /proc


def test_thread_cpu_names_each_thread_and_sums_to_the_process() -> None:
    ready, done = threading.Event(), threading.Event()
    burner = threading.Thread(target=_burn, args=(b"burner-17", 0.3, ready, done))
    burner.start()
    try:
        assert ready.wait(10)
        deadline = time.monotonic() + 30
        readings = thread_cpu(os.getpid())
        while readings.get("burner-#", 0.0) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
            readings = thread_cpu(os.getpid())
        whole = cpu_seconds(os.getpid())
    finally:
        done.set()
        burner.join(10)
    # Numbers in names are folded: thread "burner-17" counts as "burner-#".
    assert "burner-17" not in readings
    assert 0.25 <= readings["burner-#"] <= whole
    # Every thread is counted once: the parts add up to the process (a few clock ticks
    # apart, the two readings being moments apart).
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert abs(sum(readings.values()) - whole) <= 0.05 + 10 * tick


def test_thread_cpu_of_a_process_that_is_gone_is_an_error() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid has no /proc entry
    with pytest.raises(ProcessLookupError, match=str(child.pid)):
        thread_cpu(child.pid)
