"""What a group costs as it grows: members, partitions (issue 29's "Group size" and
"Partitions").

For each size in ``--sizes`` (default 3, 16, 32, 64 members) one group of member
processes (the in-process ``noop`` handler, nothing published) on one nats-server and
one etcd:

* ``settle_seconds``: from the moment every member is up (its member key in etcd) to a
  settled assignment (every partition claimed by its assignee; target <= 15 s at 64
  members); ``from_last_started`` beside it counts from the moment the last member
  process was started (64 interpreters starting at once on 2 cores take most of it);
* the idle cost over ``--idle-seconds`` after it settled (and 5 s more for start-up
  work to pass): each member's CPU % (the worst, the median and the leader's, which
  reads every member's stats; target <= 1 % at 64),
  etcd's and nats-server's CPU %, and etcd's writes per second (its
  ``etcd_mvcc_put_total`` and ``etcd_mvcc_delete_total``), with writes per member per
  second beside them (the target: they grow at most linearly with the members, i.e.
  writes per member per second stay flat);
* ``join_settle_seconds``: one more member started into the settled group, to a settled
  assignment again (target <= 3 s).

``--partitions`` runs the same with another partition count (1,024 for the issue's
"groups with 1,024 partitions work"); with it, ``assign()``'s time is in
``bench/assignor.py`` and the hand-over p99 in ``bench/handover.py`` (``--partitions``).
Each figure's line names its size; ``--rss`` adds each member's RSS (MB).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import urllib.request
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
)
from harness.fleet import Fleet, Member, settled, wait_for_status
from shoal.clients.etcd import Etcd
from shoal.group.config import GroupConfig, config_env
from shoal.group.jetstream import ensure_group

BENCH = "scale"
NAMESPACE = "bench"
NOOP = "shoal.consumer.handlers:noop"
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def etcd_writes(metrics_url: str) -> float:
    """Puts plus deletes etcd applied since it started (its /metrics)."""
    with _HTTP.open(metrics_url, timeout=5) as page:
        text = page.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("etcd_mvcc_put_total ", "etcd_mvcc_delete_total ")):
            total += float(line.split()[1])
    return total


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path, servers: BenchServers) -> None:
        self.args = args
        self.root = root
        self.servers = servers
        self.nats = servers.nats_server
        self.etcd_server = servers.etcd_server
        self.log_problems = 0

    def config(self, group: str) -> GroupConfig:
        return self.servers.group_config(
            NAMESPACE, group, NOOP, ledger=False, partitions=self.args.partitions
        )

    async def size(self, js: Any, etcd: Etcd, members: int) -> None:
        a = self.args
        group = f"g{members}-p{a.partitions}"
        config = self.config(group)
        await ensure_group(js, config)
        names = [f"m-{i:03d}" for i in range(members)]
        env = config_env(config, ("partitions",))
        with Fleet.for_config(self.root / group, config) as fleet:
            started: dict[str, Member] = {}
            for name in names:
                started[name] = fleet.start(name, **env)
            all_started = time.monotonic()
            await wait_for_status(
                etcd,
                NAMESPACE,
                group,
                a.partitions,
                lambda status: set(status.members) == set(names),
                300,
                interval=0.1,
            )
            all_up = time.monotonic()
            status = await wait_for_status(
                etcd, NAMESPACE, group, a.partitions, settled(set(names)), 300, interval=0.1
            )
            settle = time.monotonic() - all_up
            from_start = time.monotonic() - all_started
            note(
                f"{group}: all {members} members up {all_up - all_started:.1f} s after the "
                f"last was started (interpreters starting on 2 cores), settled {settle:.1f} s "
                "after that"
            )
            await asyncio.sleep(5)  # start-up work (claims, first stats, dozing) passes
            idle = await self.idle(started)
            joiner = f"m-{members:03d}"
            join_started = time.monotonic()
            started[joiner] = fleet.start(joiner, **env)
            await wait_for_status(
                etcd,
                NAMESPACE,
                group,
                a.partitions,
                settled(set(names) | {joiner}),
                120,
                interval=0.05,
            )
            # (From the process start: its interpreter's start-up and imports included.)
            join = time.monotonic() - join_started
            rss = {n: round(rss_mb(m.pid), 1) for n, m in started.items()} if a.rss else {}
        self.log_problems += serious_problems((self.root / group).glob("*.log"))
        common = {"members": members, "partitions": a.partitions}
        big = members >= 64
        emit(
            BENCH,
            "settle_seconds",
            settle,
            **common,
            from_last_started=round(from_start, 2),
            **({"target": "<= 15", "ok": settle <= 15} if big else {}),
        )
        worst = max(idle["members"].values())
        emit(
            BENCH,
            "idle_member_cpu_pct",
            worst,
            **common,
            median=statistics.median(idle["members"].values()),
            # The leader does the most (it reads every member's stats, status.leader).
            leader=idle["members"].get(status.leader or "", None),
            **({"target": "<= 1", "ok": worst <= 1} if big else {}),
        )
        emit(BENCH, "idle_etcd_cpu_pct", idle["etcd_cpu"], **common)
        emit(BENCH, "idle_nats_cpu_pct", idle["nats_cpu"], **common)
        emit(
            BENCH,
            "idle_etcd_writes_per_s",
            idle["writes"],
            per_member=idle["writes"] / members,
            **common,
        )
        emit(
            BENCH,
            "join_settle_seconds",
            join,
            **common,
            **({"target": "<= 3", "ok": join <= 3} if big else {}),
        )
        if rss:
            emit(BENCH, "member_rss_mb", max(rss.values()), median=statistics.median(rss.values()))

    async def idle(self, members: dict[str, Member]) -> dict[str, Any]:
        etcd_pid, nats_pid = self.etcd_server.pid, self.nats.pid
        assert etcd_pid is not None and nats_pid is not None
        metrics = f"{self.etcd_server.monitor_url}/metrics"
        w0 = etcd_writes(metrics)
        e0, n0 = cpu_seconds(etcd_pid), cpu_seconds(nats_pid)
        m0 = {n: cpu_seconds(m.pid) for n, m in members.items()}
        t0 = time.monotonic()
        await asyncio.sleep(self.args.idle_seconds)
        seconds = time.monotonic() - t0
        m1 = {n: cpu_seconds(m.pid) for n, m in members.items()}
        e1, n1 = cpu_seconds(etcd_pid), cpu_seconds(nats_pid)
        w1 = etcd_writes(metrics)
        return {
            "members": {n: round(100 * (m1[n] - m0[n]) / seconds, 2) for n in m0},
            "etcd_cpu": 100 * (e1 - e0) / seconds,
            "nats_cpu": 100 * (n1 - n0) / seconds,
            "writes": (w1 - w0) / seconds,
        }


async def run(args: argparse.Namespace, root: Path) -> None:
    async with bench_servers(root) as servers:
        bench = Bench(args, root, servers)
        for members in args.sizes:
            await bench.size(servers.js, servers.etcd, members)
        emit(BENCH, "member_log_problems", bench.log_problems, target="0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="A group's cost as it grows: settle and join times, idle CPU, etcd "
        "writes (issue 29).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[3, 16, 32, 64], help="members per group"
    )
    parser.add_argument("--partitions", type=int, default=128)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--rss", action="store_true", help="report members' RSS")
    add_run_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return bench_main("shoal-bench-scale-", argv, parse_args, run)


if __name__ == "__main__":
    raise SystemExit(main())
