"""CPU use of this member as a percentage of what it may use (cgroup-aware).

The autoscaler compares this figure with ``cpuThreshold`` (90% by default), so it must
mean "how close to its ceiling is this member", not "how busy is the host":

* In a container with a CPU limit, the ceiling is the cgroup quota (cgroup v2
  ``cpu.max``, or v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``), else the pod's
  ``limits.cpu`` handed over by the downward API (``SHOAL_CPU_LIMIT_MILLICORES``).
* A member is one Python process whose handlers run under the GIL: it cannot use more
  than about one core however many the limit grants, so the ceiling is at most one core.
  Without any limit the ceiling is exactly one core, never the host's core count.

Usage is this process's CPU time (user + system) over wall time between two readings.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from shoal.contracts.names import CPU_LIMIT_ENV

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
LIMIT_ENV = CPU_LIMIT_ENV  # set by the operator (contracts.names)
#: What one Python process can use at most (see the module docstring).
PROCESS_CEILING_CORES = 1.0


def parse_cpu_max(text: str) -> float | None:
    """Cores granted by a cgroup v2 ``cpu.max`` ("max 100000" or "50000 100000")."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota_text: str, period_text: str) -> float | None:
    """Cores granted by cgroup v1 ``cpu.cfs_quota_us`` (-1: no limit) and its period."""
    try:
        quota, period = int(quota_text.strip()), int(period_text.strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_millicores(text: str | None) -> float | None:
    """Cores from the downward API's ``limits.cpu`` in millicores; 0 or garbage: none."""
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value / 1000 if value > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup_limit_cores(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of the cgroup this process runs in, in cores, or None (unlimited)."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        return parse_cpu_max(v2)
    for v1 in (root / "cpu", root / "cpu,cpuacct"):
        quota, period = _read(v1 / "cpu.cfs_quota_us"), _read(v1 / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            return parse_cfs(quota, period)
    return None


def ceiling_cores(
    cgroup: float | None, downward_api: float | None, process: float = PROCESS_CEILING_CORES
) -> float:
    """What 100% means: the tightest of the limits that apply, never more than one process."""
    limits = [limit for limit in (cgroup, downward_api) if limit is not None]
    return min([*limits, process])


class CpuMeter:
    """This process's CPU use since the previous reading, as a percent of its ceiling."""

    def __init__(self, ceiling: float | None = None) -> None:
        if ceiling is None:
            ceiling = ceiling_cores(cgroup_limit_cores(), parse_millicores(os.getenv(LIMIT_ENV)))
        self.ceiling = ceiling
        self._wall = time.monotonic()
        self._cpu = time.process_time()
        log.debug("CPU ceiling: %.3g cores", ceiling)

    def read(self) -> float:
        wall, cpu = time.monotonic(), time.process_time()
        elapsed = wall - self._wall
        share = (cpu - self._cpu) / (elapsed * self.ceiling) if elapsed > 0 else 0.0
        self._wall, self._cpu = wall, cpu
        return round(100.0 * share, 1)
