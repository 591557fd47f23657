"""harness.cputimeline: who had the CPU when (bench/ramp.py reports it per first second)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from harness.cputimeline import HOST, CpuTimeline


def timeline(times: list[float], member: list[float]) -> CpuTimeline:
    cpu = CpuTimeline()
    cpu.times = times
    cpu.readings = [{"member": m, HOST: 2 * m} for m in member]
    return cpu


def test_cores_between_samples_are_interpolated() -> None:
    cpu = timeline([0.0, 1.0, 2.0], [0.0, 0.5, 1.5])
    assert cpu.cores(0.0, 1.0) == {"member": 0.5, HOST: 1.0}
    assert cpu.cores(0.5, 1.5) == {"member": 0.75, HOST: 1.5}  # 0.25 -> 1.0
    assert cpu.cores(1.0, 2.0)["member"] == 1.0


def test_cores_outside_the_samples_or_of_nothing_are_left_out() -> None:
    cpu = timeline([1.0, 2.0], [0.0, 1.0])
    assert cpu.cores(0.5, 1.5) == {}
    assert cpu.cores(1.5, 2.5) == {}
    assert cpu.cores(2.0, 1.0) == {}


def test_a_name_watched_later_counts_from_its_first_reading() -> None:
    cpu = CpuTimeline()
    cpu.times = [0.0, 1.0, 2.0]
    cpu.readings = [{HOST: 0.0}, {HOST: 1.0, "publisher": 0.2}, {HOST: 2.0, "publisher": 1.2}]
    assert cpu.cores(1.0, 2.0)["publisher"] == 1.0
    assert "publisher" not in cpu.cores(0.0, 0.5)


def test_real_processes_busy_and_idle() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cpu = CpuTimeline()
        cpu.watch("busy", busy.pid)
        cpu.watch("idle", idle.pid)
        cpu.watch("idle", idle.pid)  # (once is enough)
        time.sleep(0.3)  # both started
        start = time.monotonic()
        cpu.sample(start)
        for _ in range(10):
            time.sleep(0.1)
            cpu.sample()
        used = cpu.cores(start, cpu.times[-1])
    finally:
        for process in (busy, idle):
            process.kill()
            process.wait()
    assert cpu.pids["idle"] == [idle.pid]
    assert 0.1 < used["busy"] <= 1.2  # one thread: at most a core (ticks are 10 ms)
    assert used["idle"] < 0.1
    assert used[HOST] >= used["busy"] - 0.1


def test_a_process_that_ended_keeps_its_last_reading() -> None:
    done = subprocess.Popen([sys.executable, "-c", "sum(range(3_000_000))"])
    cpu = CpuTimeline()
    cpu.watch("done", done.pid)
    cpu.sample(0.0)
    done.wait()
    cpu.sample(1.0)  # gone (reaped): nothing to read
    cpu.sample(2.0)
    assert cpu.readings[1]["done"] == cpu.readings[2]["done"]
    assert cpu.cores(1.0, 2.0)["done"] == pytest.approx(0.0)
