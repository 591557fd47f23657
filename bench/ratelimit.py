"""How closely a group keeps its rate limit, also while it scales (issue 27's "Rate limits").

One group (``--partitions`` 128) with ``maxMessagesPerSecond`` ``--limit`` (2,000) on one
nats-server and one etcd, running the ledger handler, on a backlog published before the
members start and large enough to outlast the run (``--backlog``, default 250,000 over
``--projects`` 1,000). ``--members`` (4) member processes start together; once they have
settled, the run lasts ``--seconds`` (90), and ``--scale-at`` (40) seconds in, ``--scale-to``
(6) minus ``--members`` more member processes start (a scale from 4 to 6: partitions move
to the new members, and every member's share follows what it owns).

The group's rate is read from the ledger afterwards: every handler run's start (the
ledger records' ``started``, the members' wall clocks, one machine), counted in
consecutive ``--window``-second windows (10) from the settled moment to the end of the
run. Figures:

* ``window_rates``: each window's messages a second, the scale's window marked;
* ``worst_window_deviation_pct``: the worst window's |rate - limit| / limit (target <= 5);
* ``scale_window_rate``: the rate over the window in which the scale happened;
* ``ledger_audit``: duplicates, out of order, overlaps over what was processed (all 0).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from harness.bench import add_run_options, bench_main, bench_servers, emit, note, serious_problems
from harness.fleet import Fleet, settled, wait_for_status
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.group.config import GroupConfig, config_env
from shoal.group.jetstream import ensure_group

BENCH = "ratelimit"
NAMESPACE = "bench"
GROUP = "limited"
LEDGER = "shoal.consumer.handlers:ledger"
SETTINGS = ("handler", "partitions", "ledger", "max_messages_per_second")


def windows(starts: list[float], begin: float, end: float, width: float) -> list[float]:
    """Messages a second in each whole `width`-second window from `begin` to `end`."""
    count = int((end - begin) // width)
    counts = [0] * count
    for t in starts:
        i = int((t - begin) // width)
        if 0 <= i < count:
            counts[i] += 1
    return [n / width for n in counts]


async def run(args: argparse.Namespace, root: Path) -> None:
    async with bench_servers(root) as servers:
        config = servers.group_config(
            NAMESPACE,
            GROUP,
            LEDGER,
            ledger=True,
            partitions=args.partitions,
            max_messages_per_second=args.limit,
        )
        js = servers.js
        await ensure_group(js, config)
        items = [Outgoing(f"proj-{i % args.projects}", b"x", f"m-{i}") for i in range(args.backlog)]
        started = time.monotonic()
        await Producer(js, config.subject_prefix, config.partitions).publish_many(items)
        note(f"published {args.backlog} messages in {time.monotonic() - started:.1f} s")
        await measure(args, root, config, servers.etcd, js)


async def measure(
    args: argparse.Namespace, root: Path, config: GroupConfig, etcd: Etcd, js: Any
) -> None:
    env = config_env(config, SETTINGS)
    first = [f"m-{i}" for i in range(args.members)]
    later = [f"m-{i}" for i in range(args.members, args.scale_to)]
    with Fleet.for_config(root / "members", config) as fleet:
        for name in first:
            fleet.start(name, **env)
        await wait_for_status(
            etcd, NAMESPACE, GROUP, config.partitions, settled(set(first)), 120, interval=0.1
        )
        begin = time.time()
        note(f"{len(first)} members settled; running {args.seconds:g} s")
        await asyncio.sleep(args.scale_at)
        scaled = time.time()
        for name in later:
            fleet.start(name, **env)
        note(f"started {', '.join(later)}")
        await wait_for_status(
            etcd,
            NAMESPACE,
            GROUP,
            config.partitions,
            settled(set(first) | set(later)),
            120,
            interval=0.1,
        )
        note(f"{args.scale_to} members settled {time.time() - scaled:.1f} s after the scale")
        await asyncio.sleep(max(0.0, begin + args.seconds - time.time()))
        end = time.time()
    records = await read_ledger(js, config.ledger_stream)
    note(f"read {len(records)} ledger records")
    starts = [r.started for r in records]
    rates = windows(starts, begin, end, args.window)
    scale_index = int((scaled - begin) // args.window)
    worst = max(abs(r - args.limit) / args.limit * 100 for r in rates)
    emit(
        BENCH,
        "window_rates",
        None,
        rates=[round(r, 1) for r in rates],
        window_seconds=args.window,
        scale_window=scale_index,
        limit=args.limit,
        members=f"{args.members}->{args.scale_to}",
    )
    emit(
        BENCH,
        "worst_window_deviation_pct",
        worst,
        limit=args.limit,
        windows=len(rates),
        target="<= 5",
        ok=worst <= 5,
    )
    if 0 <= scale_index < len(rates):
        emit(BENCH, "scale_window_rate", rates[scale_index], limit=args.limit)
    whole = sum(1 for t in starts if begin <= t < end) / (end - begin)
    emit(BENCH, "mean_rate", whole, limit=args.limit, seconds=round(end - begin, 1))
    processed = {r.message_id for r in records}
    summary = audit(records, processed).summary()
    bad = summary["duplicates"] + summary["out_of_order"] + summary["overlaps"]
    emit(BENCH, "ledger_audit", bad, **summary, target="0", ok=bad == 0)
    problems = serious_problems((root / "members").glob("*.log"))
    emit(BENCH, "member_log_problems", problems, target="0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="A rate-limited group's rate over 10 s windows, across a scale (issue 27).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--limit", type=float, default=2000.0, help="maxMessagesPerSecond")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--scale-to", type=int, default=6)
    parser.add_argument("--scale-at", type=float, default=40.0, help="seconds into the run")
    parser.add_argument("--seconds", type=float, default=90.0, help="the run, once settled")
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--partitions", type=int, default=128)
    parser.add_argument("--projects", type=int, default=1000)
    parser.add_argument("--backlog", type=int, default=250_000)
    add_run_options(parser)
    args = parser.parse_args(argv)
    if args.backlog < args.limit * args.seconds * 1.1:
        parser.error("--backlog must outlast the run: at least 1.1 x limit x seconds")
    return args


def main(argv: list[str] | None = None) -> int:
    return bench_main("shoal-bench-ratelimit-", argv, parse_args, run)


if __name__ == "__main__":
    raise SystemExit(main())
