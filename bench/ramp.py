"""How fast a member reaches its pace: a cold start on a backlog, and a burst after quiet.

Issue 29's ramp and burst targets, measured as a user meets them: member processes
(128 partitions) whose handler is ``harness.handlers:stamped`` (the in-process ``noop``
handler that also notes when it finished each message), on a stream with work-queue
retention (the default). Two curves of each drain, both reported:

* **handled**: what the handlers finished, from their stamps (time.monotonic(), one
  clock for every process of the machine; written when the members exit). This is what
  the team's code sees, and what the targets are measured on.
* **acked**: what the server has applied: the stream's last sequence minus the messages
  it still holds (acked messages leave a work-queue stream), read with STREAM.INFO every
  ``--sample`` seconds, so nothing is asked of the members.

On each curve (harness.rampcurve):

* ``t0``, the first message: the first stamp, or the last sample that saw nothing acked;
* its pace: the median of its rates over ``--bucket``-second windows from ``t0`` to the
  drain's end (issue 29's definition; the fastest window, ``peak``, is reported beside);
* ``first_second_ratio``: what was consumed in the first second after ``t0`` over the
  pace (target >= 0.8), and over the drain's mean rate (``to_mean_rate``: a drain that
  stops and goes has a median below what it mostly ran at, which would flatter the
  ratio; the target holds only if both are met);
* ``ramp_seconds``: from ``t0`` to the first window whose rate reaches 90 % of the pace
  (target <= 0.5).

Scenarios (``--rounds`` rounds each):

* ``cold``: a backlog (default 100,000 messages over 1,000 projects) is published, then
  one member starts; its start-up (connecting, leading, claiming) comes before ``t0`` and
  is reported apart.
* ``burst``: one member starts on an empty stream, settles, and idles ``--quiet`` seconds
  (its partitions' pulls come back empty three times in a row and they doze: a core
  subscription wakes them); then the burst is published by the Go producer of
  examples/go (``--go-producer``; nats.go, ``--go-max-pending`` publishes awaiting
  their acks at once, 8,192 by default: as many producers at once reach the server, the
  burst arrives faster than one member consumes it, so a backlog builds).
* ``burst_python``: the same burst published from this process in Python, without
  waiting for each publish's ack: on 2 cores that loop takes most of a core for about a
  second, which the member's first second then lacks (a machine's own producers compete
  with the member; remote ones do not). Reported beside ``burst``, which decides.
* ``burst_woken``: the member is stopped (SIGSTOP) while the Go producer publishes the
  burst, and continued once the stream holds it all: it wakes with its partitions dozing
  and their alarms rung into the whole burst, and nothing else runs. Its first second is
  its own ramp from dozing, apart from what the publisher and the server's storing take
  of 2 cores while a burst arrives (on a real cluster they run on other machines).
* ``four_members_20ms``: four members whose handler waits 20 ms (SHOAL_HANDLER_DELAY_MS),
  started together on a 30,000-message backlog over 1,000 projects, timed from the first
  message to the last (target >= 12,000 msg/s).

``--storage memory`` runs the same on memory streams (what the server's file store costs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import goexamples
from harness.bench import (
    BenchServers,
    add_run_options,
    bench_main,
    bench_servers,
    emit,
    note,
    serious_problems,
)
from harness.cputimeline import CpuTimeline
from harness.fleet import Fleet, settled, wait_for_status
from harness.handlers import read_stamps
from harness.rampcurve import Curve, Ramp, ramp_of
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import durable_name
from shoal.group.config import GroupConfig, config_env
from shoal.group.jetstream import ensure_group

BENCH = "ramp"
NAMESPACE = "bench"
STAMPED = "harness.handlers:stamped"
PAYLOAD = b"x" * 64


@dataclass
class Drain:
    handled: Curve  # when the handlers finished each message (their stamps)
    acked: Curve  # what the server had applied (the stream's count, sampled)
    started: float  # when the members were started
    publish_seconds: float
    # Deliveries beyond one per message: the server redelivered what it had not applied
    # the ack of within ack_wait (the member acked those again: settled.py).
    redelivered: int
    # The CPU of nats-server, the member(s), the publisher and the machine meanwhile.
    cpu: CpuTimeline
    partitions: int

    def first_second_cores(self) -> dict[str, float]:
        """Cores each process (and the machine, "host") used in the handled curve's first
        second: a member short of CPU, and who had it, shows here."""
        t0 = self.handled.t0
        return self.cpu.cores(t0, t0 + 1.0)

    def cpu_us_per_msg(self) -> dict[str, float]:
        """Microseconds of CPU per message each process (and the machine) spent from the
        first message handled to the last ack the server applied."""
        used = self.cpu.seconds(self.handled.t0, self.acked.end)
        total = self.handled.total
        return {name: round(seconds * 1e6 / total, 1) for name, seconds in used.items()}


@dataclass
class Round:
    """A drain and the ramps of its two curves, computed once (ramps() notes them,
    summary() reports them)."""

    drain: Drain
    handled: Ramp
    acked: Ramp


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path, servers: BenchServers) -> None:
        self.args = args
        self.root = root
        self.servers = servers
        self.js = servers.js
        self.etcd = servers.etcd
        self.log_problems = 0
        self.go_producer = (
            Path(args.go_producer) if args.go_producer else goexamples.build()["producer"]
        )

    def config(self, group: str, handler: str) -> GroupConfig:
        return self.servers.group_config(
            NAMESPACE,
            group,
            handler,
            ledger=False,
            storage=self.args.storage,
            partitions=self.args.partitions,
        )

    async def publish(self, config: GroupConfig, count: int) -> float:
        """Publish `count` messages over --projects projects; returns the seconds taken."""
        items = [
            Outgoing(f"project-{i % self.args.projects}", PAYLOAD, f"{config.group}-{i}")
            for i in range(count)
        ]
        started = time.monotonic()
        await Producer(self.js, config.subject_prefix, config.partitions).publish_many(items)
        return time.monotonic() - started

    async def flood(self, config: GroupConfig, count: int) -> float:
        """Publish `count` messages as a burst from many producers reaches the server: as
        fast as the connection takes them, without waiting for each one's ack (one
        flush at the end); the stream stores them all (watch() waits for every one)."""
        producer = Producer(self.js, config.subject_prefix, config.partitions)
        nc = self.servers.nc
        routed = [
            producer.prepare(Outgoing(f"project-{i % self.args.projects}", b"", f"b-{i}"))
            for i in range(count)
        ]
        started = time.monotonic()
        for i, (subject, headers) in enumerate(routed):
            await nc.publish(subject, PAYLOAD, headers=headers)
            if i % 1000 == 999:
                await nc.flush()  # stay well inside the client's pending buffer
        await nc.flush()
        return time.monotonic() - started

    async def flood_go(self, config: GroupConfig, count: int, cpu: CpuTimeline) -> float:
        """Publish `count` messages with the Go producer of examples/go (nats.go, many
        publishes awaiting their acks at once): a burst from producers written in Go
        costs this machine's 2 cores a fraction of what the Python loop above does, so
        less of the member's first second goes to the publisher. Returns the seconds
        the producer took, as it says."""
        process = await asyncio.create_subprocess_exec(
            str(self.go_producer),
            "-url",
            self.servers.nats_server.url,
            "-prefix",
            config.subject_prefix,
            "-partitions",
            str(config.partitions),
            "-count",
            str(count),
            "-projects",
            str(self.args.projects),
            "-run-id",
            config.group,
            "-max-pending",
            str(self.args.go_max_pending),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        cpu.watch("publisher", process.pid)
        try:
            async with asyncio.timeout(self.args.timeout):
                out, err = await process.communicate()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        if process.returncode != 0:
            raise RuntimeError(
                f"the Go producer failed ({process.returncode}): {err.decode()[-2000:]}"
            )
        return float(json.loads(out.decode().strip().splitlines()[-1])["seconds"])

    async def watch(self, config: GroupConfig, total: int, cpu: CpuTimeline) -> Curve:
        """Sample what was consumed, and who had the CPU, until all `total` messages were
        (or --timeout)."""
        curve = Curve(total)
        deadline = time.monotonic() + self.args.timeout
        while True:
            state = (await self.js.stream_info(config.stream)).state
            now = time.monotonic()
            cpu.sample(now)
            consumed = int(state.last_seq) - int(state.messages)
            curve.add(now, consumed)
            if consumed >= total:
                return curve
            if now > deadline:
                raise RuntimeError(f"{config.group}: {total - consumed} left after the timeout")
            await asyncio.sleep(self.args.sample)

    async def drain(
        self,
        group: str,
        members: int,
        *,
        burst: bool,
        delay_ms: float = 0,
        publisher: str = "python",
    ) -> Drain:
        """Run `members` stamped members over `count` messages: published before they
        start (a cold start), or once they have settled and idled --quiet seconds (a
        burst). Stopped once the stream is empty, so that they write their stamps."""
        a = self.args
        count = a.io_messages if members > 1 else a.messages
        config = self.config(group, STAMPED)
        await ensure_group(self.js, config)
        publish_seconds = 0.0 if burst else await self.publish(config, count)
        names = [f"m-{i}" for i in range(members)]
        workdir = self.root / group
        cpu = CpuTimeline()
        if (server_pid := self.servers.nats_server.pid) is not None:
            cpu.watch("nats-server", server_pid)
        with Fleet.for_config(workdir, config) as fleet:
            started = time.monotonic()
            for name in names:
                env = {"SHOAL_STAMPS_FILE": str(workdir / f"{name}.stamps")}
                if delay_ms:
                    env["SHOAL_HANDLER_DELAY_MS"] = f"{delay_ms:g}"
                member = fleet.start(name, **env, **config_env(config, ("ledger", "storage")))
                cpu.watch("member", member.pid)
            if burst:
                await wait_for_status(
                    self.etcd, NAMESPACE, group, config.partitions, settled(set(names)), 60
                )
                await asyncio.sleep(a.quiet)  # pulls come back empty: the partitions doze
                if publisher == "python":
                    # (This process publishes, and samples the stream besides.)
                    cpu.watch("publisher", os.getpid())
                watcher = asyncio.ensure_future(self.watch(config, count, cpu))
                if publisher == "go-frozen":
                    # The member stopped (SIGSTOP) while the burst is published and
                    # stored: it then wakes into the whole burst with nothing else
                    # running, its partitions dozing and their alarms rung. What it does
                    # in its first second is then its own ramp, none of it lost to the
                    # publisher and the server's storing on the same 2 cores.
                    for name in names:
                        fleet.signal(name, signal.SIGSTOP)
                    try:
                        publish_seconds = await self.flood_go(config, count, cpu)
                    finally:
                        for name in names:
                            fleet.signal(name, signal.SIGCONT)
                elif publisher == "go":
                    publish_seconds = await self.flood_go(config, count, cpu)
                else:
                    publish_seconds = await self.flood(config, count)
                acked = await watcher
            else:
                acked = await self.watch(config, count, cpu)
        redelivered = -count
        for p in range(config.partitions):
            info = await self.js.consumer_info(config.stream, durable_name(p))
            redelivered += info.delivered.consumer_seq
        self.log_problems += serious_problems(workdir.glob("*.log"))
        stamps = sorted(t for name in names for t in read_stamps(workdir / f"{name}.stamps"))
        if len(stamps) != count:
            raise RuntimeError(f"{group}: the handlers saw {len(stamps)} of {count} messages")
        handled = Curve.of_stamps(count, stamps)
        return Drain(handled, acked, started, publish_seconds, redelivered, cpu, config.partitions)

    async def ramps(self, kind: str, publisher: str = "python") -> list[Round]:
        rounds = []
        for r in range(self.args.rounds):
            drain = await self.drain(f"{kind}-{r}", 1, burst=kind != "cold", publisher=publisher)
            handled = ramp_of(drain.handled, self.args.bucket)
            acked = ramp_of(drain.acked, self.args.bucket)
            before = (
                f"published in {drain.publish_seconds:.2f} s"
                if kind != "cold"
                else f"start-up {drain.handled.t0 - drain.started:.2f} s"
            )
            note(
                f"{kind}-{r}: {before}; handled: first second {handled.first_second_msgs:.0f}"
                f" at a pace of {handled.pace:.0f} msg/s ({handled.first_second_ratio:.2f}),"
                f" 90 % of it after {_fmt(handled.ramp_seconds)} s, all in "
                f"{handled.drain_seconds:.2f} s; acked by the server: first second "
                f"{acked.first_second_msgs:.0f}, pace {acked.pace:.0f} msg/s, all in "
                f"{acked.drain_seconds:.2f} s; {drain.redelivered} redelivered"
            )
            cores = ", ".join(f"{k} {v:.2f}" for k, v in drain.first_second_cores().items())
            note(f"{kind}-{r}: cores used in the first second: {cores}")
            rounds.append(Round(drain, handled, acked))
        return rounds


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def summary(name: str, rounds: list[Round], storage: str, **extra: Any) -> None:
    """The handled curve decides (what the team's code saw); the acked one is beside it."""
    handled = [r.handled for r in rounds]
    acked = [r.acked for r in rounds]
    first = statistics.fmean(r.first_second_ratio for r in handled)
    to_mean = statistics.fmean(r.first_second_to_mean for r in handled)
    ramp_values = [r.ramp_seconds for r in handled]
    worst = None if None in ramp_values else max(v for v in ramp_values if v is not None)
    emit(
        BENCH,
        f"{name}_first_second_ratio",
        first,
        target=">= 0.8 (against the median pace, and against the mean rate)",
        ok=first >= 0.8 and to_mean >= 0.8,
        rounds=[round(r.first_second_ratio, 3) for r in handled],
        to_mean_rate=round(to_mean, 3),
        mean_msgs_per_s=[round(r.mean_rate) for r in handled],
        first_second_msgs=[round(r.first_second_msgs) for r in handled],
        pace_msgs_per_s=[round(r.pace) for r in handled],
        peak_msgs_per_s=[round(r.peak) for r in handled],
        acked_first_second_ratio=[round(r.first_second_ratio, 3) for r in acked],
        acked_pace_msgs_per_s=[round(r.pace) for r in acked],
        acked_first_second_msgs=[round(r.first_second_msgs) for r in acked],
        redelivered=[r.drain.redelivered for r in rounds],
        first_second_cores=[r.drain.first_second_cores() for r in rounds],
        cpu_us_per_msg=[r.drain.cpu_us_per_msg() for r in rounds],
        partitions=rounds[0].drain.partitions,
        storage=storage,
        **extra,
    )
    emit(
        BENCH,
        f"{name}_ramp_seconds",
        worst,
        target="<= 0.5 (the worst round)",
        ok=worst is not None and worst <= 0.5,
        rounds=ramp_values,
        acked_rounds=[r.ramp_seconds for r in acked],
    )


async def run(args: argparse.Namespace, root: Path) -> None:
    async with bench_servers(root) as servers:
        bench = Bench(args, root, servers)
        common = {"messages": args.messages, "projects": args.projects}
        if args.only in (None, "cold"):
            rounds = await bench.ramps("cold")
            summary("cold", rounds, args.storage, **common)
        if args.only in (None, "burst"):
            for kind, publisher in (
                ("burst", "go"),
                ("burst_python", "python"),
                ("burst_woken", "go-frozen"),
            ):
                rounds = await bench.ramps(kind, publisher)
                summary(
                    kind,
                    rounds,
                    args.storage,
                    publisher=publisher,
                    publish_seconds=[round(r.drain.publish_seconds, 2) for r in rounds],
                    quiet_seconds=args.quiet,
                    **common,
                )
        if args.only in (None, "four"):
            drain = await bench.drain("four-20ms", 4, burst=False, delay_ms=args.delay_ms)
            seconds = drain.handled.end - drain.handled.t0
            rate = args.io_messages / seconds
            note(f"four-20ms: {args.io_messages} in {seconds:.2f} s from the first message")
            emit(
                BENCH,
                "four_members_20ms_cold_msgs_per_s",
                rate,
                target=">= 12000",
                ok=rate >= 12000,
                messages=args.io_messages,
                projects=args.projects,
                handler_ms=args.delay_ms,
                acked_msgs_per_s=args.io_messages / (drain.acked.end - drain.acked.t0),
                cpu_us_per_msg=drain.cpu_us_per_msg(),
            )
        emit(BENCH, "member_log_problems", bench.log_problems, target="0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="A member's ramp: cold start on a backlog, burst after quiet (issue 29).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--messages", type=int, default=100_000, help="backlog / burst size")
    parser.add_argument("--projects", type=int, default=1_000)
    parser.add_argument(
        "--partitions", type=int, default=128, help="the group's partitions (and durables)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sample", type=float, default=0.02, help="seconds between samples")
    parser.add_argument("--bucket", type=float, default=0.25, help="pace window, seconds")
    parser.add_argument("--quiet", type=float, default=5.0, help="idle seconds before a burst")
    parser.add_argument("--io-messages", type=int, default=30_000)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=120.0, help="per drain, seconds")
    parser.add_argument(
        "--storage", choices=("file", "memory"), default="file", help="the stream's storage"
    )
    parser.add_argument("--only", choices=("cold", "burst", "four"))
    parser.add_argument(
        "--go-max-pending",
        type=int,
        default=8192,
        help="the Go producer's publishes awaiting their acks at once (a burst: many)",
    )
    parser.add_argument(
        "--go-producer", help="a build of examples/go/producer (default: built, harness.goexamples)"
    )
    add_run_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return bench_main("shoal-bench-ramp-", argv, parse_args, run)


if __name__ == "__main__":
    raise SystemExit(main())
