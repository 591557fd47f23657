"""A member's own CPU per message, without servers: parsing, routing, delivery, dispatch,
the handler call, metrics and the ack.

The throughput bench (bench/throughput.py) moves with the machine and with nats-server,
which shares its two cores; this one isolates the member's side. It feeds the bytes a
member's client reads from JetStream (HMSG lines, header blocks and reply subjects of
1,000 projects over 128 partitions) to the member's client's protocol parser and direct
path (``FastParser``, ``DirectClient.take``), on to ``Worker.receive``, in reads of
``--read`` messages, with the built-in noop handler, and acks through that client, not
connected (its publishes pile up in its pending buffer, cleared after every read).
Figure: ``hotpath_us_per_msg``, the process CPU per message, best of ``--repeat``. Not a
target: a number to compare commits with. Session 9: 6.75 -> 4.6 us, from nats-py's
``Msg`` on (nats-py's parsing, Msg and callback cost another 4.65 us, measured the same
way). Since session 10 the client's side is counted too, all but the socket's reads and
writes: 6.1 us. Session 11: 5.4-5.7 us (a lazy ``Message``, message lines split rather
than matched, acks queued without a coroutine).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from types import SimpleNamespace
from typing import Any

from harness.bench import emit
from shoal.clients.natsclient import DirectClient
from shoal.consumer import handlers
from shoal.consumer.metrics import Metrics
from shoal.consumer.ownership import Stage
from shoal.consumer.partition import PartitionRunner
from shoal.consumer.worker import Worker
from shoal.contracts.names import MSG_ID_HEADER, PROJECT_HEADER, durable_name, partition_for
from shoal.group.config import GroupConfig

PARTITIONS = 128
PROJECTS = 1_000


class AlwaysSafe:
    """The Membership a worker asks on each message: a live lease."""

    lease_id = 1
    incarnation = 0

    def safe(self) -> bool:
        return True


def messages(count: int, sid: int) -> list[bytes]:
    """What the server sends for each message (an HMSG: line, header block, payload)."""
    partition_of: dict[str, int] = {}
    out = []
    for i in range(count):
        project = f"project-{i % PROJECTS}"
        p = partition_of.get(project)
        if p is None:
            p = partition_of[project] = partition_for(project, PARTITIONS)
        reply = f"$JS.ACK.bench.{durable_name(p)}.1.{i + 1}.{i + 1}.1700000000000000000.{count - i}"
        headers = f"NATS/1.0\r\n{PROJECT_HEADER}: {project}\r\n{MSG_ID_HEADER}: m-{i}\r\n\r\n"
        payload = "x" * 64
        size = len(headers) + len(payload)
        line = f"HMSG bench.{p} {sid} {reply} {len(headers)} {size}\r\n"
        out.append(f"{line}{headers}{payload}\r\n".encode())
    return out


async def one_run(count: int, read: int) -> float:
    nc = DirectClient()
    nc._status = DirectClient.CONNECTED  # publishes go to its pending buffer, never written
    # A flush queued already, as under load (the first publish of a turn of the event
    # loop queues one): acks take the path that adds to the pending buffer only.
    nc._flush_queue = asyncio.Queue()
    nc._flush_queue.put_nowait(asyncio.get_running_loop().create_future())
    nc._max_pending_size = 0
    config = GroupConfig(namespace="bench", group="hotpath", partitions=PARTITIONS)
    # No etcd, view or JetStream context: nothing on the hot path uses them.
    unused: Any = None
    membership: Any = AlwaysSafe()
    worker = Worker(config, unused, unused, membership, nc, unused, handlers.noop, Metrics())
    for p in range(PARTITIONS):
        worker.ownership.move(p, Stage.CONSUMING, runner=PartitionRunner(worker, p, 1, None))
    worker.dispatcher.start()
    # The inbox's subscription, as subscribe() would register it (it cannot send a SUB).
    sub: Any = SimpleNamespace(_id=1)
    nc._subs[sub._id] = sub
    nc.route_directly(sub, worker.receive, worker.receive_status)
    wire = messages(count, sub._id)
    reads = [b"".join(wire[i : i + read]) for i in range(0, count, read)]
    parse = nc._ps.parse
    started = time.process_time()
    for data in reads:
        await parse(data)
        await asyncio.sleep(0)  # the read loop yields: the dispatcher's workers run
        nc._pending.clear()
        nc._pending_data_size = 0
    while worker.buffered:  # noqa: ASYNC110 (the last read: a busy loop, CPU is measured)
        await asyncio.sleep(0)
    spent = time.process_time() - started
    done = sum(r.processed for r in worker.runners.values())
    if done != count:
        raise RuntimeError(f"processed {done} of {count}")
    await worker.dispatcher.stop()
    return 1e6 * spent / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--read", type=int, default=256, help="messages per read")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    runs = [asyncio.run(one_run(args.messages, args.read)) for _ in range(args.repeat)]
    emit("hotpath", "hotpath_us_per_msg", round(min(runs), 2), runs=[round(r, 2) for r in runs])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
