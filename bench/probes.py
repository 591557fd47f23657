"""What a consumer pod's probes cost: `shoal-ready` exec'd against GET /readyz, same member.

Scenario: one idle member (real etcd and nats-server, 128 partitions, the ``noop``
handler) with its state file and its health port (consumer/healthport.py). Then, in the
same run, the two ways a kubelet can probe it:

* exec: ``shoal-ready`` (the console script the pods run) started ``--exec-probes``
  times one after another, as a kubelet's exec probe starts it: the CPU of those
  processes (RUSAGE_CHILDREN), and their wall time;
* HTTP: ``--http-probes`` GETs of /readyz, a new connection each (a kubelet's prober
  does not keep one), one after another: the member's CPU over them, less its own idle
  CPU over as long a window measured just before, and each request's latency.

Figures (``ms`` of CPU per probe, and what the pods' probes cost a member at their
periods: readiness every 2 s and liveness every 10 s, 0.6 probes a second):

* ``exec_probe_cpu_ms``, ``exec_probe_wall_ms`` (p50, p99), ``exec_probes_core_pct``;
* ``http_probe_member_cpu_ms``, ``http_probe_wall_ms`` (p50, p99), ``http_probes_core_pct``
  (the member's side only: a real kubelet's Go prober spends its own few microseconds,
  not comparable with this benchmark's Python client, which is left out);
* ``idle_member_core_pct``: the member itself, idle, for scale.

A real kubelet's exec probe adds a runc exec (a process, namespaces, cgroups) to the
interpreter this measures: the exec figures are a floor. Under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from harness.bench import (
    add_run_options,
    bench_main,
    bench_servers,
    cpu_seconds,
    emit,
    emit_log_problems,
    note,
    summary,
)
from harness.fleet import Fleet, settled, wait_for_status
from harness.servers import free_port
from shoal.clients.etcd import Etcd

BENCH = "probes"
NAMESPACE = "bench"
GROUP = "probes"
HANDLER = "shoal.consumer.handlers:noop"
# The pods' probes (operator/builders.py): readiness every 2 s, liveness every 10 s.
PROBES_PER_SECOND = 1 / 2 + 1 / 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="CPU per probe of a consumer pod: shoal-ready exec'd against GET "
        "/readyz on the member's health port. One JSON line per figure on stdout.",
    )
    parser.add_argument("--exec-probes", type=int, default=100)
    parser.add_argument("--http-probes", type=int, default=2000)
    parser.add_argument("--partitions", type=int, default=128)
    add_run_options(parser)
    return parser.parse_args(argv)


def shoal_ready() -> str:
    """The console script, as a pod's PATH finds it (the venv's beside this Python)."""
    beside = Path(sys.executable).parent / "shoal-ready"
    found = str(beside) if beside.exists() else shutil.which("shoal-ready")
    if found is None:
        raise SystemExit("shoal-ready is not installed (make venv)")
    return found


def exec_probes(state_file: Path, count: int) -> tuple[float, list[float]]:
    """(CPU seconds per probe, wall seconds of each) of `count` shoal-ready processes."""
    command = [shoal_ready()]
    env = {"SHOAL_READY_FILE": str(state_file), "PATH": "/usr/bin:/bin"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    walls = []
    for _ in range(count):
        started = time.perf_counter()
        result = subprocess.run(command, env=env, capture_output=True, timeout=30)
        walls.append(time.perf_counter() - started)
        if result.returncode != 0:
            raise SystemExit(f"shoal-ready said not ready: {result.stderr.decode().strip()}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu / count, walls


def http_probes(port: int, count: int) -> list[float]:
    """Wall seconds of each of `count` GET /readyz, a connection each."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    walls = []
    for _ in range(count):
        started = time.perf_counter()
        with opener.open(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            response.read()
            if response.status != 200:
                raise SystemExit(f"/readyz answered {response.status}")
        walls.append(time.perf_counter() - started)
    return walls


def ms(values: list[float]) -> dict[str, float | int | None]:
    return summary([v * 1000 for v in values])


async def measure(args: argparse.Namespace, fleet: Fleet, etcd: Etcd, root: Path) -> None:
    state_file = root / "c-0.ready"
    port = free_port()
    member = fleet.start("c-0", SHOAL_READY_FILE=str(state_file), SHOAL_HEALTH_PORT=str(port))
    # Settled, and idle from here on.
    await wait_for_status(etcd, NAMESPACE, GROUP, args.partitions, settled({"c-0"}), 60)
    await asyncio.sleep(3)

    exec_cpu, exec_walls = await asyncio.to_thread(exec_probes, state_file, args.exec_probes)
    note(f"exec: {exec_cpu * 1000:.1f} ms CPU per probe")

    # The member's idle CPU over as long as the HTTP probes will take (about 1 ms each
    # on this machine's loopback), then its CPU over the probes.
    window = max(5.0, args.http_probes * 0.0015)
    idle_start = cpu_seconds(member.pid)
    await asyncio.sleep(window)
    idle_rate = (cpu_seconds(member.pid) - idle_start) / window
    busy_start, started = cpu_seconds(member.pid), time.monotonic()
    http_walls = await asyncio.to_thread(http_probes, port, args.http_probes)
    elapsed = time.monotonic() - started
    spent = cpu_seconds(member.pid) - busy_start - idle_rate * elapsed
    http_cpu = max(spent, 0.0) / args.http_probes
    note(f"http: {http_cpu * 1000:.3f} ms of the member's CPU per probe")

    emit(BENCH, "idle_member_core_pct", idle_rate * 100)
    emit(BENCH, "exec_probe_cpu_ms", exec_cpu * 1000, probes=args.exec_probes)
    emit(BENCH, "exec_probe_wall_ms", None, **ms(exec_walls))
    emit(BENCH, "exec_probes_core_pct", exec_cpu * PROBES_PER_SECOND * 100)
    emit(BENCH, "http_probe_member_cpu_ms", http_cpu * 1000, probes=args.http_probes)
    emit(BENCH, "http_probe_wall_ms", None, **ms(http_walls))
    emit(BENCH, "http_probes_core_pct", http_cpu * PROBES_PER_SECOND * 100)
    emit(
        BENCH,
        "exec_over_http_cpu",
        exec_cpu / http_cpu if http_cpu > 0 else None,
    )


async def run(args: argparse.Namespace, root: Path) -> None:
    async with bench_servers(root) as servers:
        config = servers.group_config(NAMESPACE, GROUP, HANDLER, partitions=args.partitions)
        with Fleet.for_config(root / "members", config) as fleet:
            try:
                await measure(args, fleet, servers.etcd, root)
            finally:
                fleet.close()
                emit_log_problems(BENCH, root / "members")


def main(argv: list[str] | None = None) -> int:
    return bench_main("shoal-bench-probes-", argv, parse_args, run)


if __name__ == "__main__":
    raise SystemExit(main())
