"""I/O-bound throughput of a group, and what a settled idle group costs.

Figures (one JSON line each):

* ``io_msgs_per_s``: 4 members (128 partitions), a handler that awaits 20 ms per
  message (``SHOAL_HANDLER_DELAY_MS``), a backlog of 30,000 messages over 1,000 projects
  published before the members start; timed from the moment all of them own their
  share to the stream being empty (work-queue retention deletes what is acked).
  Target >= 12,000 msg/s. Beside it,
  ``partition_at_a_time_ceiling`` = partitions / handler latency, what processing one
  message per partition at a time could reach at best.
* ``io_audited_msgs_per_s``: the same with the ``ledger`` handler (it records each message
  in the ledger stream, so the run can be audited: lost, duplicates, per-project order
  inversions and overlaps must all be 0). The ledger's extra JetStream publish per message
  makes this rate lower; it is the proof, the first one the speed.
* ``idle_nats_cpu_pct``, ``idle_nats_msgs_per_s``, ``idle_member_cpu_pct``: a settled
  group of 3 members with nothing to consume, measured over ``--idle-seconds``: the
  nats-server's CPU and its in+out message rate (its /varz), each member's CPU (the
  highest is the figure). Targets: <= 1 %, <= 20 msg/s, <= 1 %.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from harness.bench import (
    BenchServers,
    add_run_options,
    bench_main,
    bench_servers,
    cpu_seconds,
    emit,
    note,
    serious_problems,
    varz,
)
from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER
from shoal.group.config import GroupConfig, config_env
from shoal.group.jetstream import ensure_group

BENCH = "datapath"
NAMESPACE = "bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Messages/s of 4 members with an I/O-bound (20 ms) handler, audited, "
        "and the CPU and message rate a settled idle group of 3 costs. One JSON line per "
        "figure on stdout; progress on stderr.",
    )
    parser.add_argument("--messages", type=int, default=30_000)
    parser.add_argument("--projects", type=int, default=1_000)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="handler latency")
    parser.add_argument("--idle-members", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--timeout", type=float, default=120.0, help="per drain, seconds")
    parser.add_argument(
        "--only",
        choices=("io", "idle"),
        help="measure only the I/O-bound figures, or only the idle ones",
    )
    add_run_options(parser)
    return parser.parse_args(argv)


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path, servers: BenchServers) -> None:
        self.args = args
        self.root = root
        self.servers = servers
        self.nats_server = servers.nats_server

    def config(self, group: str, handler: str, *, ledger: bool) -> GroupConfig:
        return self.servers.group_config(NAMESPACE, group, handler, ledger=ledger)

    async def io_bound(
        self, js: Any, etcd: Etcd, handler: str, *, ledger: bool
    ) -> tuple[float, dict[str, Any]]:
        a = self.args
        group = "io-ledger" if ledger else "io"
        config = self.config(group, handler, ledger=ledger)
        env = {"SHOAL_HANDLER_DELAY_MS": str(a.delay_ms)}
        with Fleet.for_config(self.root / group, config, env=env) as fleet:
            # The backlog is published before any member runs, and the rate is measured
            # from the moment all members own their share (claims taken) to the drain:
            # the group's steady state, without the start-up and the first rebalances.
            # (Pausing the durables instead makes the paused consumers keep every pull
            # request they get meanwhile, and answer them all at the resume.)
            await ensure_group(js, config)
            items = [
                Outgoing(
                    f"project-{i % a.projects}",
                    b"x",
                    f"{group}-{i}",
                    {SEQ_HEADER: str(i // a.projects)},
                )
                for i in range(a.messages)
            ]
            await Producer(js, config.subject_prefix, config.partitions).publish_many(items)
            note(f"{group}: {a.messages} messages published; starting {a.members} members")
            members = {f"m-{i}" for i in range(a.members)}
            for member in sorted(members):
                fleet.start(member, **config_env(config, ("handler", "ledger")))
            await wait_for_status(
                etcd, NAMESPACE, group, config.partitions, settled(members), 60, interval=0.05
            )
            resumed = time.monotonic()
            nats_pid = self.nats_server.pid
            assert nats_pid is not None
            nats_cpu0 = cpu_seconds(nats_pid)
            backlog = int((await js.stream_info(config.stream)).state.messages)
            note(f"{group}: settled with {backlog} messages left")

            async def left() -> int:
                return int((await js.stream_info(config.stream)).state.messages)

            await eventually_async(
                left, a.timeout, "the stream to drain", until=lambda n: n == 0, interval=0.05
            )
            seconds = time.monotonic() - resumed
            nats_cpu = 100 * (cpu_seconds(nats_pid) - nats_cpu0) / seconds
            rate = backlog / seconds
            note(f"{group}: {backlog} in {seconds:.2f} s = {rate:.0f} msg/s")
            extra: dict[str, Any] = {"timed_messages": backlog, "nats_cpu_pct": nats_cpu}
            if ledger:
                records = await read_ledger(js, config.ledger_stream)
                extra["audit"] = audit(records, [str(i.message_id) for i in items]).summary()
                note(f"{group}: audit {extra['audit']}")
            extra["member_log_problems"] = serious_problems((self.root / group).glob("*.log"))
        return rate, extra

    async def idle(self, js: Any, etcd: Etcd) -> None:
        a = self.args
        config = self.config("idle", "shoal.consumer.handlers:noop", ledger=False)
        with Fleet.for_config(self.root / "idle", config) as fleet:
            await ensure_group(js, config)
            members = {f"i-{i}" for i in range(a.idle_members)}
            started = {m: fleet.start(m) for m in sorted(members)}
            await wait_for_status(etcd, NAMESPACE, "idle", config.partitions, settled(members), 60)
            await asyncio.sleep(5)  # let start-up work (claims, first stats) pass
            monitor = self.nats_server.monitor_url
            nats_pid = self.nats_server.pid
            assert nats_pid is not None
            v0, c0 = varz(monitor), cpu_seconds(nats_pid)
            m0 = {m: cpu_seconds(p.pid) for m, p in started.items()}
            t0 = time.monotonic()
            await asyncio.sleep(a.idle_seconds)
            seconds = time.monotonic() - t0
            v1, c1 = varz(monitor), cpu_seconds(nats_pid)
            m1 = {m: cpu_seconds(p.pid) for m, p in started.items()}
        # The bench's own connection is idle meanwhile; /varz counts every client.
        msgs = (v1["in_msgs"] - v0["in_msgs"]) + (v1["out_msgs"] - v0["out_msgs"])
        nats_cpu = 100 * (c1 - c0) / seconds
        member_cpu = {m: round(100 * (m1[m] - m0[m]) / seconds, 2) for m in m0}
        emit(
            BENCH,
            "idle_nats_cpu_pct",
            nats_cpu,
            target="<= 1",
            ok=nats_cpu <= 1,
            seconds=round(seconds, 1),
            members=a.idle_members,
        )
        emit(
            BENCH,
            "idle_nats_msgs_per_s",
            msgs / seconds,
            target="<= 20",
            ok=msgs / seconds <= 20,
            in_msgs=v1["in_msgs"] - v0["in_msgs"],
            out_msgs=v1["out_msgs"] - v0["out_msgs"],
        )
        worst = max(member_cpu.values())
        emit(BENCH, "idle_member_cpu_pct", worst, target="<= 1", ok=worst <= 1, members=member_cpu)


async def run(args: argparse.Namespace, root: Path) -> None:
    async with bench_servers(root) as servers:
        bench = Bench(args, root, servers)
        js, etcd = servers.js, servers.etcd
        if args.only != "idle":
            ceiling = 128 / (args.delay_ms / 1000)
            rate, extra = await bench.io_bound(
                js, etcd, "shoal.consumer.handlers:noop", ledger=False
            )
            emit(
                BENCH,
                "io_msgs_per_s",
                rate,
                target=">= 12000",
                ok=rate >= 12000,
                members=args.members,
                handler_ms=args.delay_ms,
                messages=args.messages,
                projects=args.projects,
                **extra,
            )
            emit(BENCH, "partition_at_a_time_ceiling", ceiling, partitions=128)
            rate, extra = await bench.io_bound(
                js, etcd, "shoal.consumer.handlers:ledger", ledger=True
            )
            clean = extra["audit"]["lost"] == extra["audit"]["duplicates"] == 0 and (
                extra["audit"]["out_of_order"] == extra["audit"]["overlaps"] == 0
            )
            emit(
                BENCH,
                "io_audited_msgs_per_s",
                rate,
                audit_clean=clean,
                ok=clean,
                members=args.members,
                handler_ms=args.delay_ms,
                **extra,
            )
        if args.only != "io":
            await bench.idle(js, etcd)


def main(argv: list[str] | None = None) -> int:
    return bench_main("shoal-bench-datapath-", argv, parse_args, run)


if __name__ == "__main__":
    raise SystemExit(main())
