"""A small HTTP/1.1 client for the member's HTTP handler: pooled keep-alive connections to
one origin, one request at a time on each.

Why not aiohttp's client: on this machine it spent about 0.1 ms of CPU per request
(URL objects, cookie jar, multidicts, tracing hooks, a timeout context per request), five
times what this one does (0.02 ms) and ten times what the member spends on a message with
an in-process handler; a member POSTing every message spent most of its time in it. The
member needs one thing, POST bytes to one origin and read the answer, so this is that:
an asyncio.Protocol per connection, requests written as one buffer, answers parsed with
bytes.find. It reads what HTTP/1.1 servers send: a status line, headers, and a body
framed by Content-Length, by chunked transfer coding, or by the end of the connection;
1xx answers are skipped.

A connection goes back to the pool only when its answer was read to the end and the
server keeps it open (HTTP/1.1, no ``Connection: close``); idle ones are dropped after
`idle_timeout` (before common servers' own idle timeouts, e.g. Node.js' 5 s), a second
before the idle timeout a server announces (`Keep-Alive: timeout=2`, gunicorn's), or when
the server closes them. A request whose connection was closed before any byte of an answer
came, on a connection that had served before, is sent again once on a new one (the
server closed it while idle: the request never reached a handler). A cancelled request
(the member was fenced, or stops) aborts its connection: half an answer can never be read
as the next one's.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

__all__ = ["Answer", "ConnectFailed", "HeaderRefused", "HttpClient", "ProtocolError", "Unanswered"]

# A response head longer than this is no answer we can use (and no reason to buffer more).
MAX_HEAD = 64 * 1024

_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_KEEP_ALIVE_TIMEOUT = re.compile(r"(?:^|[,;\s])timeout\s*=\s*([0-9]{1,6})", re.IGNORECASE)
# A server's own idle timeout (Keep-Alive: timeout=N) is trusted this much less: a request
# sent just before it closes the connection would meet the close (as undici does).
SERVER_IDLE_MARGIN = 1.0


def _digits(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes "²" and other digits int() refuses."""
    return text.isascii() and text.isdigit()


def content_length(value: str) -> int:
    """A Content-Length's length. A list of one repeated value ("2, 2", which a proxy
    may send for a field it merged) is that value (RFC 9110 8.6); anything else is a
    ProtocolError."""
    values = {v.strip() for v in value.split(",")}
    if len(values) != 1:
        raise ProtocolError(f"Content-Length {value[:40]!r} is no length")
    (length,) = values
    if not _digits(length):
        raise ProtocolError(f"Content-Length {value[:40]!r} is no length")
    return int(length)


class ConnectFailed(ConnectionError):
    """No connection could be made (refused, unknown name, TLS refused)."""


class Unanswered(ConnectionError):
    """The connection ended before the answer was complete. `reconnect`: the request was
    sent on a pooled connection that closed without a byte, and a new connection to send
    it again could not be made, or was made too late to send in time (the server may have
    read the first: not "never sent")."""

    def __init__(
        self, message: str, *, before_any_byte: bool, reconnect: ConnectFailed | None = None
    ) -> None:
        super().__init__(message)
        self.before_any_byte = before_any_byte
        self.reconnect = reconnect


def _resend_failed(exc: ConnectFailed) -> Unanswered:
    """The second try's new connection failed: the first try's connection may have been
    read before it closed (a server that died on it answers no byte either), so the
    request is not "never sent"."""
    return Unanswered(
        f"the connection closed before any answer, and a new one failed: {exc}",
        before_any_byte=True,
        reconnect=exc,
    )


class ProtocolError(ConnectionError):
    """What the server sent is not an HTTP/1.x answer."""


class HeaderRefused(ValueError):
    """A header that an HTTP/1.1 request cannot carry: its name or value holds a line break.

    Written as it is, the line break would end the request's head early and the rest
    would be read as a second request, whose answer the next request on the connection
    would take for its own. NATS header values can hold a bare LF (nats-server passes it
    through; only CRLF ends a NATS header line)."""


@dataclass(frozen=True)
class Answer:
    status: int
    reason: str
    headers: Mapping[str, str]  # names in lower case; a repeated header's last value
    body: bytes  # at most the client's body_limit bytes of it


class _Connection(asyncio.Protocol):
    """One connection: sends a request, parses its answer into a future."""

    def __init__(self, body_limit: int) -> None:
        self.body_limit = body_limit
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.served = 0  # answers read on this connection
        self.idle_since = 0.0
        # How long the server keeps it open idle, if it said so (Keep-Alive: timeout=N).
        self.server_idle: float | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future[Answer] | None = None
        self._got_bytes = False
        # The answer being read: its head, once parsed, and how its body is framed.
        self._head: tuple[int, str, dict[str, str], bool] | None = None
        self._framing = ""  # "length", "chunked" or "close"
        self._remaining = 0  # body bytes still to come ("length"), or in this chunk
        self._body = bytearray()
        self._chunk_state = "size"  # "size", "data", "data-end", "trailer"

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (write, abort), though not always an asyncio.Transport
        # instance: uvloop's are its own classes.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:
            # Bytes nobody asked for (a server talking out of turn): this connection can
            # no longer be trusted to frame the next answer.
            self.abort()
            return
        self._got_bytes = True
        self._buffer += data
        try:
            self._parse()
        except ProtocolError as exc:
            self._fail(exc)
            self.abort()

    def eof_received(self) -> bool | None:
        return False  # close our side too (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is None or self._waiter.done():
            return
        if self._head is not None and self._framing == "close":
            self._finish(keep=False)
            return
        why = f"the connection closed before the answer was complete ({exc or 'closed'})"
        self._fail(Unanswered(why, before_any_byte=not self._got_bytes))

    # -- requests ----------------------------------------------------------------------------

    def send(self, request: bytes) -> asyncio.Future[Answer]:
        assert self.transport is not None and self._waiter is None
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        self._got_bytes = False
        self.transport.write(request)
        return waiter

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def _finish(self, *, keep: bool) -> None:
        assert self._head is not None
        status, reason, headers, _ = self._head
        answer = Answer(status, reason, headers, bytes(self._body))
        self._head, self._body = None, bytearray()
        self._chunk_state = "size"
        self.served += 1
        if not keep:
            self.abort()
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    # -- parsing -----------------------------------------------------------------------------

    def _parse(self) -> None:
        while self._waiter is not None:
            if self._head is None:
                if not self._parse_head():
                    return
                continue
            if self._framing == "length":
                if not self._take_length():
                    return
            elif self._framing == "chunked":
                if not self._take_chunks():
                    return
            else:  # "close": everything until the server closes is the body
                self._keep_body(bytes(self._buffer))
                self._buffer.clear()
                return

    def _parse_head(self) -> bool:
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > MAX_HEAD:
                raise ProtocolError(f"an answer's head is longer than {MAX_HEAD} bytes")
            return False
        lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
        del buffer[: end + 4]
        version, _, rest = lines[0].partition(" ")
        code, _, reason = rest.partition(" ")
        if not version.startswith("HTTP/1.") or len(code) != 3 or not _digits(code):
            raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(code)
        headers: dict[str, str] = {}
        name = ""
        for line in lines[1:]:
            if line[:1] in (" ", "\t") and name:
                # An obsolete line folding (RFC 9112 5.2): a user agent replaces it with
                # a space. Refused, a 2xx of such a server was never acked.
                headers[name] = f"{headers[name]} {line.strip()}".strip()
                continue
            name, colon, value = line.partition(":")
            if not colon:
                raise ProtocolError(f"not a header line: {line[:80]!r}")
            name = name.strip().lower()
            headers[name] = value.strip()
        if 100 <= status < 200:
            return True  # an interim answer (100 Continue, 103 Early Hints): the next one
        keep = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
        hint = _KEEP_ALIVE_TIMEOUT.search(headers.get("keep-alive", ""))
        if hint:
            self.server_idle = float(hint.group(1))
        self._head = (status, reason, headers, keep)
        if status in (204, 304):
            self._remaining, self._framing = 0, "length"
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._framing = "chunked"
        elif "content-length" in headers:
            self._remaining, self._framing = content_length(headers["content-length"]), "length"
        else:
            self._framing = "close"
        return True

    def _keep_body(self, data: bytes) -> None:
        room = self.body_limit - len(self._body)
        if room > 0:
            self._body += data[:room]

    def _take_length(self) -> bool:
        take = min(self._remaining, len(self._buffer))
        if take:
            self._keep_body(bytes(self._buffer[:take]))
            del self._buffer[:take]
            self._remaining -= take
        if self._remaining:
            return False
        assert self._head is not None
        self._finish(keep=self._head[3] and not self._buffer)
        return True

    def _take_chunks(self) -> bool:
        buffer = self._buffer
        while True:
            if self._chunk_state == "size":
                end = buffer.find(b"\r\n")
                if end < 0:
                    # A size line (with its extensions) that never ends must not grow
                    # the buffer until the timeout, or for good without one.
                    if len(buffer) > MAX_HEAD:
                        raise ProtocolError(f"a chunk size line is longer than {MAX_HEAD} bytes")
                    return False
                size_text = bytes(buffer[:end]).split(b";", 1)[0].strip()
                del buffer[: end + 2]
                # Hex digits only: int(x, 16) also takes "-1", "0x10" and "1_0".
                if not _HEX.fullmatch(size_text):
                    raise ProtocolError(f"chunk size {size_text[:20]!r} is no number")
                self._remaining = int(size_text, 16)
                self._chunk_state = "data" if self._remaining else "trailer"
            elif self._chunk_state == "data":
                take = min(self._remaining, len(buffer))
                self._keep_body(bytes(buffer[:take]))
                del buffer[:take]
                self._remaining -= take
                if self._remaining:
                    return False
                self._chunk_state = "data-end"
            elif self._chunk_state == "data-end":
                if len(buffer) < 2:
                    return False
                if buffer[:2] != b"\r\n":
                    raise ProtocolError("a chunk does not end with CRLF")
                del buffer[:2]
                self._chunk_state = "size"
            else:  # "trailer": header lines until an empty one
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > MAX_HEAD:
                        raise ProtocolError(f"a trailer line is longer than {MAX_HEAD} bytes")
                    return False
                del buffer[: end + 2]
                if end == 0:
                    assert self._head is not None
                    self._finish(keep=self._head[3] and not buffer)
                    return True


class HttpClient:
    """Keep-alive connections to the origin of `url`, at most `limit` of them."""

    def __init__(
        self,
        url: str,
        *,
        limit: int = 100,
        idle_timeout: float = 4.0,
        body_limit: int = 1024,
        ssl_context: ssl.SSLContext | None = None,
        unix_socket: str | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        if unix_socket and parts.scheme != "http":
            raise ValueError(f"a Unix socket serves http:// URLs only, not {url!r}")
        # Connect here instead of the URL's host and port (spec.handlerSocket): the URL
        # still gives the Host header and the path. A loopback TCP send runs the
        # receiver's TCP stack inside the sender's system call; a Unix socket's does not
        # (12 against 1.5 us a send on this project's VM).
        self.unix_socket = unix_socket or None
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        default_port = self.port == (443 if parts.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if default_port else f"{host}:{self.port}"
        self.ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self.ssl = ssl_context or ssl.create_default_context()
        self.limit = max(1, limit)
        self.idle_timeout = idle_timeout
        self.body_limit = body_limit
        self._idle: list[_Connection] = []
        self._open = 0  # connections made and not yet given up (idle or in use)
        self._waiting: list[asyncio.Future[None]] = []
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def request(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: bytes = b"",
        *,
        timeout: float | None = None,
    ) -> Answer:
        """Send one request and read its answer. Raises ConnectFailed (only when nothing
        of the request was sent anywhere), Unanswered, ProtocolError, or TimeoutError
        after `timeout` seconds (the connection is then closed)."""
        request = self._encode(method, target, headers, body)
        loop = asyncio.get_running_loop()
        # The timeout covers connecting too: a server whose accept queue is full leaves a
        # connect waiting for the kernel's SYN retries, about two minutes.
        deadline = None if timeout is None else loop.time() + timeout
        for attempt in (1, 2):
            # The second try is on a new connection: the pooled ones went idle with the
            # one that failed, and may be as stale (a server closing idle connections
            # together, or only when it reads one again).
            try:
                conn = await self._acquire(deadline, fresh=attempt == 2)
            except ConnectFailed as exc:
                if attempt == 1:
                    raise  # nothing of this request was sent
                raise _resend_failed(exc) from exc
            reused = conn.served > 0
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                # No time left to send in (connecting took it): a request written now
                # would run on the server, its answer never read.
                self._release(conn)
                late = ConnectFailed(f"{self._where()} accepted a connection too late to send")
                if attempt == 1:
                    raise late  # nothing was sent
                raise _resend_failed(late)
            try:
                answer = await self._exchange(conn, request, left)
            except Unanswered as exc:
                self._release(conn)
                if attempt == 1 and reused and exc.before_any_byte:
                    continue  # closed by the server while idle: once more, on a new one
                raise
            except BaseException:
                conn.abort()  # cancelled, timed out or garbled: never reused
                self._release(conn)
                raise
            self._release(conn)
            return answer
        raise AssertionError("unreachable")

    def _encode(self, method: str, target: str, headers: Mapping[str, str], body: bytes) -> bytes:
        head = [f"{method} {target} HTTP/1.1\r\nHost: {self.host_header}\r\n"]
        head += [f"{name}: {value}\r\n" for name, value in headers.items()]
        head.append(f"Content-Length: {len(body)}\r\n\r\n")
        text = "".join(head)
        # Exactly one CR and one LF per line we wrote (two counts in C, cheaper than a
        # look at every value): any other would end a line early (HeaderRefused).
        lines = len(headers) + 4
        if text.count("\n") != lines or text.count("\r") != lines:
            raise HeaderRefused(_line_break_in(method, target, headers))
        # UTF-8: a project id may be any text, and servers pass such bytes through (RFC
        # 9110's obs-text).
        return text.encode() + body

    async def probe(self, target: str, timeout: float) -> Answer:
        """GET `target` on a new connection, outside the pool and its limit, closed after:
        whether the server serves new connections (a pooled one says nothing of those).
        Raises as request() does."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = await self._connect(deadline)
        try:
            answer = await self._exchange(
                conn, self._encode("GET", target, {}, b""), max(0.0, deadline - loop.time())
            )
        except BaseException:
            conn.abort()
            raise
        if conn.transport is not None:
            conn.transport.close()
        return answer

    async def connect_check(self, timeout: float) -> None:
        """Open a connection and close it: whether the server accepts connections (raises
        ConnectFailed). Outside the pool's limit: a probe takes no request's place."""
        conn = await self._connect(asyncio.get_running_loop().time() + timeout)
        if conn.transport is not None:
            conn.transport.close()

    async def _exchange(self, conn: _Connection, request: bytes, timeout: float | None) -> Answer:
        waiter = conn.send(request)
        if timeout is None:
            return await waiter
        loop = asyncio.get_running_loop()
        # One timer per request, cancelled on the answer: cheaper than asyncio.timeout().
        timer = loop.call_later(timeout, _expire, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()

    async def _acquire(self, deadline: float | None = None, *, fresh: bool = False) -> _Connection:
        """A pooled connection (the one used last), else a new one once the limit allows;
        `fresh`: a new one, the oldest idle one closed if the limit needs its place."""
        if self._closed:
            raise RuntimeError("the HTTP client is closed")
        now = time.monotonic()
        while self._idle and not fresh:
            conn = self._idle.pop()
            keep_for = self.idle_timeout
            if conn.server_idle is not None:
                keep_for = min(keep_for, conn.server_idle - SERVER_IDLE_MARGIN)
            if not conn.closed and now - conn.idle_since < keep_for:
                return conn
            conn.abort()
            self._open -= 1
        while self._open >= self.limit:
            if fresh and self._idle:
                self._idle.pop(0).abort()
                self._open -= 1
                continue
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    # Woken, but cancelled or timed out before it ran: the connection
                    # it was woken for goes to the next one waiting (_wake skips this
                    # one, done), not to nobody.
                    self._wake()
                raise
            finally:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
            if self._idle:
                return await self._acquire(deadline, fresh=fresh)
            if self._closed:
                raise RuntimeError("the HTTP client is closed")
        self._open += 1
        try:
            return await self._connect(deadline)
        except BaseException:
            self._open -= 1
            self._wake()
            raise

    async def _connect(self, deadline: float | None = None) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                if self.unix_socket is not None:
                    _, conn = await loop.create_unix_connection(
                        lambda: _Connection(self.body_limit), self.unix_socket
                    )
                else:
                    _, conn = await loop.create_connection(
                        lambda: _Connection(self.body_limit),
                        self.host,
                        self.port,
                        ssl=self.ssl,
                        server_hostname=self.host if self.ssl is not None else None,
                    )
        except TimeoutError as exc:
            raise ConnectFailed(f"{self._where()} did not accept a connection in time") from exc
        # OSError: refused, unknown name, TLS refused (ssl.SSLError). UnicodeError: a
        # host name IDNA cannot encode (an empty label, one over 63 characters).
        except (OSError, UnicodeError) as exc:
            if self.unix_socket is not None and isinstance(exc, OSError) and exc.errno:
                raise ConnectFailed(
                    f"cannot connect to Unix socket {self.unix_socket}: {os.strerror(exc.errno)}"
                ) from exc
            raise ConnectFailed(_connect_error(self.host, self.port, exc)) from exc
        return conn

    def _where(self) -> str:
        if self.unix_socket is not None:
            return f"Unix socket {self.unix_socket}"
        return f"{self.host}:{self.port}"

    def _release(self, conn: _Connection) -> None:
        if conn.closed or self._closed:
            conn.abort()
            self._open -= 1
        else:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiting:
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        """Close every connection; requests still open fail as their connections go."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.abort()
            self._open -= 1
        for waiter in self._waiting:
            if not waiter.done():
                waiter.set_result(None)
        await asyncio.sleep(0)  # let the transports close


def _line_break_in(method: str, target: str, headers: Mapping[str, str]) -> str:
    for name, value in headers.items():
        if any(c in name or c in value for c in "\r\n"):
            return f"header {name!r} holds a line break, which an HTTP request cannot carry"
    return f"{method} {target!r} holds a line break, which an HTTP request cannot carry"


def _expire(waiter: asyncio.Future[Answer]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


def _connect_error(host: str, port: int, exc: OSError | UnicodeError) -> str:
    if isinstance(exc, UnicodeError):
        return f"cannot resolve {host}: not a valid host name ({exc})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS with {host}:{port} failed: {exc.reason or exc}"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve {host}: {exc.strerror or exc}"
    if exc.errno:
        # "Connection refused", rather than asyncio's "Connect call failed (...)".
        return f"cannot connect to {host}:{port}: {os.strerror(exc.errno)}"
    return f"cannot connect to {host}:{port}: {exc}"
