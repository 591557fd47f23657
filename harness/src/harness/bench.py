"""Helpers shared by the benchmarks: output, work directories, servers, metrics, streams,
logs, and the command line every benchmark has (``--keep``, ``--strict``).

Every benchmark prints one JSON object per figure on stdout (``emit``) and everything
else on stderr (``note``), so ``make bench`` can keep stdout as a .jsonl file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext, api

from harness.servers import EtcdServer, NatsServer
from shoal.clients.etcd import Etcd
from shoal.group.config import GroupConfig
from shoal.logs import quiet_known_noise

__all__ = [
    "RESULTS",
    "BenchServers",
    "add_run_options",
    "bench_main",
    "bench_servers",
    "cpu_seconds",
    "emit",
    "emit_log_problems",
    "failed",
    "host_cpu",
    "log_problems",
    "note",
    "percentile",
    "read_stream_json",
    "scrape_counter",
    "serious_problems",
    "summary",
    "thread_cpu",
    "workdir",
]

_T0 = time.monotonic()

# Requests to our own processes must never go through an HTTP proxy from the environment.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# Every figure emitted in this process, for a closing summary on stderr.
RESULTS: list[dict[str, Any]] = []


def note(message: str) -> None:
    """A progress line on stderr, with seconds since the benchmark started."""
    print(f"[{time.monotonic() - _T0:7.2f}s] {message}", file=sys.stderr, flush=True)


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def emit(bench: str, figure: str, value: float | int | None, **extra: Any) -> None:
    """Print one figure as one JSON line on stdout."""
    record: dict[str, Any] = {"bench": bench, "figure": figure, "value": value, **extra}
    record = _clean(record)
    RESULTS.append(record)
    print(json.dumps(record, sort_keys=False), flush=True)


@contextmanager
def workdir(prefix: str, keep: bool) -> Iterator[Path]:
    """A temporary directory; removed afterwards unless `keep` or the benchmark failed."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    note(f"work directory {path}")
    failed = True
    try:
        yield path
        failed = False
    finally:
        if keep or failed:
            note(f"kept {path} (member logs in {path / 'members'})")
        else:
            shutil.rmtree(path, ignore_errors=True)


def _stat_cpu(stat: str) -> float:
    """User + system CPU seconds from a /proc stat line (a process's or a thread's)."""
    fields = stat.rpartition(")")[2].split()
    # fields[0] is field 3 (state) of proc(5): utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (all its threads)."""
    return _stat_cpu(Path(f"/proc/{pid}/stat").read_text())


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far per thread name of a process, numbers in names folded to ``#``
    (``GC Thread#0`` and ``GC Thread#1`` count as ``GC Thread##``). Linux truncates the
    names to 15 characters (``C2 CompilerThre``). Threads that end meanwhile are skipped;
    a process that is gone raises ProcessLookupError."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        raise ProcessLookupError(f"no process {pid}")
    totals: dict[str, float] = {}
    for stat in tasks.glob("*/stat"):
        try:
            raw = stat.read_text()
        except OSError:  # the thread ended
            continue
        name = re.sub(r"[0-9]+", "#", raw.rpartition(")")[0].partition("(")[2])
        totals[name] = totals.get(name, 0.0) + _stat_cpu(raw)
    return totals


# An echo server for loopback_round_trips: a process of its own, so that every round trip
# wakes another process, as a request to a sidecar does.
_ECHO = """
import socket
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(1)
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while conn.recv(65536):
    conn.sendall(b"y" * 100)
"""


@dataclass(frozen=True)
class RoundTrips:
    """Per loopback round trip: wall time, the client's send() alone, the client's CPU."""

    wall_us: float
    send_us: float
    cpu_us: float


def loopback_round_trips(count: int = 5000, size: int = 300) -> RoundTrips:
    """``count`` round trips of ``size`` bytes (and 100 back) over loopback TCP between
    this process and an echo server in another: what each HTTP request to a service in
    another process pays in wake-ups, apart from any HTTP. It tells machines apart: on a
    VM, waking a process on the other core is an interrupt the hypervisor handles, and a
    round trip took 86 us there against 8 us with both processes on one core (session
    24)."""
    echo = subprocess.Popen([sys.executable, "-c", _ECHO], stdout=subprocess.PIPE, text=True)
    try:
        assert echo.stdout is not None
        port = int(echo.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            payload = b"x" * size
            sending = 0.0
            cpu0, started = time.process_time(), time.perf_counter()
            for _ in range(count):
                before = time.perf_counter()
                conn.sendall(payload)
                sending += time.perf_counter() - before
                if not conn.recv(65536):
                    raise ConnectionError("the echo server closed the connection")
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu0
        echo.wait(10)
    finally:
        if echo.poll() is None:
            echo.kill()
            echo.wait()
    return RoundTrips(wall * 1e6 / count, sending * 1e6 / count, cpu * 1e6 / count)


def varz(monitor_url: str) -> dict[str, Any]:
    """nats-server's /varz: its counters (in_msgs, out_msgs, ...) over every client."""
    with urllib.request.urlopen(f"{monitor_url}/varz", timeout=5) as answer:
        data: dict[str, Any] = json.load(answer)
        return data


def host_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(values[:8]) - idle) / hz, sum(values[:8]) / hz


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), nearest-rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    return {
        "count": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def scrape_counter(port: int, name: str, labels: str = "", timeout: float = 1.0) -> float:
    """The value of one sample on a member's /metrics page (0.0 if it is not there yet).

    `labels` is matched as a substring of the label set, e.g. 'outcome="ok"'.
    """
    with _HTTP.open(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) == name and labels in (match.group(2) or ""):
            return float(match.group(3))
    return 0.0


async def read_stream_json(js: Any, stream: str, *, batch: int = 1000) -> list[dict[str, Any]]:
    """Every message of a stream, parsed as JSON objects, through an ephemeral consumer."""
    info = await js.stream_info(stream)
    total = int(info.state.messages)
    out: list[dict[str, Any]] = []
    if total == 0:
        return out
    consumer = await js.add_consumer(
        stream,
        config=api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.ALL,
            inactive_threshold=30.0,
        ),
    )
    sub = await js.pull_subscribe_bind(stream=stream, consumer=consumer.name)
    try:
        seen = 0
        while seen < total:
            try:
                msgs = await sub.fetch(batch, timeout=2)
            except TimeoutError:
                break
            for msg in msgs:
                seen += 1
                try:
                    value = json.loads(msg.data)
                except ValueError:
                    continue
                if isinstance(value, dict):
                    out.append(value)
    finally:
        await sub.unsubscribe()
    return out


_PROBLEM = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback")


def log_problems(paths: Iterable[Path], *, samples: int = 10) -> dict[str, Any]:
    """Count WARNING / ERROR / Traceback lines in member logs, with distinct samples.

    A traceback is summarised by its exception line (the first unindented line after it
    that is not another log line).
    """
    counts = {"warning": 0, "error": 0, "traceback": 0}
    examples: dict[str, int] = {}
    for path in sorted(paths):
        try:
            lines = path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            continue
        for i, line in enumerate(lines):
            match = _PROBLEM.search(line)
            if not match:
                continue
            if match.group(0) == "Traceback":
                counts["traceback"] += 1
                # Other threads' log lines (time-stamped) may be interleaved: skip them.
                after = (
                    ln
                    for ln in lines[i + 1 :]
                    if ln and not ln[0].isspace() and not ln[0].isdigit()
                )
                text = "Traceback: " + next(after, "(cut off: the process exited)")
            else:
                counts["error" if match.group(1) != "WARNING" else "warning"] += 1
                # Drop the time stamp so that repeated messages count as one example.
                text = re.sub(r"^\S+ \S+ ", "", line.strip())
                text = re.sub(r"\d+(\.\d+)?", "N", text)
            examples[text[:240]] = examples.get(text[:240], 0) + 1
    top = sorted(examples.items(), key=lambda kv: -kv[1])[:samples]
    return {**counts, "examples": [f"{n}x {text}" for text, n in top]}


def failed(figures: Iterable[dict[str, Any]] = RESULTS) -> list[str]:
    """Figures that carry ok=false."""
    return [str(f.get("figure")) for f in figures if f.get("ok") is False]


def run_bench(
    prefix: str,
    keep: bool,
    strict: bool,
    body: Callable[[Path], Coroutine[Any, Any, None]],
) -> int:
    """Run body in a fresh work directory; report wall time and missed targets.

    The exit status is 1 only with strict and a figure that missed its target.
    """
    started = time.monotonic()
    with workdir(prefix, keep) as root:
        asyncio.run(body(root))
    note(f"wall time {time.monotonic() - started:.1f} s")
    missed = failed()
    if missed:
        note(f"figures that missed their target: {', '.join(missed)}")
    return 1 if strict and missed else 0


def serious_problems(paths: Iterable[Path]) -> int:
    """ERROR and Traceback lines in member logs: what a benchmark's
    ``member_log_problems`` figure counts (warnings are left out of it)."""
    problems = log_problems(paths)
    return int(problems["error"] + problems["traceback"])


def emit_log_problems(bench: str, logs: Path) -> None:
    """The ``member_log_problems`` figure of the member logs in `logs`, with the counts
    and samples beside it (also noted on stderr, to read without the JSON)."""
    problems = log_problems(logs.glob("*.log"))
    note(f"member logs: {problems}")
    emit(bench, "member_log_problems", problems["error"] + problems["traceback"], **problems)


@dataclass
class BenchServers:
    """A benchmark's nats-server and etcd, and its own client connection to each."""

    nats_server: NatsServer
    etcd_server: EtcdServer
    etcd: Etcd
    nc: NATS
    js: JetStreamContext

    def group_config(
        self, namespace: str, group: str, handler: str, **settings: Any
    ) -> GroupConfig:
        """A group on these servers; `settings` are GroupConfig's other fields."""
        return GroupConfig(
            namespace=namespace,
            group=group,
            nats_url=self.nats_server.url,
            etcd_endpoints=self.etcd_server.endpoint,
            handler=handler,
            **settings,
        )


@asynccontextmanager
async def bench_servers(root: Path) -> AsyncIterator[BenchServers]:
    """Start a nats-server (in ``root/nats``) and an etcd (in ``root/etcd``), connect
    to both; close the connections, then stop the servers, on the way out.

    ``SHOAL_BENCH_NATS_ARGS`` adds options to nats-server's command line, e.g.
    ``--profile 18222`` to take a CPU profile of it while a figure is measured:
    ``curl -o nats.pprof 'http://127.0.0.1:18222/debug/pprof/profile?seconds=3'``, then
    ``go tool pprof -top <nats-server binary> nats.pprof`` (docs/data-path.md)."""
    extra = shlex.split(os.environ.get("SHOAL_BENCH_NATS_ARGS", ""))
    with (
        NatsServer(root / "nats", extra_args=extra) as nats_server,
        EtcdServer(root / "etcd") as etcd_server,
    ):
        etcd = Etcd(etcd_server.endpoint)
        await etcd.connect(attempts=10)
        try:
            nc = await nats.connect(nats_server.url)
            try:
                yield BenchServers(nats_server, etcd_server, etcd, nc, nc.jetstream())
            finally:
                await nc.close()
        finally:
            etcd.close()


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark has, which run_bench reads (``--keep``, ``--strict``)."""
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a figure misses its target"
    )


def bench_main(
    prefix: str,
    argv: list[str] | None,
    parse_args: Callable[[list[str] | None], argparse.Namespace],
    run: Callable[[argparse.Namespace, Path], Coroutine[Any, Any, None]],
) -> int:
    """A benchmark's main(): parse its command line (which has add_run_options'),
    then run_bench its `run` in a work directory named after `prefix`."""
    # The libraries' known harmless messages (asyncio's EOF warning, etcd's closed
    # watchers) would read as problems on stderr.
    quiet_known_noise()
    args = parse_args(argv)
    return run_bench(prefix, args.keep, args.strict, lambda root: run(args, root))
