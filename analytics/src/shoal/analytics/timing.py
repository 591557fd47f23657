"""Where a report's time went, from the process's start to the last file written.

A :class:`Timeline` is a list of phases that follow one another: each :meth:`~Timeline.mark`
ends the phase that began at the previous mark, so the phases add up to the total and no
time goes unaccounted. The first phase starts when the process started (read from
``/proc/self/stat`` on Linux; elsewhere at the timeline's creation), so the interpreter's
start and the imports before the command ran are the first line. A phase may list the
steps that ran inside it (the Spark report's steps after its checkpoints run at once from
several threads: they overlap, and their sum is more than the phase).

``shoal-analytics report`` prints the block on stderr at the end and writes the same
numbers to summary.json (``timing``). What it cannot see is the process's exit after the
last mark (the interpreter's shutdown); ``bench/analytics.py`` measures the command from
outside and gives that difference.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HEADER", "Timeline", "process_age"]

HEADER = "where the time went"


def process_age() -> float | None:
    """Seconds since this process started (Linux: its start time in ``/proc/self/stat``,
    clock ticks after boot, against the boot-time clock; 10 ms resolution), else None."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            # The command name (field 2) is in parentheses and may hold spaces.
            fields = stat.read().rpartition(")")[2].split()
        start_ticks = int(fields[19])  # field 22, starttime; fields[0] is field 3
        ticks = os.sysconf("SC_CLK_TCK")
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    age = now - start_ticks / ticks
    return age if age >= 0 else None


@dataclass
class Phase:
    name: str
    seconds: float
    steps: list[tuple[str, float]] = field(default_factory=list)


class Timeline:
    """Consecutive phases of wall time. ``from_process_start``: the first phase begins at
    the process's start rather than now."""

    def __init__(self, *, from_process_start: bool = False) -> None:
        now = time.perf_counter()
        age = process_age() if from_process_start else None
        self.origin = now - age if age is not None else now
        self._last = self.origin
        self.phases: list[Phase] = []

    def mark(self, name: str, steps: Iterable[tuple[str, float]] = ()) -> float:
        """End the phase ``name`` (begun at the previous mark) now; returns its seconds."""
        now = time.perf_counter()
        seconds = now - self._last
        self._last = now
        self.phases.append(Phase(name, seconds, list(steps)))
        return seconds

    @property
    def total(self) -> float:
        return sum(p.seconds for p in self.phases)

    def lines(self) -> list[str]:
        """The block printed at the end of a report: one line per phase, its steps
        indented below it, and the total."""
        rows: list[tuple[str, float]] = []
        for phase in self.phases:
            rows.append((phase.name, phase.seconds))
            rows.extend((f"  {name}", seconds) for name, seconds in phase.steps)
        rows.append(("total", self.total))
        width = max(len(name) for name, _ in rows)
        out = [f"{HEADER} (wall time, s; steps inside a phase may overlap):"]
        out += [f"  {name:<{width}}  {seconds:7.1f}" for name, seconds in rows]
        return out

    def as_dict(self) -> dict[str, Any]:
        """For summary.json: ``{"phases": [{"name", "s", "steps"?}], "total_s"}``."""
        phases: list[dict[str, Any]] = []
        for phase in self.phases:
            entry: dict[str, Any] = {"name": phase.name, "s": round(phase.seconds, 3)}
            if phase.steps:
                entry["steps"] = [{"name": n, "s": round(s, 3)} for n, s in phase.steps]
            phases.append(entry)
        return {"phases": phases, "total_s": round(self.total, 3)}
