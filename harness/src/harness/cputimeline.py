"""Who had the machine's CPU when: cumulative CPU seconds of named processes, sampled.

A benchmark that asks why a member consumed what it did in some second needs to know
whether the member was short of work or short of CPU, and who had the CPU instead (on a
2-core machine the publisher, nats-server and the member share it). `CpuTimeline.sample`
reads each process's /proc stat and the machine's /proc/stat; `cores` then tells how many
cores each used on average between two instants (linear between samples).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from harness.bench import cpu_seconds, host_cpu

__all__ = ["HOST", "CpuTimeline"]

#: The name under which the whole machine's busy CPU is kept.
HOST = "host"


@dataclass
class CpuTimeline:
    """Samples of cumulative CPU seconds per name; ``pids`` may change while sampling (a
    publisher started later). A process that is gone keeps its last reading."""

    pids: dict[str, list[int]] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    readings: list[dict[str, float]] = field(default_factory=list)
    _last: dict[int, float] = field(default_factory=dict)

    def watch(self, name: str, pid: int) -> None:
        """Count `pid` under `name` (several pids under one name add up)."""
        pids = self.pids.setdefault(name, [])
        if pid not in pids:
            pids.append(pid)

    def sample(self, now: float | None = None) -> None:
        """Read every watched process and the machine once (time.monotonic() clock)."""
        row = {HOST: host_cpu()[0]}
        for name, pids in self.pids.items():
            total = 0.0
            for pid in pids:
                try:
                    self._last[pid] = cpu_seconds(pid)
                except (OSError, ValueError, IndexError):
                    pass  # gone: its last reading stands
                total += self._last.get(pid, 0.0)
            row[name] = total
        self.times.append(time.monotonic() if now is None else now)
        self.readings.append(row)

    def _at(self, name: str, when: float) -> float | None:
        """Cumulative CPU seconds of `name` at `when`, interpolated; None outside."""
        i = bisect.bisect_left(self.times, when)
        if i >= len(self.times) or (i == 0 and self.times[0] > when):
            return None
        if self.times[i] == when or i == 0:
            return self.readings[i].get(name)
        t0, t1 = self.times[i - 1], self.times[i]
        v0, v1 = self.readings[i - 1].get(name), self.readings[i].get(name)
        if v0 is None or v1 is None:
            return v1 if v0 is None else v0
        return v0 + (v1 - v0) * (when - t0) / (t1 - t0)

    def seconds(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds each name used from `start` to `end` (names sampled across the
        whole interval only)."""
        if end <= start:
            return {}
        names = {name for row in self.readings for name in row}
        used: dict[str, float] = {}
        for name in sorted(names):
            a, b = self._at(name, start), self._at(name, end)
            if a is not None and b is not None:
                used[name] = b - a
        return used

    def cores(self, start: float, end: float) -> dict[str, float]:
        """Average cores each name used from `start` to `end`."""
        return {
            name: round(used / (end - start), 3) for name, used in self.seconds(start, end).items()
        }
