"""A minimal HTTP handler service, for benchmarks: `POST /messages` answers 200.

    python -m harness.httpservice -listen 127.0.0.1:8080 [-delay 20ms] [-record FILE] [-name m-0]

The flags are those of the Go handler in examples/go/ (`-listen`, `-delay`; `GET
/healthz` answers 200), so a benchmark runs either with only its command line changed.
As there, `-listen unix:/path/to.sock` listens on a Unix domain socket instead (a stale
socket at the path is removed first, the socket is made 0666 and removed when it stops).
This one also records what it received when given `-record`: one JSON line per request
(project, message id, partition, delivery count, stream sequence, when it started and
finished, and `-name` as the member: one service per member, as a sidecar is), written
when it stops (SIGTERM or SIGINT), so that the benchmark can audit it as it audits the
ledger (shoal.consumer.ledger.audit): lost, duplicates, order, overlaps.

It runs in a process of its own, never in the member's: the member's CPU is the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import stat
import time
from pathlib import Path
from typing import Any

from aiohttp import web


def duration(text: str) -> float:
    """Seconds of a Go-style duration: `20ms`, `1.5s`, `500us`, `0`."""
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m)?", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r}")
    scale = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}
    return float(match.group(1)) * scale[match.group(2)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("-listen", "--listen", default="127.0.0.1:8080", help="host:port|unix:PATH")
    parser.add_argument("-delay", "--delay", type=duration, default=0.0, help="e.g. 20ms")
    parser.add_argument("-record", "--record", type=Path, default=None)
    parser.add_argument("-name", "--name", default="")
    return parser.parse_args(argv)


class Service:
    def __init__(self, delay: float, name: str, record: bool) -> None:
        self.delay = delay
        self.name = name
        self.record = record
        self.records: list[dict[str, Any]] = []

    async def message(self, request: web.Request) -> web.Response:
        started = time.time()
        await request.read()
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.record:
            h = request.headers
            self.records.append(
                {
                    "project_id": h.get("Shoal-Project-Id", ""),
                    "message_id": h.get("Shoal-Message-Id", ""),
                    "seq": None,
                    "partition": int(h.get("Shoal-Partition", "-1")),
                    "member": self.name,
                    "delivery_count": int(h.get("Shoal-Delivery-Count", "0")),
                    "stream_sequence": int(h.get("Shoal-Stream-Sequence", "0")),
                    "started": started,
                    "finished": time.time(),
                }
            )
        return web.Response()

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")


def remove_stale_socket(path: Path) -> None:
    """Remove the socket a killed run left at `path` (anything else there is not ours)."""
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
    except FileNotFoundError:
        pass


async def start_site(runner: web.AppRunner, listen: str) -> Path | None:
    """Listen on `listen` (host:port, or unix:PATH); the socket's path, if it is one."""
    if not listen.startswith("unix:"):
        host, _, port = listen.rpartition(":")
        await web.TCPSite(runner, host or "127.0.0.1", int(port)).start()
        return None
    path = Path(listen.removeprefix("unix:"))
    remove_stale_socket(path)
    await web.UnixSite(runner, path).start()
    # As the Go handler: a member running as another user may connect (the umask,
    # typically 022, would leave it to the owner alone); the directory limits who else.
    os.chmod(path, 0o666)
    return path


async def serve(args: argparse.Namespace) -> None:
    service = Service(args.delay, args.name, args.record is not None)
    app = web.Application()
    app.router.add_post("/messages", service.message)
    app.router.add_get("/healthz", service.healthz)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    socket_path = await start_site(runner, args.listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    if socket_path is not None:
        socket_path.unlink(missing_ok=True)
    if args.record is not None:
        lines = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in service.records)
        tmp = args.record.with_suffix(".tmp")
        tmp.write_text(lines)
        tmp.rename(args.record)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
