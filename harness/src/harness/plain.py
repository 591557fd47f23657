"""The fastest plain nats-py consumer we know how to write, as the throughput baseline.

It reads the same per-partition durables a Shoal member reads, without any of Shoal's
work (no ownership, no ordering, no handler): one subscription for every pull request's
reply subject (``<inbox>.<partition>``), and in its callback each message is acked with
a bare publish of ``+ACK``; when a request's batch is complete, or the server ends it,
the next request for that durable goes out from the same callback. No per-partition
loop, no per-message task, no metadata parsing.

``--client lean`` runs the same reader on the member's own client path
(``shoal.clients.natsclient``: its parser, no ``Msg``, each message handled as it is
read, acks and pulls appended to the client's outgoing buffer without a coroutine): not
plain nats-py any more, but what a bare reader costs on the path the member uses, as a
second reference.

Run as ``python -m harness.plain --url URL --stream S --durables p0,p1,... --target N``:
it prints ``{"ready": true}`` once its first requests are out, then one JSON line
``{"acked", "first", "last", "cpu_s"}`` (time.monotonic() of the first message and of the
last ack: the clock is system-wide, so the caller can compare it with its own; the CPU
seconds used in between) when `target` messages are acked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import nats

from shoal.clients.natsclient import Delivery, DirectClient


class Plain:
    def __init__(self, nc: Any, stream: str, durables: list[str], batch: int, target: int):
        self.nc = nc
        self.batch = batch
        self.target = target
        self.inbox = nc.new_inbox()
        self.subjects = {
            f"{self.inbox}.{i}": f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
            for i, durable in enumerate(durables)
        }
        # A message keeps its own subject; its reply subject names the durable.
        self.reply_of = {durable: f"{self.inbox}.{i}" for i, durable in enumerate(durables)}
        self.remaining = dict.fromkeys(self.subjects, 0)
        self.request = json.dumps({"batch": batch, "expires": int(5e9)}).encode()
        self.acked = 0
        self.first: float | None = None
        self.last = 0.0
        self.cpu_first = 0.0
        self.cpu_seconds = 0.0
        self.done = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        await self.nc.subscribe(self.inbox + ".*", cb=self.on_message)
        for reply in self.subjects:
            await self.pull(reply)
        await self.nc.flush()

    async def pull(self, reply: str) -> None:
        self.remaining[reply] = self.batch
        await self.nc.publish(self.subjects[reply], self.request, reply=reply)

    async def on_message(self, msg: Any) -> None:
        if not msg.reply:  # a status, on the request's reply subject: it ended (404/408/409)
            if not msg.headers or msg.headers.get("Status") != "100":
                await self.pull(msg.subject)
            return
        reply = self.arrived(msg.reply)
        await self.nc.publish(msg.reply, b"+ACK")
        if self.acked_one(reply):
            await self.pull(reply)

    def arrived(self, ack_subject: str) -> str:
        """A message arrived: the reply subject of the request it answers (its ack subject
        names the durable). The first one starts the clocks."""
        tokens = ack_subject.split(".")
        if self.first is None:
            self.first = time.monotonic()
            self.cpu_first = time.process_time()
        return self.reply_of[tokens[3] if len(tokens) == 9 else tokens[5]]

    def acked_one(self, reply: str) -> bool:
        """Count an ack; True when the request on `reply` is complete (pull again)."""
        self.acked += 1
        left = self.remaining[reply] - 1
        self.remaining[reply] = left
        if self.acked >= self.target and not self.done.done():
            self.last = time.monotonic()
            self.cpu_seconds = time.process_time() - self.cpu_first
            self.done.set_result(None)
        return left == 0


class LeanPlain(Plain):
    """The same reader on the member's client path (module docstring)."""

    async def start(self) -> None:
        sub = await self.nc.subscribe(self.inbox + ".*")
        self.nc.route_directly(sub, self.on_delivery, self.on_status)
        for reply in self.subjects:
            self.pull_now(reply)
        await self.nc.flush()

    def send(self, command: bytes) -> None:
        """Append a protocol command to the client's outgoing buffer and wake its flusher,
        as nats-py's publish does, without a coroutine."""
        nc = self.nc
        nc._pending.append(command)
        nc._pending_data_size += len(command)
        if nc._flush_queue.empty():
            nc._flush_queue.put_nowait(asyncio.get_running_loop().create_future())

    def pull_now(self, reply: str) -> None:
        self.remaining[reply] = self.batch
        subject = self.subjects[reply].encode()
        request = self.request
        self.send(b"PUB %s %s %d\r\n%s\r\n" % (subject, reply.encode(), len(request), request))

    def on_status(self, subject: str, headers: dict[str, str]) -> None:
        if headers.get("Status") != "100":
            self.pull_now(subject)

    def on_delivery(self, msg: Delivery) -> None:
        reply = self.arrived(msg.reply)
        self.send(b"PUB %s 4\r\n+ACK\r\n" % msg.reply.encode())
        if self.acked_one(reply):
            self.pull_now(reply)


async def main_async(args: argparse.Namespace) -> None:
    if args.client == "lean":
        nc: Any = DirectClient()
        await nc.connect(args.url, pending_size=64 * 1024 * 1024)
    else:
        nc = await nats.connect(args.url, pending_size=64 * 1024 * 1024)
    try:
        reader = LeanPlain if args.client == "lean" else Plain
        plain = reader(nc, args.stream, args.durables.split(","), args.batch, args.target)
        await plain.start()
        print(json.dumps({"ready": True}), flush=True)
        async with asyncio.timeout(args.timeout):
            await plain.done
        await nc.flush()
        result = {
            "acked": plain.acked,
            "first": plain.first,
            "last": plain.last,
            "cpu_s": plain.cpu_seconds,
        }
        print(json.dumps(result), flush=True)
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--durables", required=True, help="comma-separated durable names")
    parser.add_argument("--target", type=int, required=True, help="acks to wait for")
    parser.add_argument("--batch", type=int, default=256, help="messages per pull request")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument(
        "--client",
        choices=("nats-py", "lean"),
        default="nats-py",
        help="nats-py's public API (default), or the member's client path (docstring)",
    )
    asyncio.run(main_async(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
