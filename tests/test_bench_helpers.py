"""The benchmarks' process readings: CPU per thread name, from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.bench import cpu_seconds, loopback_round_trips, thread_cpu

# A process with one extra thread, named as the kernel sees it (Python's own thread names
# never reach /proc), that burns 0.3 s of CPU and then waits, alive, until stdin closes.
# A child of its own: in the test process, threads that ended earlier count in the
# process's CPU but are no longer listed, so the parts would not add up.
BURNER = textwrap.dedent(
    """
    import ctypes, sys, threading, time

    def burn():
        ctypes.CDLL(None).prctl(15, b"burner-17", 0, 0, 0)  # PR_SET_NAME
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        print("burnt", flush=True)
        sys.stdin.read()

    thread = threading.Thread(target=burn)
    thread.start()
    thread.join()
    """
)


def test_thread_cpu_names_each_thread_and_sums_to_the_process() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "burnt\n"
        readings = thread_cpu(child.pid)
        whole = cpu_seconds(child.pid)
    finally:
        child.communicate(timeout=30)
    # Numbers in names are folded: thread "burner-17" counts as "burner-#".
    assert "burner-17" not in readings
    assert 0.25 <= readings["burner-#"] <= whole
    assert len(readings) >= 2, readings  # the main thread too
    # Every thread is counted once: the parts add up to the process (a few clock ticks
    # apart, the two readings being moments apart).
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert abs(sum(readings.values()) - whole) <= 5 * tick


def test_thread_cpu_of_a_process_that_is_gone_is_an_error() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid has no /proc entry
    with pytest.raises(ProcessLookupError, match=str(child.pid)):
        thread_cpu(child.pid)


def test_loopback_round_trips_measure_a_real_echo_and_leave_no_process() -> None:
    children_before = _children()
    trips = loopback_round_trips(200)
    # A round trip includes its send and, unless the clock is coarse, costs something.
    assert 0 < trips.send_us <= trips.wall_us
    assert trips.cpu_us >= 0
    assert _children() == children_before


def _children() -> set[int]:
    """This process's child processes (each thread's, as the kernel lists them)."""
    tasks = Path("/proc/self/task").glob("*/children")
    return {int(pid) for task in tasks for pid in task.read_text().split()}
