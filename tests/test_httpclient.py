"""shoal.consumer.httpclient against real sockets: a raw asyncio server answers each
request with scripted bytes, so every framing, a server closing early, and the pool's
reuse rules are exercised as a real server would exercise them (tests/test_http_handler.py
runs it behind a member, against aiohttp's server)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.localkube.pki import ensure_pki, ensure_serving_cert
from harness.servers import free_port
from shoal.consumer.httpclient import (
    MAX_HEAD,
    ConnectFailed,
    HeaderRefused,
    HttpClient,
    ProtocolError,
    Unanswered,
)

# What the server does with one request: bytes to send (in pieces, to split them across
# reads), and whether to close the connection after.
Script = Callable[[bytes], tuple[list[bytes], bool]]


@dataclass
class RawServer:
    script: Script
    port: int = field(default_factory=free_port)
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    server: asyncio.Server | None = None
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    # Connections whose next request is not answered: they close as it arrives (a server
    # that notices an idle timeout only when the connection is read again).
    stale: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/messages"

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self.server = await asyncio.start_server(
            self._serve, "127.0.0.1", self.port, ssl=ssl_context
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                if writer in self.stale:
                    break
                pieces, close = self.script(request)
                for piece in pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.01)  # separate reads on the client's side
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Script], RawServer]]:
    servers: list[RawServer] = []

    def make(script: Script) -> RawServer:
        server = RawServer(script)
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.stop()


def answer(*pieces: bytes, close: bool = False) -> Script:
    return lambda request: (list(pieces), close)


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def test_a_request_carries_host_headers_and_body_and_the_connection_is_reused(
    serve: Callable[[Script], RawServer],
) -> None:
    server = serve(answer(OK))
    await server.start()
    client = HttpClient(server.url)
    try:
        headers = {"Shoal-Project-Id": "projekt-ü", "Content-Type": "text/plain"}
        for _ in range(3):
            got = await client.request("POST", "/messages", headers, b"hello")
            assert (got.status, got.reason, got.body) == (200, "OK", b"ok")
    finally:
        await client.close()
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /messages HTTP/1.1\r\nHost: 127.0.0.1:")
    assert "Shoal-Project-Id: projekt-ü\r\n".encode() in first
    assert first.endswith(b"Content-Length: 5\r\n\r\nhello")


@pytest.mark.parametrize(
    ("keep_alive", "reused"),
    [("timeout=2", True), ("timeout=1, max=100", False), ("max=5", True), ("", True)],
)
async def test_a_connection_is_not_reused_past_the_idle_timeout_the_server_announced(
    serve: Callable[[Script], RawServer], keep_alive: str, reused: bool
) -> None:
    """gunicorn keeps an idle connection 2 s and says so (Keep-Alive: timeout=2): a
    request sent on it near that moment meets the close. Reused only until a second
    before what the server announced (and never past the client's own idle timeout)."""
    hint = f"Keep-Alive: {keep_alive}\r\n" if keep_alive else ""
    server = serve(answer(f"HTTP/1.1 200 OK\r\n{hint}Content-Length: 2\r\n\r\nok".encode()))
    await server.start()
    client = HttpClient(server.url)
    try:
        await client.request("POST", "/", {}, b"")
        await asyncio.sleep(0.2)
        await client.request("POST", "/", {}, b"")
    finally:
        await client.close()
    assert server.connections == (1 if reused else 2)


@pytest.mark.parametrize(
    "pieces",
    [
        [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"],
        # Split everywhere a parser can trip: inside the head, the size, the data, the end.
        [
            b"HTTP/1.1 200 OK\r\nTransfer-En",
            b"coding: chunked\r\n\r\n3",
            b";ext=1\r\nhel\r",
            b"\n2\r\nlo",
            b"\r\n0\r\nX-Trailer: 1\r\n\r\n",
        ],
        [
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhe",
            b"llo",
        ],
        [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"],
    ],
    ids=["chunked", "chunked-split", "continue-then-answer", "length-lower-case"],
)
async def test_every_framing_reads_the_whole_answer_and_keeps_the_connection(
    serve: Callable[[Script], RawServer], pieces: list[bytes]
) -> None:
    server = serve(answer(*pieces))
    await server.start()
    client = HttpClient(server.url)
    try:
        for _ in range(2):
            got = await client.request("POST", "/messages", {}, b"x")
            assert (got.status, got.body) == (200, b"hello")
    finally:
        await client.close()
    assert server.connections == 1


async def test_an_answer_framed_by_the_end_of_the_connection_or_connection_close(
    serve: Callable[[Script], RawServer],
) -> None:
    until_close = serve(
        answer(b"HTTP/1.1 503 Busy\r\nRetry-After: 3\r\n\r\nback ", b"soon", close=True)
    )
    await until_close.start()
    closing = serve(answer(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"))
    await closing.start()
    old = serve(answer(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"))
    await old.start()
    for server in (until_close, closing, old):
        client = HttpClient(server.url)
        try:
            first = await client.request("POST", "/", {}, b"")
            await client.request("POST", "/", {}, b"")
        finally:
            await client.close()
        # Never reused: each request had a connection of its own.
        assert server.connections == 2
    assert (first.status, first.body) == (200, b"")
    client = HttpClient(until_close.url)
    try:
        busy = await client.request("POST", "/", {}, b"")
    finally:
        await client.close()
    assert (busy.status, busy.reason, busy.body) == (503, "Busy", b"back soon")
    assert busy.headers["retry-after"] == "3"


async def test_a_long_body_is_read_to_the_end_and_only_its_first_bytes_kept(
    serve: Callable[[Script], RawServer],
) -> None:
    body = b"e" * 100_000
    server = serve(answer(b"HTTP/1.1 400 Bad\r\nContent-Length: 100000\r\n\r\n" + body))
    await server.start()
    client = HttpClient(server.url, body_limit=200)
    try:
        for _ in range(2):
            got = await client.request("POST", "/", {}, b"")
            assert got.status == 400 and got.body == body[:200]
    finally:
        await client.close()
    assert server.connections == 1


@pytest.mark.parametrize(
    ("pieces", "why"),
    [
        ([b"SSH-2.0-OpenSSH\r\n\r\n"], "not an HTTP/1.x status line"),
        ([b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"], "not a header line"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: lots\r\n\r\n"], "is no length"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"], "is no number"),
        ([b"HTTP/1.1 200 OK\r\nX: " + b"a" * (MAX_HEAD + 10)], "longer than"),
        # Digits str.isdigit() takes and int() refuses: a ProtocolError, not a ValueError
        # out of the protocol's data_received (logged by asyncio as a fatal error).
        (["HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\n".encode()], "is no length"),
        (["HTTP/1.1 2\u00b20 OK\r\n\r\n".encode()], "not an HTTP/1.x status line"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\nok"], "is no length"),
        # int(x, 16) takes all three; -1 left the request waiting for its timeout.
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n"], "is no number"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\n"], "is no number"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n"], "is no number"),
    ],
    ids=[
        "not-http",
        "bad-header",
        "bad-length",
        "bad-chunk",
        "huge-head",
        "superscript-length",
        "superscript-status",
        "two-lengths",
        "negative-chunk",
        "prefixed-chunk",
        "underscored-chunk",
    ],
)
async def test_garbage_is_a_protocol_error_and_the_connection_is_dropped(
    serve: Callable[[Script], RawServer], pieces: list[bytes], why: str
) -> None:
    server = serve(answer(*pieces))
    await server.start()
    client = HttpClient(server.url)
    try:
        with pytest.raises(ProtocolError, match=why):
            await client.request("POST", "/", {}, b"")
        with pytest.raises(ProtocolError):
            await client.request("POST", "/", {}, b"")
    finally:
        await client.close()
    assert server.connections == 2


async def test_a_connection_the_server_closed_while_idle_is_replaced(
    serve: Callable[[Script], RawServer],
) -> None:
    def close_after_each_answer(request: bytes) -> tuple[list[bytes], bool]:
        return [OK], True

    server = serve(close_after_each_answer)
    await server.start()
    client = HttpClient(server.url)
    try:
        assert (await client.request("POST", "/", {}, b"")).status == 200
        await asyncio.sleep(0.1)  # the close reaches the client: the pool drops it
        assert (await client.request("POST", "/", {}, b"")).status == 200
    finally:
        await client.close()
    assert len(server.requests) == 2 and server.connections == 2


async def test_a_reused_connection_closed_before_any_answer_is_tried_once_more(
    serve: Callable[[Script], RawServer],
) -> None:
    """The keep-alive race: the server closes an idle connection just as the next request
    goes out on it. Sent again at once on a new connection, within the same request."""
    answered = 0

    def second_one_dropped(request: bytes) -> tuple[list[bytes], bool]:
        nonlocal answered
        answered += 1
        return ([], True) if answered == 2 else ([OK], False)

    server = serve(second_one_dropped)
    await server.start()
    client = HttpClient(server.url)
    try:
        assert (await client.request("POST", "/", {}, b"")).status == 200
        assert (await client.request("POST", "/", {}, b"")).status == 200
    finally:
        await client.close()
    assert len(server.requests) == 3 and server.connections == 2


async def test_a_request_is_not_lost_to_several_stale_connections(
    serve: Callable[[Script], RawServer],
) -> None:
    """Every pooled connection has gone stale on the server's side (closed by an idle
    timeout the server applies when the connection is read again): the second try took
    the next pooled connection, as stale, and the request failed (a failed attempt,
    dead-lettered at maxDeliver 1). The second try is on a new connection."""
    server = serve(answer(OK))
    await server.start()
    client = HttpClient(server.url, limit=4)
    try:
        warm = [client.request("POST", "/", {}, b"x", timeout=5) for _ in range(3)]
        assert [a.status for a in await asyncio.gather(*warm)] == [200] * 3
        assert server.connections == 3
        server.stale.update(server.writers)
        got = await client.request("POST", "/", {}, b"x", timeout=5)
        assert got.status == 200
    finally:
        await client.close()
    assert server.connections == 4


async def test_a_request_read_before_the_server_went_away_is_no_connect_failure(
    serve: Callable[[Script], RawServer],
) -> None:
    """The pooled connection's server read the request and closed it without a byte (as
    a service dying on it does), and a new connection is refused: the request may have
    been acted on, so it is Unanswered (a failed attempt), not ConnectFailed (which says
    nothing was sent: no attempt, httphandler)."""
    server = serve(answer(OK))
    await server.start()
    client = HttpClient(server.url)
    try:
        assert (await client.request("POST", "/", {}, b"x", timeout=5)).status == 200
        server.stale.update(server.writers)
        assert server.server is not None
        server.server.close()  # no new connections; the pooled one stays open
        with pytest.raises(Unanswered, match=r"a new one failed: .*refused"):
            await client.request("POST", "/", {}, b"x", timeout=5)
    finally:
        await client.close()
    assert len(server.requests) == 2  # the server read it


async def test_a_probe_asks_on_a_new_connection_outside_the_pool(
    serve: Callable[[Script], RawServer],
) -> None:
    """The reachability probe (httphandler) asks whether new connections are served: a
    pooled connection alive says nothing of those, and the pool's slots are the
    requests'."""
    server = serve(answer(OK))
    await server.start()
    client = HttpClient(server.url, limit=1)
    try:
        assert (await client.request("POST", "/", {}, b"x", timeout=5)).status == 200
        assert (await client.probe("/healthz", 5)).status == 200
        assert server.connections == 2 and server.requests[-1].startswith(b"GET /healthz ")
        assert server.server is not None
        server.server.close()  # new connections refused; the pooled one lives on
        with pytest.raises(ConnectFailed):
            await client.probe("/healthz", 5)
        assert (await client.request("POST", "/", {}, b"x", timeout=5)).status == 200
    finally:
        await client.close()


async def test_an_answer_cut_short_is_unanswered_and_not_sent_again(
    serve: Callable[[Script], RawServer],
) -> None:
    server = serve(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhal", close=True))
    await server.start()
    client = HttpClient(server.url)
    try:
        with pytest.raises(Unanswered, match="before the answer was complete"):
            await client.request("POST", "/", {}, b"")
    finally:
        await client.close()
    assert len(server.requests) == 1  # the server saw it: it may have acted on it


async def test_refused_timeout_and_cancel(serve: Callable[[Script], RawServer]) -> None:
    port = free_port()
    client = HttpClient(f"http://127.0.0.1:{port}/")
    with pytest.raises(
        ConnectFailed, match=rf"cannot connect to 127\.0\.0\.1:{port}: Connection refused"
    ):
        await client.request("POST", "/", {}, b"")
    await client.close()

    silent = serve(lambda request: ([], False))  # reads, never answers
    await silent.start()
    client = HttpClient(silent.url, limit=1)
    try:
        with pytest.raises(TimeoutError):
            await client.request("POST", "/", {}, b"", timeout=0.2)
        task = asyncio.create_task(client.request("POST", "/", {}, b""))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # limit=1: had the cancelled request kept its connection, this one would wait.
        with pytest.raises(TimeoutError):
            await client.request("POST", "/", {}, b"", timeout=0.2)
    finally:
        await client.close()
    # A timed-out or cancelled request's connection is never used again.
    assert silent.connections == 3
    with pytest.raises(RuntimeError, match="closed"):
        await client.request("POST", "/", {}, b"")


async def test_a_chunk_size_line_without_end_is_a_protocol_error(
    serve: Callable[[Script], RawServer],
) -> None:
    """Before: the buffer took everything such a server sent until the request's timeout
    (for good with none), gigabytes over loopback."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server = serve(answer(head, *[b"f" * 65536] * 40))
    await server.start()
    client = HttpClient(server.url)
    try:
        with pytest.raises(ProtocolError, match="chunk size line is longer"):
            await client.request("POST", "/messages", {}, b"x", timeout=20)
    finally:
        await client.close()


async def test_a_folded_header_line_is_read_as_one(serve: Callable[[Script], RawServer]) -> None:
    """Obsolete line folding (RFC 9112 5.2): a user agent replaces it with a space.
    Before: a protocol error, so a 2xx of such a server was never acked."""
    server = serve(answer(b"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 2\r\n\r\nok"))
    await server.start()
    client = HttpClient(server.url)
    try:
        got = await client.request("POST", "/messages", {}, b"x")
        assert (got.status, got.headers["x-a"], got.body) == (200, "a b", b"ok")
    finally:
        await client.close()


async def test_a_host_name_idna_refuses_is_a_connect_failure() -> None:
    """Before: UnicodeError (not an OSError) escaped, and killed the member's wait for
    its service at start."""
    client = HttpClient("http://a..b:9/")
    try:
        with pytest.raises(ConnectFailed, match="not a valid host name"):
            await client.request("POST", "/", {}, b"", timeout=5)
    finally:
        await client.close()


async def test_the_timeout_covers_connecting() -> None:
    """A server whose accept queue is full: a connect waits for the kernel's SYN
    retries (about two minutes). Before, only the exchange had a timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers: list[socket.socket] = []
    try:
        for _ in range(4):  # fill the accept queue (backlog 0 takes one or two)
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        await asyncio.sleep(0.2)
        client = HttpClient(f"http://127.0.0.1:{port}/")
        started = time.monotonic()
        try:
            with pytest.raises((ConnectFailed, TimeoutError)):
                await client.request("POST", "/", {}, b"", timeout=1.0)
        finally:
            await client.close()
        assert time.monotonic() - started < 10
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


async def test_the_pool_holds_at_most_limit_connections(
    serve: Callable[[Script], RawServer],
) -> None:
    server = serve(answer(OK))
    await server.start()
    client = HttpClient(server.url, limit=3)
    try:
        answers = await asyncio.gather(*(client.request("POST", "/", {}, b"") for _ in range(30)))
    finally:
        await client.close()
    assert all(a.status == 200 for a in answers)
    assert server.connections <= 3


async def test_https_with_a_private_ca(
    serve: Callable[[Script], RawServer], tmp_path: Path
) -> None:
    pki = ensure_pki(tmp_path, {})
    cert, key = ensure_serving_cert(pki, "handler")  # for localhost and 127.0.0.1
    server = serve(answer(OK))
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    await server.start(server_tls)
    trusting = ssl.create_default_context(cafile=str(pki.ca_cert))
    url = f"https://127.0.0.1:{server.port}/messages"
    client = HttpClient(url, ssl_context=trusting)
    try:
        assert (await client.request("POST", "/messages", {}, b"")).status == 200
    finally:
        await client.close()
    stranger = HttpClient(url)  # the system's CAs: the private one is unknown
    with pytest.raises(ConnectFailed, match=r"TLS with 127\.0\.0\.1"):
        await stranger.request("POST", "/messages", {}, b"")
    await stranger.close()


async def test_a_repeated_content_length_is_one_length(
    serve: Callable[[Script], RawServer],
) -> None:
    """RFC 9110 8.6: a list of one value repeated (a proxy merged the field) is that
    value. (Before: a ProtocolError, and a 2xx framed that way was never acked.)"""
    server = serve(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok"))
    await server.start()
    client = HttpClient(server.url)
    try:
        got = await client.request("POST", "/", {}, b"")
    finally:
        await client.close()
    assert (got.status, got.body) == (200, b"ok")


@pytest.mark.parametrize("where", ["value-lf", "value-cr", "name-lf"])
async def test_a_header_with_a_line_break_is_refused_and_nothing_is_sent(
    serve: Callable[[Script], RawServer], where: str
) -> None:
    """A line break in a header would end the request's head early: what follows it is
    read as a second request, whose answer the next request on the connection takes for
    its own (a message acked by another's answer). The client refuses to write it, and
    the connection goes on serving."""
    server = serve(answer(OK))
    await server.start()
    smuggled = "a\n\nPOST /smuggled HTTP/1.1\nX-Pad: x"
    headers = {
        "value-lf": {"X-Note": smuggled},
        "value-cr": {"X-Note": "a\r\rb"},
        "name-lf": {"X-Note\nPOST /smuggled HTTP/1.1\nX": "b"},
    }[where]
    client = HttpClient(server.url, limit=1)
    try:
        with pytest.raises(HeaderRefused, match=r"X-Note.*holds a line break"):
            await client.request("POST", "/messages", headers, b"A")
        got = await client.request("POST", "/messages", {"X-Note": "plain"}, b"B")
    finally:
        await client.close()
    assert got.status == 200
    assert len(server.requests) == 1 and server.requests[0].endswith(b"\r\n\r\nB")
    assert b"smuggled" not in b"".join(server.requests)


async def test_a_woken_waiter_that_is_cancelled_hands_the_connection_on(
    serve: Callable[[Script], RawServer],
) -> None:
    """With every connection in use, requests wait for one. A waiter woken for a freed
    connection and cancelled before it ran (a fence in the same turn of the loop) used
    to take the wake-up with it: the next waiter slept on beside an idle connection."""
    server = serve(answer(OK))
    await server.start()
    client = HttpClient(server.url, limit=1)
    try:
        # Hold the only connection until the test lets go of it.
        held = await client._acquire()
        second = asyncio.create_task(client.request("POST", "/", {}, b"2", timeout=10))
        third = asyncio.create_task(client.request("POST", "/", {}, b"3", timeout=10))
        await asyncio.sleep(0.1)
        assert len(client._waiting) == 2
        client._release(held)  # wakes the second ...
        second.cancel()  # ... which is cancelled before it runs
        done, _ = await asyncio.wait([third], timeout=5)
        assert done, "the third request slept on beside an idle connection"
        assert third.result().status == 200
        assert second.cancelled()
    finally:
        await client.close()


async def test_waiting_for_a_connection_counts_against_the_timeout(
    serve: Callable[[Script], RawServer],
) -> None:
    """A request waiting for a connection (all in use) ends at its timeout like any
    other (before: it waited as long as the connection was held, whatever its timeout)."""
    server = serve(answer(OK))
    await server.start()
    client = HttpClient(server.url, limit=1)
    try:
        held = await client._acquire()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await client.request("POST", "/", {}, b"", timeout=0.3)
        waited = time.monotonic() - started
        assert waited < 3, waited
        assert not client._waiting
        client._release(held)
        assert (await client.request("POST", "/", {}, b"", timeout=5)).status == 200
    finally:
        await client.close()
