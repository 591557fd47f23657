"""A TCP proxy a test owns, to cut ONE member off from a server while the others stay.

The member connects to the proxy's loopback port instead of the server's; the test
switches the proxy between three modes at any moment:

- ``pass``: bytes flow both ways (a healed network resumes the connections it held);
- ``blackhole``: connections stay open and new ones are accepted, but nothing is
  forwarded in either direction (a partition: no FIN, no RST, just silence; what was
  sent meanwhile is delivered late if the network heals before anyone gives up);
- ``reset``: every open connection is reset (RST, as from a crashed peer or a firewall)
  and new connections are reset as soon as they are accepted.

Independently, `delay(seconds)` adds latency to every byte (a slow network or server),
and `strand()` blackholes the connections open at that moment, for good, while new ones
flow: a peer that vanished without a word behind an address that now leads elsewhere (a
Service whose pod was replaced, a NAT entry that expired). Only a client that checks its
connection (keep-alive pings) or gives up on it finds the working path.

With ``peek=True`` (protocols whose client speaks first, as HTTP does), the proxy reads a
connection's first bytes before it connects upstream, and `hold(marker)` blackholes only
the connections whose first bytes contain `marker`: e.g. one etcd member's peer requests
(its ``X-Server-From`` header) among those of every member, to cut that member from its
peers while the others still talk to each other.

What the clients do with a blackholed connection (why a partition needs timeouts):

- etcd3's gRPC channel has no keep-alive pings: unary calls fail at their deadline
  (``Etcd(timeout=...)``), but the channel keeps using the silent connection, so nothing
  succeeds until the network heals; a watch stream just goes quiet (no error at all).
- nats-py notices nothing until ``ping_interval * max_outstanding_pings`` has passed
  (120 s x 2 by default): publishes are buffered and requests time out. After that it
  reconnects; through a blackhole, each attempt is accepted and then times out waiting
  for the server's INFO (``connect_timeout``).

The proxy runs its own asyncio loop in a daemon thread, so it keeps forwarding however
busy the test's loop is; every public method is thread-safe and blocking (briefly).
Loopback only: it listens on 127.0.0.1 and connects to a loopback upstream.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
import struct
import threading
from collections.abc import Coroutine
from typing import Any, Self, TypeVar

from harness.lifecycle import StartStop

__all__ = ["Mode", "TcpProxy"]

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
CHUNK = 64 * 1024
T = TypeVar("T")


class Mode(enum.Enum):
    PASS = "pass"
    BLACKHOLE = "blackhole"
    RESET = "reset"


def _rst(writer: asyncio.StreamWriter | None) -> None:
    """Close with an RST (SO_LINGER 0), as a crashed peer or a firewall would."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class _Connection:
    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        self.hello = b""  # its first bytes from the client (with peek)
        self.stranded = False  # silent for good (TcpProxy.strand)

    def reset(self) -> None:
        for task in self.tasks:
            task.cancel()
        _rst(self.client)
        _rst(self.upstream)


class TcpProxy(StartStop):
    """Listens on 127.0.0.1:<free port> and forwards to ``upstream`` ("host:port")."""

    def __init__(self, upstream: str, *, name: str = "proxy", peek: bool = False) -> None:
        host, _, port = upstream.rpartition(":")
        if host not in (HOST, "localhost"):
            raise ValueError(f"the proxy forwards to loopback only, not {upstream!r}")
        self.upstream_host, self.upstream_port = HOST, int(port)
        self.name = name
        self.port = 0
        self._mode = Mode.PASS
        self._delay = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._peek = peek
        self._held: bytes | None = None
        # Set (and replaced) at every change of mode or hold: whoever waits for bytes
        # to flow looks again.
        self._changed: asyncio.Event | None = None
        self._connections: set[_Connection] = set()
        self.accepted = 0

    # -- public, thread-safe -------------------------------------------------------------

    @property
    def address(self) -> str:
        """host:port to give the member instead of the server's."""
        return f"{HOST}:{self.port}"

    @property
    def mode(self) -> Mode:
        return self._mode

    def start(self) -> Self:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._listen())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"tcp-proxy-{self.name}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError(f"proxy {self.name} did not start")
        log.info("proxy %s: %s -> %s:%d", self.name, self.address, HOST, self.upstream_port)
        return self

    def set_mode(self, mode: Mode) -> None:
        self._call(self._set_mode(mode))
        log.info("proxy %s: %s", self.name, mode.value)

    def pass_through(self) -> None:
        self.set_mode(Mode.PASS)

    def blackhole(self) -> None:
        self.set_mode(Mode.BLACKHOLE)

    def reset(self) -> None:
        self.set_mode(Mode.RESET)

    def delay(self, seconds: float) -> None:
        """Add `seconds` of latency to every byte from now on, both ways (0: none).

        Bytes already on their way keep theirs (a stream is never reordered).
        """
        self._delay = seconds
        log.info("proxy %s: latency %.1f s", self.name, seconds)

    def hold(self, marker: bytes | None) -> None:
        """Blackhole the connections whose first bytes contain `marker` (None: none
        any more); needs peek=True. The mode applies to the others as usual."""
        if marker is not None and not self._peek:
            raise ValueError(f"proxy {self.name}: hold() needs peek=True")
        self._call(self._set_held(marker))
        log.info("proxy %s: holding %r", self.name, marker)

    def strand(self) -> int:
        """Blackhole every connection open now, for good (new ones flow as the mode
        says); returns how many."""
        count = self._call(self._strand())
        log.info("proxy %s: stranded %d connection(s)", self.name, count)
        return count

    def open_connections(self) -> int:
        return len(self._connections)

    def close(self) -> None:
        """Stop listening, reset every connection, end the thread. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if loop.is_running():
            try:
                self._call(self._shutdown())
            except Exception:
                log.debug("proxy %s: shutdown failed", self.name, exc_info=True)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        if not loop.is_running():
            loop.close()
        self._loop = self._thread = None

    def stop(self) -> None:
        """The end of a `with` block (StartStop): close()."""
        self.close()

    # -- the proxy's own loop ------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError(f"proxy {self.name} is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _listen(self) -> None:
        self._changed = asyncio.Event()
        self._server = await asyncio.start_server(self._handle, HOST, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def _notify(self) -> None:
        assert self._changed is not None
        self._changed.set()
        self._changed = asyncio.Event()

    def _flowing(self, connection: _Connection) -> bool:
        held = self._held is not None and self._held in connection.hello
        return self._mode is Mode.PASS and not held and not connection.stranded

    async def _wait_flowing(self, connection: _Connection) -> None:
        while not self._flowing(connection):
            assert self._changed is not None
            await self._changed.wait()

    async def _set_held(self, marker: bytes | None) -> None:
        self._held = marker
        self._notify()

    async def _strand(self) -> int:
        for connection in self._connections:
            connection.stranded = True
        self._notify()
        return len(self._connections)

    async def _set_mode(self, mode: Mode) -> None:
        self._mode = mode
        self._notify()
        if mode is Mode.RESET:
            for connection in list(self._connections):
                connection.reset()
            self._connections.clear()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.reset()
        self._connections.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self._mode is Mode.RESET:
            _rst(writer)
            return
        connection = _Connection(writer)
        self._connections.add(connection)
        current = asyncio.current_task()
        if current is not None:
            connection.tasks.add(current)
        try:
            if self._peek:
                connection.hello = await reader.read(CHUNK)
            # A blackhole accepts and then says nothing: the upstream connection is made
            # only once bytes may flow, so the server sees nothing of it meanwhile.
            await self._wait_flowing(connection)
            up_reader, up_writer = await asyncio.open_connection(
                self.upstream_host, self.upstream_port
            )
            connection.upstream = up_writer
            if connection.hello:
                up_writer.write(connection.hello)
            await asyncio.gather(
                self._pump(reader, up_writer, connection),
                self._pump(up_reader, writer, connection),
            )
        except asyncio.CancelledError:
            pass  # reset() or close(): the sockets are already aborted
        except OSError as exc:
            log.debug("proxy %s: connection ended: %r", self.name, exc)
            connection.reset()
        finally:
            self._connections.discard(connection)
            for w in (writer, connection.upstream):
                if w is not None and not w.is_closing():
                    w.close()

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, connection: _Connection
    ) -> None:
        # Chunks go out in order, each no earlier than `delay` after it was read: a
        # writer of its own, so that a latency does not slow the reading down, and a
        # change of latency never reorders the bytes of a stream.
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        writer = asyncio.create_task(self._write_chunks(chunks, dst))
        try:
            while True:
                data = await src.read(CHUNK)
                # Hold the chunk (and so stop reading: the kernel buffers fill up, as on
                # a partition) until the network is back.
                await self._wait_flowing(connection)
                loop = asyncio.get_running_loop()
                chunks.put_nowait((loop.time() + self._delay, data))
                if not data:
                    break
            await writer
        finally:
            writer.cancel()

    async def _write_chunks(
        self, chunks: asyncio.Queue[tuple[float, bytes]], dst: asyncio.StreamWriter
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await chunks.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:
                break
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            try:
                dst.write_eof()
            except OSError:
                pass
