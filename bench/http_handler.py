"""HTTP handlers against in-process handlers: throughput, member CPU, and an audited run.

Figures (one JSON line each; same run, same nats-server and etcd):

* ``machine_loopback_round_trip_us``: first, before any server starts, what one round
  trip to another process over loopback TCP costs on this machine (wall time, and the
  client's send() and CPU beside it), which every request and answer below pays. It tells
  machines apart: 86 us on a VM whose cores wake each other slowly (session 24) against
  8 us with both processes on one core. It is not most of the member's cost, though: on
  that VM with every process on one core the member spent as much CPU per HTTP message
  as over two (session 25).
* ``one_member_noop_msgs_per_s`` and ``one_member_http_msgs_per_s``, and their
  ``http_to_inprocess_ratio`` (issue 26's target: >= 0.5 with the Go handler): ONE member
  (128 partitions), a backlog (default 50,000 messages over 1,000 projects) published
  before it starts, timed from the moment it owns every partition to the stream being
  empty (work-queue retention deletes what is acked), as ``datapath.py`` does. In-process:
  ``shoal.consumer.handlers:noop``. HTTP: the member POSTs to a service that answers 200
  at once, in a process of its own. ``--rounds`` rounds, the two sides alternating which
  goes first; a side's rate is its messages over its timed seconds.
* ``member_cpu_ms_per_msg_noop`` and ``member_cpu_ms_per_msg_http`` (and their ratio):
  the member process's CPU (/proc) over the same timed windows, per message. The
  service's own CPU per message is reported beside it (``service_cpu_ms_per_msg``).
* ``four_members_inprocess_20ms_msgs_per_s``: the baseline of the next one, the same
  drain with the in-process ``noop`` handler waiting as long (SHOAL_HANDLER_DELAY_MS).
* ``four_members_http_20ms_msgs_per_s``: 4 members, each with its own service (as a
  sidecar would be) that waits 20 ms per message, 30,000 messages over 1,000 projects,
  timed as above (target >= 12,000, as for Python handlers in ``datapath.py``). The
  services record what they received (``harness.httpservice -record``), and the records
  are audited as the ledger is (``shoal.consumer.ledger.audit``): lost, duplicates,
  out of order, overlaps must all be 0. (The service cannot write Shoal's ledger; what
  it saw is the better proof anyway: it is what the team's service would see.)

The service: ``SERVICE`` names the command that starts one. By default it is the Go
handler of examples/go/ (built once per machine by harness.goexamples; ``--go-binary
PATH`` for another build), as the issue asks: a team's service in another language.
Each service runs with ``GOMAXPROCS`` = ``--service-cpus`` (default 1): what a sidecar
with a CPU limit of 1 gets from Go 1.25 on, which reads its cgroup's limit. Left to
itself on this 2-core machine the Go runtime runs a thread per core and spins looking
for work between requests: 0.049 ms of CPU per request against 0.024 with one, in
the same run (``--service-cpus 0`` leaves GOMAXPROCS unset, to see it).
``--python-service`` runs ``harness.httpservice`` (Python, aiohttp) instead, with the same
flags (``-listen``, ``-delay``, ``-record``, ``-name``; ``GET /healthz``). Both record
what they answered when asked, so the audited figure audits either.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import goexamples
from harness.bench import (
    BenchServers,
    add_run_options,
    bench_main,
    bench_servers,
    cpu_seconds,
    emit,
    loopback_round_trips,
    note,
    serious_problems,
)
from harness.children import spawn
from harness.fleet import Fleet, Member, settled, wait_for_status
from harness.servers import free_port
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import LedgerRecord, audit
from shoal.consumer.producer import Outgoing, Producer
from shoal.group.config import GroupConfig, config_env
from shoal.group.jetstream import ensure_group

BENCH = "http_handler"
NAMESPACE = "bench"
NOOP = "shoal.consumer.handlers:noop"
# (port, delay in ms, where to record or None, name) -> the command line of one service.
ServiceCommand = Callable[[int, float, "Path | None", str], list[str]]
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def python_service(port: int, delay_ms: float, record: Path | None, name: str) -> list[str]:
    """harness.httpservice: aiohttp, in a process of its own; records when asked."""
    args = [sys.executable, "-m", "harness.httpservice", "-listen", f"127.0.0.1:{port}"]
    args += ["-delay", f"{delay_ms:g}ms", "-name", name]
    return args + (["-record", str(record)] if record is not None else [])


def go_service(binary: str) -> ServiceCommand:
    """The Go handler of examples/go/ (the same flags)."""

    def command(port: int, delay_ms: float, record: Path | None, name: str) -> list[str]:
        args = [binary, "-listen", f"127.0.0.1:{port}", "-delay", f"{delay_ms:g}ms"]
        return args + (["-record", str(record), "-name", name] if record is not None else [])

    return command


# The one place that picks the service (main() swaps in go_service for --go-binary).
SERVICE: ServiceCommand = python_service
# The service's GOMAXPROCS (0: unset), from --service-cpus.
SERVICE_CPUS = 1


@dataclass
class RunningService:
    port: int
    process: Any
    record: Path | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/messages"


def start_service(root: Path, name: str, delay_ms: float, *, record: bool) -> RunningService:
    port = free_port()
    path = root / f"{name}.records.jsonl" if record else None
    log = (root / f"{name}.service.log").open("ab")
    env = dict(os.environ)
    if SERVICE_CPUS:
        env["GOMAXPROCS"] = str(SERVICE_CPUS)
    process = spawn(SERVICE(port, delay_ms, path, name), stdout=log, stderr=log, env=env)
    service = RunningService(port, process, path)
    deadline = time.monotonic() + 30
    while True:
        try:
            with _HTTP.open(f"http://127.0.0.1:{port}/healthz", timeout=2) as answer:
                if answer.status == 200:
                    return service
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"service {name} did not come up (see {log.name})")
        time.sleep(0.05)


def stop_service(service: RunningService) -> list[LedgerRecord]:
    """SIGTERM it; what it recorded (nothing for a service that does not record)."""
    if service.process.poll() is None:
        service.process.send_signal(signal.SIGTERM)
    service.process.wait(30)
    if service.record is None or not service.record.exists():
        return []
    return [LedgerRecord.parse(line.encode()) for line in service.record.read_text().splitlines()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="One member with an HTTP handler against the same member in-process "
        "(msg/s, CPU per message), and 4 members with a 20 ms HTTP handler, audited.",
    )
    parser.add_argument("--messages", type=int, default=50_000, help="per one-member round")
    parser.add_argument("--projects", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--io-messages", type=int, default=30_000)
    parser.add_argument("--io-members", type=int, default=4)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=180.0, help="per drain, seconds")
    parser.add_argument("--only", choices=("one", "io"))
    parser.add_argument("--go-binary", help="a build of examples/go/handler (default: built)")
    parser.add_argument(
        "--python-service",
        action="store_true",
        help="harness.httpservice (Python, aiohttp) as the service instead of the Go handler",
    )
    parser.add_argument(
        "--service-cpus",
        type=int,
        default=1,
        help="each service's GOMAXPROCS, as a sidecar's CPU limit sets it (0: unset)",
    )
    add_run_options(parser)
    return parser.parse_args(argv)


@dataclass
class Side:
    messages: int = 0
    seconds: float = 0.0
    member_cpu: float = 0.0
    service_cpu: float = 0.0

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0

    def per_msg_ms(self, cpu: float) -> float:
        return per_msg_ms(cpu, self.messages) or 0.0


def per_msg_ms(cpu: float, messages: int) -> float | None:
    """CPU seconds over `messages` as milliseconds per message (None for no messages)."""
    return round(1000 * cpu / messages, 4) if messages else None


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path, servers: BenchServers) -> None:
        self.args = args
        self.root = root
        self.servers = servers
        self.log_problems = 0

    def config(self, group: str, handler: str) -> GroupConfig:
        return self.servers.group_config(NAMESPACE, group, handler, ledger=False)

    async def drain(
        self,
        js: Any,
        etcd: Etcd,
        group: str,
        handler: str,
        members: int,
        messages: int,
        env: Callable[[str], dict[str, str]],
    ) -> tuple[int, float, dict[str, float], list[str]]:
        """Publish a backlog, start the members, time the drain from settled to empty.
        (timed messages, seconds, CPU seconds per member over that window, message ids)"""
        a = self.args
        config = self.config(group, handler)
        await ensure_group(js, config)
        items = [
            Outgoing(f"project-{i % a.projects}", b"x", f"{group}-{i}") for i in range(messages)
        ]
        await Producer(js, config.subject_prefix, config.partitions).publish_many(items)
        ids = [str(i.message_id) for i in items]
        names = [f"m-{i}" for i in range(members)]
        with Fleet.for_config(self.root / group, config) as fleet:
            started: dict[str, Member] = {}
            for name in names:
                started[name] = fleet.start(name, **env(name), **config_env(config, ("ledger",)))
            await wait_for_status(
                etcd, NAMESPACE, group, config.partitions, settled(set(names)), 60, interval=0.05
            )
            t0 = time.monotonic()
            cpu0 = {n: cpu_seconds(m.pid) for n, m in started.items()}
            backlog = int((await js.stream_info(config.stream)).state.messages)

            async def left() -> int:
                return int((await js.stream_info(config.stream)).state.messages)

            await eventually_async(
                left, a.timeout, f"{group} to drain", until=lambda n: n == 0, interval=0.05
            )
            seconds = time.monotonic() - t0
            cpu = {n: cpu_seconds(m.pid) - cpu0[n] for n, m in started.items()}
            dead = int((await js.stream_info(config.dlq_stream)).state.messages)
        self.log_problems += serious_problems((self.root / group).glob("*.log"))
        note(f"{group}: {backlog} in {seconds:.2f} s = {backlog / seconds:.0f} msg/s, {dead} dead")
        if dead:
            raise RuntimeError(f"{group}: {dead} dead letters")
        return backlog, seconds, cpu, ids

    async def one_member(self, js: Any, etcd: Etcd) -> None:
        a = self.args
        sides = {"noop": Side(), "http": Side()}
        for r in range(a.rounds):
            order = ("noop", "http") if r % 2 == 0 else ("http", "noop")
            for kind in order:
                group = f"one-{kind}-{r}"
                if kind == "noop":
                    n, s, cpu, _ = await self.drain(
                        js, etcd, group, NOOP, 1, a.messages, lambda _: {}
                    )
                    service_cpu = 0.0
                else:
                    service = start_service(self.root, f"{group}-svc", 0, record=False)
                    try:
                        c0 = cpu_seconds(service.process.pid)
                        n, s, cpu, _ = await self.drain(
                            js, etcd, group, service.url, 1, a.messages, lambda _: {}
                        )
                        # (Over the whole run, start-up included: an upper bound.)
                        service_cpu = cpu_seconds(service.process.pid) - c0
                    finally:
                        stop_service(service)
                side = sides[kind]
                side.messages += n
                side.seconds += s
                side.member_cpu += sum(cpu.values())
                side.service_cpu += service_cpu
        noop, http = sides["noop"], sides["http"]
        ratio = http.rate / noop.rate if noop.rate else 0.0
        common = {"messages_per_round": a.messages, "rounds": a.rounds, "partitions": 128}
        kind = (
            "python-aiohttp" if a.python_service else f"go (GOMAXPROCS {SERVICE_CPUS or 'unset'})"
        )
        emit(BENCH, "one_member_noop_msgs_per_s", noop.rate, **common)
        emit(BENCH, "one_member_http_msgs_per_s", http.rate, service=kind, **common)
        emit(
            BENCH,
            "http_to_inprocess_ratio",
            ratio,
            target=">= 0.5 (with the Go handler)",
            ok=ratio >= 0.5,
            service=kind,
        )
        cpu_noop = noop.per_msg_ms(noop.member_cpu)
        cpu_http = http.per_msg_ms(http.member_cpu)
        emit(BENCH, "member_cpu_ms_per_msg_noop", cpu_noop)
        emit(
            BENCH,
            "member_cpu_ms_per_msg_http",
            cpu_http,
            ratio_to_noop=cpu_http / cpu_noop if cpu_noop else None,
            service_cpu_ms_per_msg=http.per_msg_ms(http.service_cpu),
            service=kind,
        )

    async def io(self, js: Any, etcd: Etcd) -> None:
        a = self.args
        # The baseline: the same drain with the in-process handler waiting as long
        # (SHOAL_HANDLER_DELAY_MS), so what the HTTP side loses is the HTTP path's alone
        # and not a cold start's (both start on the backlog: issue 29's ramp).
        delay = {"SHOAL_HANDLER_DELAY_MS": f"{a.delay_ms:g}"}
        n, s, cpu, _ = await self.drain(
            js, etcd, "io-noop", NOOP, a.io_members, a.io_messages, lambda name: delay
        )
        inprocess = n / s
        emit(
            BENCH,
            "four_members_inprocess_20ms_msgs_per_s",
            inprocess,
            members=a.io_members,
            handler_ms=a.delay_ms,
            messages=a.io_messages,
            member_cpu_pct={m: round(100 * c / s, 1) for m, c in cpu.items()},
            member_cpu_ms_per_msg=per_msg_ms(sum(cpu.values()), n),
        )
        group = "io-http"
        record = True
        services = {
            f"m-{i}": start_service(self.root, f"{group}-svc-{i}", a.delay_ms, record=record)
            for i in range(a.io_members)
        }
        service_cpu0 = {m: cpu_seconds(svc.process.pid) for m, svc in services.items()}
        service_cpu: dict[str, float] = {}
        try:
            n, s, cpu, ids = await self.drain(
                js,
                etcd,
                group,
                next(iter(services.values())).url,  # each member's own below
                a.io_members,
                a.io_messages,
                lambda name: {"SHOAL_HANDLER": services[name].url},
            )
            # Over the whole run (publishing and the members' start-up included, while
            # the services idle): an upper bound of what the drain cost them.
            service_cpu = {
                m: cpu_seconds(svc.process.pid) - service_cpu0[m] for m, svc in services.items()
            }
        finally:
            records = [r for svc in services.values() for r in stop_service(svc)]
        rate = n / s
        extra: dict[str, Any] = {
            "members": a.io_members,
            "handler_ms": a.delay_ms,
            "messages": a.io_messages,
            "projects": a.projects,
            "timed_messages": n,
            "member_cpu_pct": {m: round(100 * c / s, 1) for m, c in cpu.items()},
            "member_cpu_ms_per_msg": per_msg_ms(sum(cpu.values()), n),
            "service_cpu_ms_per_msg": per_msg_ms(sum(service_cpu.values()), n),
            "service": "python-aiohttp" if a.python_service else "go",
            "inprocess_msgs_per_s": round(inprocess, 1),
            "ratio_to_inprocess": round(rate / inprocess, 3) if inprocess else None,
        }
        clean = True
        if record:
            # Every message the services answered 200, in the order they got them.
            records.sort(key=lambda r: r.started)
            result = audit(records, ids).summary()
            extra["audit"] = result
            clean = result["lost"] == result["duplicates"] == 0 and (
                result["out_of_order"] == result["overlaps"] == 0
            )
            note(f"{group}: audit {result}")
        emit(
            BENCH,
            "four_members_http_20ms_msgs_per_s",
            rate,
            target=">= 12000",
            ok=rate >= 12000 and clean,
            audit_clean=clean,
            **extra,
        )


async def run(args: argparse.Namespace, root: Path) -> None:
    # The machine's price of a wake-up, before any server starts: every request and every
    # answer pays one (the journal's session 24 entry).
    trips = loopback_round_trips()
    emit(
        BENCH,
        "machine_loopback_round_trip_us",
        trips.wall_us,
        send_us=trips.send_us,
        client_cpu_us=trips.cpu_us,
        what="300 bytes to an echo process and 100 back over loopback TCP",
    )
    async with bench_servers(root) as servers:
        bench = Bench(args, root, servers)
        if args.only != "io":
            await bench.one_member(servers.js, servers.etcd)
        if args.only != "one":
            await bench.io(servers.js, servers.etcd)
        emit(BENCH, "member_log_problems", bench.log_problems, target="0")


def parse_and_pick_service(argv: list[str] | None) -> argparse.Namespace:
    """parse_args, and the service the arguments pick (the Go handler is built here,
    before the work directory exists)."""
    global SERVICE, SERVICE_CPUS
    args = parse_args(argv)
    SERVICE_CPUS = max(0, args.service_cpus)
    if not args.python_service:
        SERVICE = go_service(args.go_binary or str(goexamples.build()["handler"]))
    command = json.dumps(SERVICE(0, args.delay_ms, None, "x"))
    note(f"service: {command}, GOMAXPROCS {SERVICE_CPUS or 'unset'}")
    return args


def main(argv: list[str] | None = None) -> int:
    return bench_main("shoal-bench-http-", argv, parse_and_pick_service, run)


if __name__ == "__main__":
    raise SystemExit(main())
