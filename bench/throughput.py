"""Throughput of shoal workers against a plain nats-py pull-and-ack loop; RSS at 64 partitions.

Method (both sides read THE SAME messages of THE SAME stream, in the same run):

* Both sides read the same 128 partition durables (``p0``..``p127``, filter
  ``<prefix>.<p>``, explicit ack) of the group's stream (``limits`` retention,
  ``SHOAL_RETENTION=limits``), one side at a time. The plain side is
  ``harness/plain.py``: the fastest plain nats-py consumer we know how to write on
  nats-py's public API (one subscription for every pull's replies, a bare ``+ACK`` per
  message, the next pull sent from the callback; ``--plain-batch`` messages per pull).
  The member reads through its own leaner path inside nats-py's client
  (``shoal.clients.natsclient``: its parser, no ``Msg``, lazy headers); the ratio is
  what Shoal costs against a consumer written with nats-py (docs/data-path.md).
* Before each side, a backlog (default 50,000 messages over 1,000 projects) is published
  while no reader runs, so each side starts from all of it: ONE shoal member process that
  joins alone and claims all 128 partitions (its start-up is not charged), or the plain
  reader. (Pausing the durables under a running reader was tried: a paused consumer keeps
  every pull it receives and answers all of them at the resume.)
* A side is timed from its first processed message to the last ack the server applied.
  Start: the plain reader reports its first message; the member's ok counter (its
  /metrics page) is scraped every 10 ms until it moves, and the start is the last scrape
  that saw none (never later than the truth). End, for both: the latest
  ``ack_floor.last_active`` of the 128 durables once all have nothing pending and nothing
  unacknowledged (``DrainClock``: one ``CONSUMER.LIST`` request every 0.25 s). So neither
  reader is asked anything while it drains: until session 8 the member's /metrics page was
  scraped every 50 ms to see it finish (2-5 % of its CPU, which the plain reader did not
  pay). A member's CPU is read from /proc at its start and at the end; the plain reader
  reports its own, from its first message to its last ack.
* Nothing publishes while a side is timed. An untimed warm-up round comes first (each
  side drains one backlog: the server's first drains are its slowest, and the first side
  timed used to pay for them). Then ``--rounds`` rounds (default 8; 2 until session 12,
  4 in session 12), each with a fresh backlog; the order of the two sides alternates
  between rounds, so caches and background work of the server do not favour one side. A
  side's rate is its total messages over its total timed seconds. (A 50,000-message
  drain takes under a second, and this machine's speed changes from one second to the
  next: in session 12's ten runs of 4 rounds, the member's round against the plain
  reader's next to it ranged 0.79-1.02 within one run, and the runs' ratios 0.887-0.998.
  More rounds average more of it; 8 cost some 40 s more.)

Figures: ``shoal_msgs_per_s``, ``plain_msgs_per_s``, ``ratio`` (shoal / plain, target >=
0.9), the CPU each reader used while timed, and ``rss_mb_64_partitions``: two members
share the group (64 partitions each) and consume more traffic, then each reports its
current RSS (/proc/<pid>/status VmRSS, the figure; target <= 150 MB) next to its peak
(VmHWM) and the ``rss_mb`` (ru_maxrss) it publishes in its member stats in etcd.
``member_log_problems`` counts WARNING / ERROR / Traceback lines in the member logs.
``go_nats_bench_fetch_msgs_per_s``: the Go client's ``nats bench js fetch`` (explicit
acks, the plain reader's batch) on the same server afterwards, as the reference (needs
the nats CLI that ``make tools`` builds).
``plain_lean_client_msgs_per_s`` and ``ratio_to_lean_plain``: a third side, the same plain
reader on the member's own client path (``harness.plain --client lean``), as a second
reference (``--no-lean-reference`` leaves it out).
``nats_in_msgs_per_msg``: what each reader sent the server per message (one ack, plus its
share of pull requests and anything else), from nats-server's ``/varz``.
``--strict`` exits 1 when a figure misses its target.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.js import api

from harness.bench import (
    add_run_options,
    bench_main,
    bench_servers,
    cpu_seconds,
    emit,
    emit_log_problems,
    note,
    scrape_counter,
    varz,
)
from harness.children import dying_with_parent
from harness.fleet import Fleet, Member, settled, wait_for_status
from harness.localkube.tools import natscli_path
from harness.servers import free_port
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import durable_name
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group
from shoal.group.status import read_status

BENCH = "throughput"
NAMESPACE = "bench"
GROUP = "throughput"
HANDLER = "shoal.consumer.handlers:noop"
PROCESSED = "shoal_messages_processed_total"
OK = 'outcome="ok"'


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Messages/s of one shoal member (128 partitions, noop handler) against a "
        "plain nats-py pull-and-ack loop on the same stream, and the RSS of a member owning "
        "64 partitions. One JSON line per figure on stdout; progress on stderr.",
    )
    parser.add_argument("--messages", type=int, default=50_000, help="backlog per round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds (order alternates)")
    parser.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="leave out the untimed round before the timed ones",
    )
    parser.add_argument("--projects", type=int, default=1_000, help="distinct project ids")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes per message")
    parser.add_argument("--partitions", type=int, default=128)
    parser.add_argument("--plain-batch", type=int, default=256, help="plain consumer's pull batch")
    parser.add_argument(
        "--no-lean-reference",
        dest="lean_reference",
        action="store_false",
        help="leave out the third side: the plain reader on the member's client path",
    )
    parser.add_argument(
        "--rss-messages", type=int, default=20_000, help="traffic for the RSS phase"
    )
    parser.add_argument("--timeout", type=float, default=90.0, help="per drain, seconds")
    parser.add_argument(
        "--member-code",
        metavar="DIR",
        help="run the member from another checkout of Shoal (e.g. a worktree of an older "
        "commit), to compare commits in one run: its source folders go first on the "
        "member's PYTHONPATH",
    )
    add_run_options(parser)
    return parser.parse_args(argv)


def backlog(count: int, projects: int, payload: int, run: str) -> list[Outgoing]:
    data = b"x" * payload
    return [Outgoing(f"project-{i % projects}", data, f"{run}-{i}") for i in range(count)]


def proc_status(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, in MB."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(rest.split()[0]) / 1024, 1)
    return out


async def check_drained(js: Any, stream: str, durables: list[str], timeout: float = 10.0) -> None:
    """Every durable has nothing pending and nothing unacknowledged on the server."""

    async def undrained() -> dict[str, tuple[int, int]]:
        left: dict[str, tuple[int, int]] = {}
        for durable in durables:
            info = await js.consumer_info(stream, durable)
            pending, unacked = int(info.num_pending or 0), int(info.num_ack_pending or 0)
            if pending or unacked:
                left[durable] = (pending, unacked)
        return left

    await eventually_async(
        undrained,
        timeout,
        f"{len(durables)} durables to drain",
        until=lambda left: not left,
        interval=0.2,
        describe=lambda left: (
            f"{len(left)} durables not drained (pending, unacked): {dict(list(left.items())[:5])}"
        ),
    )


async def processed(ports: list[int]) -> float:
    """The sum of the members' ok-processed counters."""
    total = 0.0
    for port in ports:
        total += await asyncio.to_thread(scrape_counter, port, PROCESSED, OK)
    return total


async def wait_metrics(port: int, timeout: float) -> None:
    """Wait until a member's /metrics page answers."""
    await eventually_async(
        lambda: processed([port]),
        timeout,
        f"the metrics page on port {port}",
        until=lambda _: True,  # any answer will do, 0 messages included
        retry_on=(OSError,),
    )


async def watch_counter(
    ports: list[int], target: float, timeout: float, interval: float = 0.05
) -> tuple[float | None, float, float]:
    """Poll the counters until their sum reaches target.

    Returns (monotonic time the sum first moved, time it reached target, the sum)."""
    base = await processed(ports)
    first: float | None = None
    total = base

    async def progress() -> tuple[float | None, float, float]:
        nonlocal first, total
        with contextlib.suppress(OSError):  # a missed scrape keeps the last sum
            total = await processed(ports)
        now = time.monotonic()
        if first is None and total > base:
            first = now
        return first, now, total

    return await eventually_async(
        progress,
        timeout,
        f"the members to process {target:.0f} messages",
        until=lambda seen: seen[2] >= target,
        interval=interval,
        describe=lambda seen: f"{seen[2]:.0f} processed",
    )


class DrainClock:
    """When a reader's last ack was applied, as the server saw it: the same for both
    sides, and free for the readers (it asks the server, never the reader).

    The latest ``ack_floor.last_active`` of the durables, read once every durable has
    nothing pending and nothing unacknowledged. That is polled with one ``CONSUMER.LIST``
    request every 0.25 s: the end time comes from the server, so the polls need not be
    frequent, and cost the server next to nothing.
    """

    def __init__(self, js: Any, stream: str, durables: list[str]) -> None:
        self.js = js
        self.stream = stream
        self.durables = set(durables)

    async def last_ack(self, timeout: float) -> float:
        """Wall-clock time of the last ack (the server's clock is this host's)."""
        deadline = time.monotonic() + timeout
        while True:
            infos = [
                i for i in await self.js.consumers_info(self.stream) if i.name in self.durables
            ]
            if len(infos) != len(self.durables):
                raise RuntimeError(f"{len(infos)} of {len(self.durables)} durables listed")
            if all(not i.num_pending and not i.num_ack_pending for i in infos):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the backlog was not drained in time")
            await asyncio.sleep(0.25)
        acks = [i.ack_floor.last_active for i in infos if i.ack_floor.last_active is not None]
        return float(max(a.timestamp() for a in acks))


async def first_processed(port: int, pid: int, timeout: float) -> tuple[float, float]:
    """When a member processed its first message: the wall time of the last scrape of its
    ok counter (every 10 ms) that still saw none, so the start is never later than the
    truth; and its CPU seconds then. The scrapes stop there: once it runs, the member is
    asked nothing more (the plain reader reports its own first message)."""
    deadline = time.monotonic() + timeout
    base = await processed([port])
    while True:
        cpu = cpu_seconds(pid)
        at = time.time()
        with contextlib.suppress(OSError):
            if await processed([port]) > base:
                return at, cpu
        if time.monotonic() > deadline:
            raise TimeoutError("the member processed nothing")
        await asyncio.sleep(0.01)


@dataclass
class PlainResult:
    first: float | None = None  # monotonic time of the first message
    last: float = 0.0  # monotonic time of the last ack
    acked: int = 0
    cpu_s: float = 0.0  # its CPU seconds from the first message to the last ack


async def run_plain(
    url: str,
    stream: str,
    durables: list[str],
    target: int,
    batch: int,
    timeout: float,
    on_ready: Any,
    client: str = "nats-py",
) -> tuple[PlainResult, int]:
    """Run harness.plain in its own process (as a member is); returns its result and pid."""
    command = [
        sys.executable,
        "-m",
        "harness.plain",
        "--url",
        url,
        "--stream",
        stream,
        "--durables",
        ",".join(durables),
        "--target",
        str(target),
        "--batch",
        str(batch),
        "--timeout",
        str(timeout),
        "--client",
        client,
    ]
    proc = await asyncio.create_subprocess_exec(
        *dying_with_parent(command), stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(30):
            line = await proc.stdout.readline()
        if not line:
            raise RuntimeError("harness.plain exited before it was ready")
        await on_ready(proc.pid)
        async with asyncio.timeout(timeout + 10):
            line = await proc.stdout.readline()
        if not line:
            raise RuntimeError("harness.plain exited without a result")
        raw = json.loads(line)
        return PlainResult(raw["first"], raw["last"], raw["acked"], raw["cpu_s"]), proc.pid
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await proc.wait()


@dataclass
class Side:
    seconds: float = 0.0
    messages: int = 0
    start_delay: list[float] = field(default_factory=list)
    reader_cpu: float = 0.0  # CPU seconds of the reading process while timed
    nats_cpu: float = 0.0
    rounds: list[float] = field(default_factory=list)  # msgs/s per round
    nats_in_msgs: int = 0  # what the reader sent the server: acks, pull requests, ...

    def add(
        self, messages: int, seconds: float, delay: float, reader: float, srv: ServerSample
    ) -> None:
        self.nats_in_msgs += srv.in_msgs
        self.messages += messages
        self.seconds += seconds
        self.start_delay.append(round(delay, 3))
        self.reader_cpu += reader
        self.nats_cpu += srv.cpu
        self.rounds.append(round(messages / seconds, 1))

    def figures(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "rounds": self.rounds,
            "reader_cpu_pct": 100 * self.reader_cpu / self.seconds,
            "nats_cpu_pct": 100 * self.nats_cpu / self.seconds,
            # CPU per message does not depend on what else the machine runs, as the rates
            # do: on 2 cores the reader and nats-server share what is left of them.
            "reader_cpu_us_per_msg": round(1e6 * self.reader_cpu / self.messages, 1),
            "nats_cpu_us_per_msg": round(1e6 * self.nats_cpu / self.messages, 1),
            # One ack per message, and the rest mostly pull requests: each costs the
            # server about as much as a message or two.
            "nats_in_msgs_per_msg": round(self.nats_in_msgs / self.messages, 4),
            "start_delay_s": self.start_delay,
        }

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


@dataclass(frozen=True)
class ServerSample:
    """nats-server's CPU seconds and inbound messages so far (or between two samples)."""

    cpu: float
    in_msgs: int

    @classmethod
    def take(cls, pid: int, monitor_url: str) -> ServerSample:
        return cls(cpu_seconds(pid), int(varz(monitor_url)["in_msgs"]))

    def since(self, before: ServerSample) -> ServerSample:
        return ServerSample(self.cpu - before.cpu, self.in_msgs - before.in_msgs)


class Bench:
    def __init__(
        self,
        args: argparse.Namespace,
        fleet: Fleet,
        config: GroupConfig,
        etcd: Etcd,
        nc: Any,
        nats_pid: int,
        nats_monitor: str,
    ) -> None:
        self.args = args
        self.fleet = fleet
        self.config = config
        self.etcd = etcd
        self.nc = nc
        self.js = nc.jetstream()
        self.nats_pid = nats_pid
        self.nats_monitor = nats_monitor
        self.url = config.nats_url
        self.stream = config.stream
        self.partition_durables = [durable_name(p) for p in range(config.partitions)]
        self.producer = Producer(self.js, config.subject_prefix, config.partitions)
        self.shoal = Side()
        self.plain = Side()
        self.lean = Side()  # the plain reader on the member's client path
        self.clock = DrainClock(self.js, self.stream, self.partition_durables)

    async def setup(self) -> None:
        await ensure_group(self.js, self.config)
        info = await self.js.stream_info(self.stream)
        if info.config.retention != api.RetentionPolicy.LIMITS:
            raise RuntimeError(f"stream {self.stream} has {info.config.retention} retention")

    async def publish_backlog(self, run: str) -> None:
        """Publish a backlog while no reader runs (so each side starts from all of it)."""
        a = self.args
        before = int((await self.js.stream_info(self.stream)).state.messages)
        t = time.monotonic()
        await self.producer.publish_many(backlog(a.messages, a.projects, a.payload, run))
        took = time.monotonic() - t
        after = int((await self.js.stream_info(self.stream)).state.messages)
        if after - before != a.messages:
            raise RuntimeError(f"stream grew by {after - before}, not {a.messages}")
        note(f"published {a.messages} messages in {took:.1f} s ({a.messages / took:.0f} msg/s)")

    async def time_shoal(self, side: Side | None = None) -> None:
        """A member that joins the group alone, claims all partitions, drains the backlog.

        Timed from its first processed message (its start-up and claiming are not charged,
        as the plain side's connecting is not) to the server's last applied ack.
        """
        port = free_port()
        started = time.time()
        member = self.fleet.start("m-0", SHOAL_METRICS_PORT=str(port))
        await wait_metrics(port, 30)
        first, member_cpu0 = await first_processed(port, member.pid, self.args.timeout)
        nats0 = self.server()
        last = await self.clock.last_ack(self.args.timeout)
        member_cpu1, nats1 = cpu_seconds(member.pid), self.server()
        await check_drained(self.js, self.stream, self.partition_durables)
        self.fleet.term("m-0")
        await asyncio.to_thread(self.fleet.wait_exit, "m-0", 60)
        seconds = last - first
        (self.shoal if side is None else side).add(
            self.args.messages,
            seconds,
            first - started,
            member_cpu1 - member_cpu0,
            nats1.since(nats0),
        )
        note(
            f"shoal: {self.args.messages} in {seconds:.2f} s = "
            f"{self.args.messages / seconds:.0f} msg/s (first message {first - started:.2f} s "
            "after the start)"
        )

    async def time_plain(self, client: str = "nats-py", side: Side | None = None) -> None:
        """The plain consumer on the same durables (no member runs meanwhile): from its
        first message (its own report) to the server's last applied ack, as for shoal."""
        if side is None:
            side = self.lean if client == "lean" else self.plain
        nats0 = ServerSample(0.0, 0)
        started = time.time()

        async def ready(pid: int) -> None:
            nonlocal nats0
            nats0 = self.server()

        result, _ = await run_plain(
            self.url,
            self.stream,
            self.partition_durables,
            self.args.messages,
            self.args.plain_batch,
            self.args.timeout,
            ready,
            client,
        )
        last = await self.clock.last_ack(self.args.timeout)
        nats1 = self.server()
        await check_drained(self.js, self.stream, self.partition_durables)
        if result.first is None:
            raise RuntimeError("the plain reader saw no message")
        # Its monotonic times (the clock is system-wide) as wall-clock times.
        offset = time.time() - time.monotonic()
        first = result.first + offset
        seconds = last - first
        side.add(
            result.acked,
            seconds,
            first - started,
            result.cpu_s,
            nats1.since(nats0),
        )
        note(
            f"plain ({client}): {result.acked} in {seconds:.2f} s = "
            f"{result.acked / seconds:.0f} msg/s "
            f"(first message {first - started:.2f} s after the start; its own last ack "
            f"{1000 * (result.last + offset - last):+.0f} ms from the server's)"
        )

    def server(self) -> ServerSample:
        return ServerSample.take(self.nats_pid, self.nats_monitor)

    async def start_member(self, member_id: str, members: set[str]) -> tuple[Member, int]:
        port = free_port()
        member = self.fleet.start(member_id, SHOAL_METRICS_PORT=str(port))
        c = self.config
        await wait_for_status(self.etcd, NAMESPACE, GROUP, c.partitions, settled(members), 60)
        await wait_metrics(port, 10)
        return member, port

    async def throughput(self) -> None:
        """Each side consumes a backlog of its own from the same 128 durables, alone."""
        a, c = self.args, self.config
        if a.warm_up:
            # The server's first drains of the durables are its slowest: in 9 runs of 2
            # rounds, the side timed first (the member) read its first round 17 % slower
            # than its second, in every run (the plain side 5 %). Each side drains a
            # backlog once, untimed.
            for side in ("plain", "shoal"):
                await self.publish_backlog(f"warm-up-{side}")
                if side == "shoal":
                    await self.time_shoal(Side())
                else:
                    await self.time_plain(side=Side())
            note("warm-up round done; the timed rounds follow")
        for round_ in range(a.rounds):
            sides = ["shoal", "plain"] if round_ % 2 == 0 else ["plain", "shoal"]
            if a.lean_reference:
                sides.insert(round_ % 3, "lean")
            for side in sides:
                await self.publish_backlog(f"r{round_}-{side}")
                if side == "shoal":
                    await self.time_shoal()
                else:
                    await self.time_plain("lean" if side == "lean" else "nats-py")
        common = {
            "messages": self.shoal.messages,
            "projects": a.projects,
            "partitions": c.partitions,
            "payload_bytes": a.payload,
        }
        emit(
            BENCH,
            "shoal_msgs_per_s",
            self.shoal.rate,
            members=1,
            handler=HANDLER,
            fetch_batch=c.fetch_batch,
            **self.shoal.figures(),
            **common,
        )
        emit(
            BENCH,
            "plain_msgs_per_s",
            self.plain.rate,
            fetch_batch=a.plain_batch,
            **self.plain.figures(),
            **common,
        )
        ratio = self.shoal.rate / self.plain.rate
        emit(BENCH, "ratio", ratio, target=">= 0.9", ok=ratio >= 0.9)
        if self.lean.messages:
            emit(
                BENCH,
                "plain_lean_client_msgs_per_s",
                self.lean.rate,
                note="the plain reader on the member's client path: a reference, not the "
                "target's baseline (docs/data-path.md)",
                fetch_batch=a.plain_batch,
                **self.lean.figures(),
                **common,
            )
            emit(BENCH, "ratio_to_lean_plain", self.shoal.rate / self.lean.rate)

    async def rss(self) -> None:
        a, c = self.args, self.config
        member_a, port_a = await self.start_member("m-0", {"m-0"})
        member_b, port_b = await self.start_member("m-1", {"m-0", "m-1"})
        status = await read_status(self.etcd, NAMESPACE, GROUP, c.partitions)
        note(f"two members settled: {status.counts}")
        ports = [port_a, port_b]
        base = await processed(ports)
        note(f"publishing {a.rss_messages} more messages for the RSS phase")
        await self.producer.publish_many(backlog(a.rss_messages, a.projects, a.payload, "rss"))
        await watch_counter(ports, base + a.rss_messages, a.timeout)
        await check_drained(self.js, self.stream, self.partition_durables)
        # Member stats are refreshed on every keep-alive.
        await asyncio.sleep(c.keepalive_interval + 0.5)
        status = await read_status(self.etcd, NAMESPACE, GROUP, c.partitions)
        per_member: dict[str, dict[str, Any]] = {}
        for member in (member_a, member_b):
            stats = status.members.get(member.member_id)
            proc = proc_status(member.pid)
            per_member[member.member_id] = {
                "partitions": status.counts.get(member.member_id),
                "vm_rss_mb": proc.get("VmRSS"),
                "vm_hwm_mb": proc.get("VmHWM"),
                "stats_rss_mb": stats.rss_mb if stats is not None else None,
            }
        note(f"rss: {per_member}")
        worst = max(float(m["vm_rss_mb"] or 0) for m in per_member.values())
        emit(
            BENCH,
            "rss_mb_64_partitions",
            worst,
            source="max over members of /proc/<pid>/status VmRSS",
            target="<= 150",
            ok=worst <= 150,
            members=per_member,
            messages=a.rss_messages,
        )


GO_FETCH_LINE = re.compile(r"consumer \(fetch\) stats: ([\d,]+) msgs/sec")


def go_reference(nats_url: str, messages: int, payload: int, batch: int) -> None:
    """The Go client's figure on the same server, as the reference: ``nats bench js
    fetch`` (explicit acks, one client) over a stream of its own, after the timed sides.
    Neither Python reader can come near it; it shows what the server can deliver."""
    cli = natscli_path()
    if not cli.is_file():
        note(f"no {cli}: `make tools` builds the nats CLI; no Go reference figure")
        emit(BENCH, "go_nats_bench_fetch_msgs_per_s", None, missing=str(cli))
        return
    common = ["-s", nats_url, "bench", "js"]
    sizes = ["--stream", "go_reference", "--msgs", str(messages), "--no-progress"]
    subprocess.run(
        [
            str(cli),
            *common,
            "pub",
            "async",
            "go.reference",
            *sizes,
            "--size",
            f"{payload}B",
            "--create",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    fetched = subprocess.run(
        [str(cli), *common, "fetch", *sizes, "--batch", str(batch), "--acks", "explicit"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = GO_FETCH_LINE.search(fetched.stdout + fetched.stderr)
    if found is None:
        raise RuntimeError(f"no rate in the output of nats bench js fetch: {fetched.stdout}")
    emit(
        BENCH,
        "go_nats_bench_fetch_msgs_per_s",
        float(found.group(1).replace(",", "")),
        tool=f"nats bench js fetch --batch {batch} --acks explicit (1 client)",
        messages=messages,
        payload_bytes=payload,
    )


def member_env(code: str | None) -> dict[str, str]:
    env = {"SHOAL_RETENTION": "limits"}
    if code:
        checkout = Path(code).resolve()
        folders = [checkout / part / "src" for part in ("common", "consumer")]
        missing = [str(f) for f in folders if not f.is_dir()]
        if missing:
            raise SystemExit(f"--member-code {code}: no Shoal source folders {missing}")
        env["PYTHONPATH"] = ":".join(str(f) for f in folders)
        note(f"members run the code in {checkout}")
    return env


async def run(args: argparse.Namespace, root: Path) -> None:
    async with bench_servers(root) as servers:
        nats_server = servers.nats_server
        config = servers.group_config(
            NAMESPACE, GROUP, HANDLER, partitions=args.partitions, retention="limits"
        )
        # Not Fleet.for_config: the members have always run with SHOAL_LEDGER=true
        # (Fleet's default) while the group's config leaves the ledger out.
        with Fleet(
            root / "members",
            nats_url=config.nats_url,
            etcd_endpoint=config.etcd_endpoints,
            namespace=NAMESPACE,
            group=GROUP,
            handler=HANDLER,
            partitions=args.partitions,
            env=member_env(args.member_code),
        ) as fleet:
            try:
                if nats_server.pid is None:
                    raise RuntimeError("nats-server is not running")
                bench = Bench(
                    args,
                    fleet,
                    config,
                    servers.etcd,
                    servers.nc,
                    nats_server.pid,
                    nats_server.monitor_url,
                )
                await bench.setup()
                await bench.throughput()
                await bench.rss()
                await asyncio.to_thread(
                    go_reference, nats_server.url, args.messages, args.payload, args.plain_batch
                )
            finally:
                fleet.close()
                emit_log_problems(BENCH, root / "members")


def main(argv: list[str] | None = None) -> int:
    return bench_main("shoal-bench-throughput-", argv, parse_args, run)


if __name__ == "__main__":
    raise SystemExit(main())
