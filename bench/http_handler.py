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
* The same over a Unix domain socket, each beside its TCP figure:
  ``one_member_http_unix_msgs_per_s`` and ``http_unix_to_inprocess_ratio`` (rounds of
  their own, in the same alternation: every other round runs the sides in reverse),
  ``member_cpu_ms_per_msg_http_unix`` (``service_cpu_ms_per_msg`` beside it), and
  ``four_members_http_unix_20ms_msgs_per_s`` (audited the same way, the same target). The
  service listens on ``-listen unix:<dir>/<name>.sock`` (the work directory, or a short
  one of its own under /tmp when the work directory's path would make the socket's too
  long for a socket address); the member gets ``SHOAL_HANDLER=http://localhost/messages``
  (the path and the Host header) and ``SHOAL_HANDLER_SOCKET=<that path>``, as a member
  with spec.handlerSocket does, its service a native sidecar sharing an emptyDir with it.
  Why: a loopback TCP send() runs the receiver's side of TCP (its receive path, the ACK)
  inside the sender's system call, so the member pays for the service's half of every
  request too; a Unix socket's send() only queues the bytes on the peer's socket and
  wakes it (12 against 1.5 us a send() on this project's VM). ``--no-unix`` skips them.

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
import http.client
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
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
# The member's URL when it reaches the service over a Unix socket: the URL gives only the
# path and the Host header then (SHOAL_HANDLER_SOCKET gives where to connect).
UNIX_URL = "http://localhost/messages"
# A socket's path must fit sun_path (108 bytes with its NUL); past this many characters
# of work directory the sockets go in a short directory of their own under /tmp.
SOCKET_DIR_MAX = 60
# (-listen: 127.0.0.1:port or unix:path, delay in ms, where to record or None, name) ->
# the command line of one service.
ServiceCommand = Callable[[str, float, "Path | None", str], list[str]]
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def python_service(listen: str, delay_ms: float, record: Path | None, name: str) -> list[str]:
    """harness.httpservice: aiohttp, in a process of its own; records when asked."""
    args = [sys.executable, "-m", "harness.httpservice", "-listen", listen]
    args += ["-delay", f"{delay_ms:g}ms", "-name", name]
    return args + (["-record", str(record)] if record is not None else [])


def go_service(binary: str) -> ServiceCommand:
    """The Go handler of examples/go/ (the same flags)."""

    def command(listen: str, delay_ms: float, record: Path | None, name: str) -> list[str]:
        args = [binary, "-listen", listen, "-delay", f"{delay_ms:g}ms"]
        return args + (["-record", str(record), "-name", name] if record is not None else [])

    return command


# The one place that picks the service (main() swaps in go_service for --go-binary).
SERVICE: ServiceCommand = python_service
# The service's GOMAXPROCS (0: unset), from --service-cpus.
SERVICE_CPUS = 1


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over the Unix socket at `socket_path` (Host: localhost)."""

    def __init__(self, socket_path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(str(self.socket_path))
        except OSError:
            sock.close()
            raise
        self.sock = sock


@dataclass
class RunningService:
    port: int  # (0 over a Unix socket)
    socket: Path | None  # where it listens, or None: 127.0.0.1:port
    process: Any
    record: Path | None

    @property
    def url(self) -> str:
        return UNIX_URL if self.socket is not None else f"http://127.0.0.1:{self.port}/messages"

    def member_env(self) -> dict[str, str]:
        """What a member needs to reach it."""
        env = {"SHOAL_HANDLER": self.url}
        if self.socket is not None:
            env["SHOAL_HANDLER_SOCKET"] = str(self.socket)
        return env

    def healthy(self) -> bool:
        """GET /healthz answers 200 (over the socket the member will use)."""
        if self.socket is None:
            with _HTTP.open(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as answer:
                return bool(answer.status == 200)
        conn = UnixHTTPConnection(self.socket, timeout=2)
        try:
            conn.request("GET", "/healthz")
            return conn.getresponse().status == 200
        finally:
            conn.close()


def start_service(
    root: Path, name: str, delay_ms: float, *, record: bool, sockets: Path | None = None
) -> RunningService:
    """A service on 127.0.0.1, or with `sockets` on the Unix socket `sockets`/<name>.sock."""
    port, socket_path = (0, sockets / f"{name}.sock") if sockets else (free_port(), None)
    listen = f"unix:{socket_path}" if socket_path else f"127.0.0.1:{port}"
    path = root / f"{name}.records.jsonl" if record else None
    log = (root / f"{name}.service.log").open("ab")
    env = dict(os.environ)
    if SERVICE_CPUS:
        env["GOMAXPROCS"] = str(SERVICE_CPUS)
    process = spawn(SERVICE(listen, delay_ms, path, name), stdout=log, stderr=log, env=env)
    service = RunningService(port, socket_path, process, path)
    deadline = time.monotonic() + 30
    while True:
        try:
            if service.healthy():
                return service
        except (OSError, http.client.HTTPException):
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
        "--no-unix",
        action="store_true",
        help="skip the sides where the member reaches the service over a Unix socket",
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
    def __init__(
        self, args: argparse.Namespace, root: Path, servers: BenchServers, sockets: Path | None
    ) -> None:
        self.args = args
        self.root = root
        self.servers = servers
        # Where the services' Unix sockets go; None: no Unix-socket sides (--no-unix).
        self.sockets = sockets
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

    async def one_member_http(
        self, js: Any, etcd: Etcd, group: str, sockets: Path | None
    ) -> tuple[int, float, dict[str, float], float]:
        """One member's drain with a service that answers at once, over loopback TCP or
        (with `sockets`) a Unix socket: drain's figures and the service's CPU seconds."""
        service = start_service(self.root, f"{group}-svc", 0, record=False, sockets=sockets)
        try:
            c0 = cpu_seconds(service.process.pid)
            n, s, cpu, _ = await self.drain(
                js, etcd, group, service.url, 1, self.args.messages, lambda _: service.member_env()
            )
            # (Over the whole run, start-up included: an upper bound.)
            return n, s, cpu, cpu_seconds(service.process.pid) - c0
        finally:
            stop_service(service)

    async def one_member(self, js: Any, etcd: Etcd) -> None:
        a = self.args
        kinds = ("noop", "http", "http-unix") if self.sockets else ("noop", "http")
        sides = {kind: Side() for kind in kinds}
        for r in range(a.rounds):
            # Every other round in reverse: noop and http (TCP) alternate which goes first,
            # and no side always runs on the fresher or the more used servers.
            order = kinds if r % 2 == 0 else kinds[::-1]
            for kind in order:
                group = f"one-{kind}-{r}"
                if kind == "noop":
                    n, s, cpu, _ = await self.drain(
                        js, etcd, group, NOOP, 1, a.messages, lambda _: {}
                    )
                    service_cpu = 0.0
                else:
                    sockets = self.sockets if kind == "http-unix" else None
                    n, s, cpu, service_cpu = await self.one_member_http(js, etcd, group, sockets)
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
        unix = sides.get("http-unix")
        if unix is not None:
            emit(
                BENCH,
                "one_member_http_unix_msgs_per_s",
                unix.rate,
                service=kind,
                ratio_to_http_tcp=round(unix.rate / http.rate, 3) if http.rate else None,
                **common,
            )
        emit(
            BENCH,
            "http_to_inprocess_ratio",
            ratio,
            target=">= 0.5 (with the Go handler)",
            ok=ratio >= 0.5,
            service=kind,
        )
        if unix is not None:
            unix_ratio = unix.rate / noop.rate if noop.rate else 0.0
            emit(
                BENCH,
                "http_unix_to_inprocess_ratio",
                unix_ratio,
                target=">= 0.5 (with the Go handler)",
                ok=unix_ratio >= 0.5,
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
        if unix is not None:
            cpu_unix = unix.per_msg_ms(unix.member_cpu)
            emit(
                BENCH,
                "member_cpu_ms_per_msg_http_unix",
                cpu_unix,
                ratio_to_noop=cpu_unix / cpu_noop if cpu_noop else None,
                ratio_to_http_tcp=cpu_unix / cpu_http if cpu_http else None,
                service_cpu_ms_per_msg=unix.per_msg_ms(unix.service_cpu),
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
        await self.io_http(js, etcd, inprocess, None)
        if self.sockets is not None:
            await self.io_http(js, etcd, inprocess, self.sockets)

    async def io_http(self, js: Any, etcd: Etcd, inprocess: float, sockets: Path | None) -> None:
        """The audited 4-member drain with 20 ms services, reached over loopback TCP or
        (with `sockets`) each over its own Unix socket."""
        a = self.args
        group, figure = "io-http", "four_members_http_20ms_msgs_per_s"
        if sockets is not None:
            group, figure = "io-http-unix", "four_members_http_unix_20ms_msgs_per_s"
        record = True
        services = {
            f"m-{i}": start_service(
                self.root, f"{group}-svc-{i}", a.delay_ms, record=record, sockets=sockets
            )
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
                lambda name: services[name].member_env(),
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
            figure,
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
    sockets = None if args.no_unix else socket_dir(root)
    try:
        async with bench_servers(root) as servers:
            bench = Bench(args, root, servers, sockets)
            if args.only != "io":
                await bench.one_member(servers.js, servers.etcd)
            if args.only != "one":
                await bench.io(servers.js, servers.etcd)
            emit(BENCH, "member_log_problems", bench.log_problems, target="0")
    finally:
        if sockets is not None and sockets != root:
            shutil.rmtree(sockets, ignore_errors=True)


def socket_dir(root: Path) -> Path:
    """Where the services' Unix sockets go: the work directory, or a short one of its
    own under /tmp when the work directory's path is too long for a socket's."""
    if len(str(root)) <= SOCKET_DIR_MAX:
        return root
    return Path(tempfile.mkdtemp(prefix="shoal-sock-", dir="/tmp"))


def parse_and_pick_service(argv: list[str] | None) -> argparse.Namespace:
    """parse_args, and the service the arguments pick (the Go handler is built here,
    before the work directory exists)."""
    global SERVICE, SERVICE_CPUS
    args = parse_args(argv)
    SERVICE_CPUS = max(0, args.service_cpus)
    if not args.python_service:
        SERVICE = go_service(args.go_binary or str(goexamples.build()["handler"]))
    command = json.dumps(SERVICE("127.0.0.1:0", args.delay_ms, None, "x"))
    note(f"service: {command}, GOMAXPROCS {SERVICE_CPUS or 'unset'}")
    return args


def main(argv: list[str] | None = None) -> int:
    return bench_main("shoal-bench-http-", argv, parse_and_pick_service, run)


if __name__ == "__main__":
    raise SystemExit(main())
