"""`make demo`: a local consumer group on a real etcd and a real nats-server.

Starts both servers on free loopback ports, three consumer processes, and a producer over
1,000 project ids; then members join, leave gracefully and crash while messages flow.
Each new assignment generation is printed as it appears, and at the end the ledger
shows what was lost, duplicated or out of order. Everything started is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

from harness.fleet import Fleet, settled, wait_for_status
from harness.servers import EtcdServer, NatsServer
from harness.waiting import WaitTimeout, eventually_async
from shoal.assignor import moved
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group
from shoal.group.status import GroupStatus, read_status
from shoal.logs import quiet_known_noise

NAMESPACE, GROUP = "demo", "orders"


def say(text: str) -> None:
    print(text, flush=True)


def show(status: GroupStatus, previous: GroupStatus | None) -> None:
    moves = moved(previous.owners, status.owners) if previous else []
    counts = "  ".join(f"{m}={n}" for m, n in sorted(status.counts.items()))
    say(
        f"  generation {status.generation:>3}  leader {status.leader}  skew {status.skew}  "
        f"moved {len(moves):>3}   {counts}"
    )


async def watch(etcd: Etcd, partitions: int, stop: asyncio.Event) -> None:
    """Print the assignment each time a new generation is fully claimed."""
    last: GroupStatus | None = None
    while not stop.is_set():
        status = await read_status(etcd, NAMESPACE, GROUP, partitions)
        complete = status.members and not status.unowned and status.claims == status.owners
        if complete and (last is None or status.generation != last.generation):
            show(status, last)
            last = status
        await asyncio.sleep(0.2)


async def produce(producer: Producer, total: int, projects: int, rate: float) -> list[str]:
    ids: list[str] = []
    started = time.monotonic()
    batch = max(1, int(rate / 10))
    for start in range(0, total, batch):
        items = [
            Outgoing(
                f"project-{i % projects}", b"demo", f"demo-{i}", {SEQ_HEADER: str(i // projects)}
            )
            for i in range(start, min(total, start + batch))
        ]
        await producer.publish_many(items)
        ids += [item.message_id or "" for item in items]
        ahead = (start + batch) / rate - (time.monotonic() - started)
        if ahead > 0:
            await asyncio.sleep(ahead)
    return ids


async def drain(js: Any, stream: str, timeout: float) -> None:
    """Wait until the stream is empty; if it does not empty in time, say so and go on: the
    audit that follows shows what was not processed."""

    async def left() -> int:
        return int((await js.stream_info(stream)).state.messages)

    try:
        await eventually_async(
            left, timeout, f"{stream} to drain", until=lambda n: n == 0, interval=0.5
        )
    except WaitTimeout as exc:
        say(f"  {exc}")


async def demo(args: argparse.Namespace, workdir: Path) -> int:
    with NatsServer(workdir / "nats") as nats_server, EtcdServer(workdir / "etcd") as etcd_server:
        say(f"nats-server at {nats_server.url}, etcd at {etcd_server.endpoint}")
        config = GroupConfig(
            namespace=NAMESPACE,
            group=GROUP,
            partitions=args.partitions,
            nats_url=nats_server.url,
            etcd_endpoints=etcd_server.endpoint,
            handler="shoal.consumer.handlers:ledger",
            ledger=True,
            # A short lease so the crash below resolves quickly; ack_wait below it, in the
            # same ratio as the defaults (5 s and 10 s), keeps order across the crash.
            lease_ttl=5,
            keepalive_interval=1,
            ack_wait=2,
        )
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        await ensure_group(js, config)
        etcd = Etcd(etcd_server.endpoint)
        await etcd.connect(attempts=10)
        env = {
            "SHOAL_LEASE_TTL": str(config.lease_ttl),
            "SHOAL_KEEPALIVE_INTERVAL": str(config.keepalive_interval),
            "SHOAL_ACK_WAIT": str(config.ack_wait),
            "SHOAL_HANDLER_DELAY_MS": str(args.handler_delay_ms),
        }
        with Fleet(
            workdir / "members",
            nats_url=nats_server.url,
            etcd_endpoint=etcd_server.endpoint,
            namespace=NAMESPACE,
            group=GROUP,
            partitions=args.partitions,
            env=env,
        ) as fleet:
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(etcd, args.partitions, stop))
            names = [f"c-{i}" for i in range(args.members)]
            say(f"Starting {len(names)} consumers: {', '.join(names)}")
            for name in names:
                fleet.start(name)
            await wait_for_status(etcd, NAMESPACE, GROUP, args.partitions, settled(set(names)), 60)
            say(
                f"Producing {args.messages} messages over {args.projects} projects "
                f"at {args.rate:.0f}/s"
            )
            producer = Producer(js, config.subject_prefix, args.partitions)
            production = asyncio.create_task(
                produce(producer, args.messages, args.projects, args.rate)
            )
            members = set(names)
            steps: list[tuple[str, str]] = [
                ("join", "c-new-1"),
                ("join", "c-new-2"),
                ("leave", names[0]),
                ("crash", names[1]),
            ]
            for action, name in steps:
                await asyncio.sleep(args.step_seconds)
                if action == "join":
                    say(f"> {name} joins")
                    fleet.start(name)
                    members.add(name)
                elif action == "leave":
                    say(f"> {name} leaves gracefully (SIGTERM)")
                    fleet.term(name)
                    members.discard(name)
                else:
                    say(f"> {name} crashes (kill -9); its lease expires in 5 s")
                    fleet.kill(name)
                    members.discard(name)
                await wait_for_status(etcd, NAMESPACE, GROUP, args.partitions, settled(members), 60)
            ids = await production
            say("Production finished; waiting for the group to drain")
            await drain(js, config.stream, 120)
            await asyncio.sleep(1)
            stop.set()
            await watcher
            result = audit(await read_ledger(js, config.ledger_stream), ids)
            s = result.summary()
            crashed_dups = sum(
                1 for recs in result.duplicates.values() if recs[0].member == names[1]
            )
            say(
                f"Ledger: {s['expected']} published, {s['processed']} processed, "
                f"{s['lost']} lost, {s['duplicates']} duplicates "
                f"({crashed_dups} of them redeliveries of the crashed member's unacked "
                f"messages), {s['out_of_order']} out of order, {s['overlaps']} overlaps"
            )
            final = await read_status(etcd, NAMESPACE, GROUP, args.partitions)
            say(
                f"Final: {len(final.members)} members, skew {final.skew}, "
                f"generation {final.generation}"
            )
        etcd.close()
        await nc.close()
        ok = s["lost"] == 0 and s["overlaps"] == 0 and crashed_dups == s["duplicates"]
        say("Demo finished: " + ("no message lost" if ok else "PROBLEMS, see above"))
        return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--members", type=int, default=3, help="initial consumers (3)")
    parser.add_argument("--partitions", type=int, default=128, help="partitions (128)")
    parser.add_argument("--projects", type=int, default=1000, help="project ids (1000)")
    parser.add_argument("--messages", type=int, default=30000, help="messages (30000)")
    parser.add_argument("--rate", type=float, default=1500.0, help="messages per second (1500)")
    parser.add_argument(
        "--step-seconds", type=float, default=3.0, help="pause between membership changes (3)"
    )
    parser.add_argument(
        "--handler-delay-ms", type=float, default=0.0, help="simulated work per message in ms (0)"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where servers keep data and members their logs (a temp dir)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_known_noise()
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        sys.exit(asyncio.run(demo(args, args.workdir)))
    with tempfile.TemporaryDirectory(prefix="shoal-demo-") as tmp:
        sys.exit(asyncio.run(demo(args, Path(tmp))))


if __name__ == "__main__":
    main()
