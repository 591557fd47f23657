"""`shoal-consumer reset --to-start` of a 128-partition group: how long, and the replay.

Scenario: two members (``shoal.consumer.handlers:ledger``) of a group on a `limits`
stream consume a batch (default 20,000 messages over 1,000 projects); then the reset
runs as users run it (``shoal-consumer reset --to-start --yes --json``, a process of its
own) and the members consume the batch once more.

Figures:

* ``reset_s``: the reset from its pause to its resume (the command's own figure), with
  ``pause_s`` (the pause written until every member reported its partitions paused: up
  to a keepalive interval, when members put their stats) and ``recreate_s`` (128
  durables deleted and created again, 16 at a time, and checked), and
  ``command_wall_s``: the whole process (start-up, connections, the plan).
* ``replay``: the ledger of the replay (records started after the reset): lost,
  duplicates, out of order, overlaps (all 0 for a pass), how long it took, msg/s.

``--fast-lease``: members with keepalive 1 s (the tests' setting) instead of the
default 3 s. Under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from harness.bench import bench_servers, emit, emit_log_problems, note, run_bench
from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group
from shoal.logs import quiet_known_noise

BENCH = "reset"
NAMESPACE = "bench"
GROUP = "reset"
HANDLER = "shoal.consumer.handlers:ledger"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time a reset to the start of a group and audit the replay. One JSON "
        "line per figure on stdout; progress on stderr.",
    )
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--projects", type=int, default=1_000)
    parser.add_argument("--partitions", type=int, default=128)
    parser.add_argument("--fast-lease", action="store_true", help="keepalive 1 s (default 3 s)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the replay is wrong")
    return parser.parse_args(argv)


async def ledger_count(js: Any, config: GroupConfig) -> int:
    return int((await js.stream_info(config.ledger_stream)).state.messages)


async def reset_command(config: GroupConfig) -> tuple[float, dict[str, Any]]:
    """The command as users run it: (its wall time, its --json result)."""
    where = ["-g", config.group, "-n", config.namespace, "--nats", config.nats_url]
    where += ["--etcd", config.etcd_endpoints, "--to-start", "--yes", "--json"]
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shoal.consumer",
        "reset",
        *where,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    wall = time.monotonic() - started
    if process.returncode != 0:
        raise RuntimeError(f"reset failed ({process.returncode}): {err.decode()[-2000:]}")
    lines = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    return wall, next(line["result"] for line in lines if "result" in line)


async def measure(
    args: argparse.Namespace, fleet: Fleet, config: GroupConfig, etcd: Etcd, js: Any
) -> None:
    await ensure_group(js, config)
    members = {"c-0", "c-1"}
    for member in sorted(members):
        fleet.start(member)
    await wait_for_status(etcd, NAMESPACE, GROUP, args.partitions, settled(members), 60)
    items = [
        Outgoing(
            f"project-{i % args.projects}", b"x", f"r-{i}", {SEQ_HEADER: str(i // args.projects)}
        )
        for i in range(args.messages)
    ]
    await Producer(js, config.subject_prefix, args.partitions).publish_many(items)
    await eventually_async(
        lambda: ledger_count(js, config),
        120,
        "the first pass",
        until=lambda n: n >= args.messages,
        interval=0.2,
    )
    note(f"first pass done: {args.messages} messages")
    wall, result = await reset_command(config)
    note(f"reset: {result} (command {wall:.2f} s)")
    emit(
        BENCH,
        "reset_s",
        round(result["seconds"], 3),
        pause_s=round(result["pause_seconds"], 3),
        recreate_s=round(result["recreate_seconds"], 3),
        command_wall_s=round(wall, 3),
        partitions=result["partitions"],
        keepalive_s=1 if args.fast_lease else 3,
    )
    _, kvs = await etcd.get_prefix(config.keys.reset)
    reset_at = json.loads(kvs[config.keys.reset].value)["time"]
    await eventually_async(
        lambda: ledger_count(js, config),
        120,
        "the replay",
        until=lambda n: n >= 2 * args.messages,
        interval=0.2,
    )
    await asyncio.sleep(1.0)  # anything more (a duplicate) would land by now
    records = await read_ledger(js, config.ledger_stream)
    replay = [r for r in records if r.started >= reset_at]
    summary = audit(replay, [i.message_id or "" for i in items]).summary()
    took = max(r.finished for r in replay) - reset_at
    bad = summary["lost"] + summary["duplicates"] + summary["out_of_order"]
    bad += summary["overlaps"]
    emit(
        BENCH,
        "replay",
        bad,
        ok=bad == 0 and summary["processed"] == args.messages,
        seconds=round(took, 2),
        msgs_per_s=round(len(replay) / took),
        **summary,
    )


async def run(args: argparse.Namespace, root: Path) -> None:
    env = {"SHOAL_RETENTION": "limits"}
    if args.fast_lease:
        env |= {"SHOAL_LEASE_TTL": "5", "SHOAL_KEEPALIVE_INTERVAL": "1", "SHOAL_ACK_WAIT": "2.5"}
    async with bench_servers(root) as servers:
        config = servers.group_config(
            NAMESPACE,
            GROUP,
            HANDLER,
            partitions=args.partitions,
            ledger=True,
            retention="limits",
        )
        with Fleet.for_config(root / "members", config, env=env) as fleet:
            try:
                await measure(args, fleet, config, servers.etcd, servers.js)
            finally:
                fleet.close()
                emit_log_problems(BENCH, root / "members")


def main(argv: list[str] | None = None) -> int:
    quiet_known_noise()
    args = parse_args(argv)
    return run_bench("shoal-bench-reset-", args.keep, args.strict, lambda root: run(args, root))


if __name__ == "__main__":
    raise SystemExit(main())
