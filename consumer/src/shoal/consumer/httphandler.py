"""HTTP handlers: the member POSTs each message to a service, whose answer settles it.

A group whose `spec.handler` is a URL (`http://127.0.0.1:8080/messages`, or `https://`)
runs no code of its own in the member: for every message the member POSTs the message's
data to that URL, with its headers:

- `Shoal-Project-Id`, `Shoal-Partition`, `Shoal-Message-Id` (`Nats-Msg-Id`, else
  `seq-<stream sequence>`), `Shoal-Delivery-Count` (the attempt, counting from 1, as
  `msg.delivery_count`), `Shoal-Stream-Sequence`;
- the message's own NATS headers, as they are, except those HTTP keeps for itself:
  hop-by-hop and framing headers (`Connection`, `Content-Length`, `Expect`, `Host`,
  `Keep-Alive`, `Proxy-Authorization`, `Proxy-Connection`, `TE`, `Trailer`,
  `Transfer-Encoding`, `Upgrade`) are left out, and the five above always win (a
  header that spells one of these names with `_` for `-` is left out too: CGI and WSGI
  servers read `Shoal_Message_Id` as `Shoal-Message-Id`);
- `Content-Type: application/octet-stream`, unless the message carries a Content-Type.

The answer decides, and everything else is as for a Python handler (one project's
messages one after another, in stream order; up to maxConcurrency requests in flight
over different projects; retries in place; hand-over; fencing):

    answer                          what the member does
    ------------------------------  ---------------------------------------------------
    2xx                             acks the message
    4xx other than 408 and 429      a permanent failure: dead-lettered at once; the
                                    reason header holds the status and the first 200
                                    bytes of the body
    408, 429, 5xx, any other        a failed attempt: retried in place after the
    status (redirects are not       backoff, or after Retry-After (seconds or an HTTP
    followed)                       date) when that is longer, at most 300 s
                                    (handlers.MAX_RETRY_AFTER); dead-lettered after
                                    maxDeliver attempts
    no answer within                a failed attempt, as above (the request is closed)
    handlerTimeoutSeconds
    no connection: refused, name    not an attempt: the message waits in place, and
    not found, TLS refused, no      nothing more is sent until a probe (every second:
    Unix socket                     handlerReadyPath answers 2xx if the group has one,
                                    else a connection is accepted) finds the service
                                    back; never dead-lettered for it (reach.py says
                                    why, and what the member does meanwhile)
    connection reset or closed      a failed attempt, as for a 5xx (the service may
    before the answer               have read it)
    a header holding a line break   a permanent failure: dead-lettered at once, the
    (a NATS header value may hold   header named in the reason (written as it is, it
    a bare LF), another control     would end the request's head early, or have the
    character, or a name that is    server refuse it with a 400 that names nothing)
    no HTTP field name

A request still open when the member is fenced or a partition is stopped is cancelled
with its handler's task: its connection is closed and the answer, if one comes, is never
read. Delivery is at-least-once, so the service should be idempotent (key its side
effects on `Shoal-Message-Id`): a message whose answer was lost is sent again. A
connection the service closed while idle (a keep-alive race) is tried once more at once
on a new connection, within the same attempt.

One client per member (shoal.consumer.httpclient: a small HTTP/1.1 client, five times
cheaper per request than aiohttp's; its docstring says why), made at the first message,
keeps connections alive and pooled (at most maxConcurrency of them, so no message waits
for one; idle ones are closed after KEEPALIVE seconds, before common servers' own idle
timeouts, e.g. Node.js' 5 s); `aclose()` closes it when the member stops, after its
open requests have finished or been cancelled (runtime.ConsumerProcess.shutdown).

With the group's ledger on (`spec.nats.stream.ledger`, SHOAL_LEDGER), the member records
each message the service answered 2xx to `<prefix>.ledger.<p>` before it acks it, with the
record the built-in `ledger` handler writes (handlers.record_in_ledger): a service in
another language cannot write Shoal's ledger, and the audit needs it.

`spec.handlerReadyPath` (`/healthz`): before joining the group the member GETs
`<scheme>://<host:port><path>` until it answers 2xx (`wait_ready`), saying why it waits
once, then every 30 s.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import logging
import re
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from shoal.consumer.handlers import (
    HandlerTimeout,
    HandlerUnreachable,
    Message,
    PermanentError,
    RetryAfter,
    record_in_ledger,
)
from shoal.consumer.httpclient import Answer, ConnectFailed, HeaderRefused, HttpClient, Unanswered
from shoal.consumer.reach import PROBE_EVERY, Reach
from shoal.group.handlerref import check_url_handler

__all__ = [
    "BODY_BYTES",
    "SKIPPED_HEADERS",
    "HttpHandler",
    "HttpStatusError",
    "HttpUnavailable",
    "classify",
    "parse_retry_after",
    "request_headers",
]

log = logging.getLogger(__name__)

# How much of a refusing answer's body goes into the reason (dead-letter header, logs).
BODY_BYTES = 200
# Idle pooled connections are closed after this long: some servers keep an idle
# connection no longer than 5 s, and a request sent on one they just closed fails.
KEEPALIVE = 4.0
# A ready probe's request gives up after this long (then it is tried again).
READY_PROBE_TIMEOUT = 5.0
READY_LOG_EVERY = 30.0

ACK = "ack"
PERMANENT = "permanent"
RETRY = "retry"

# Hop-by-hop and framing headers (RFC 9110 7.6.1, 6.4; RFC 9112), which belong to one
# HTTP connection and not to the message: a NATS header of that name is not sent.
SKIPPED_HEADERS = frozenset(
    {
        "connection",
        "content-length",
        "expect",
        "host",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
PROJECT_HEADER = "Shoal-Project-Id"
PARTITION_HEADER = "Shoal-Partition"
MESSAGE_ID_HEADER = "Shoal-Message-Id"
DELIVERY_COUNT_HEADER = "Shoal-Delivery-Count"
STREAM_SEQUENCE_HEADER = "Shoal-Stream-Sequence"
_OURS = frozenset(
    h.lower()
    for h in (
        PROJECT_HEADER,
        PARTITION_HEADER,
        MESSAGE_ID_HEADER,
        DELIVERY_COUNT_HEADER,
        STREAM_SEQUENCE_HEADER,
    )
)
_LEFT_OUT = SKIPPED_HEADERS | _OURS
OCTET_STREAM = "application/octet-stream"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")
# What an HTTP field value cannot hold (RFC 9110 5.5), but CR and LF: the client refuses
# those, naming the line break.
_BAD_IN_VALUE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_FIELD_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


class HttpStatusError(Exception):
    """The service answered with a status that asks for a retry (408, 429, 5xx, ...)."""


class HttpUnavailable(Exception):
    """The service dropped the request (the connection closed or garbled before the
    answer): a failed attempt, retried. (No connection at all: HandlerUnreachable.)"""


def classify(status: int) -> str:
    """ACK for 2xx, PERMANENT for 4xx but 408 and 429, RETRY for everything else."""
    if 200 <= status < 300:
        return ACK
    if 400 <= status < 500 and status not in (408, 429):
        return PERMANENT
    return RETRY


def parse_retry_after(value: str, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After value: delay-seconds or an HTTP date (RFC 9110
    10.2.3); None if it is neither. A date in the past is 0."""
    value = value.strip()
    if value.isascii() and value.isdigit():
        # Longer than any sane delay (the caller caps it), and int() refuses more than
        # 4,300 digits: an answer's header must not turn into an unexplained error.
        return float(value) if len(value) <= 12 else 1e12
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # HTTP dates are GMT; asctime's form names no zone
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def request_headers(msg: Message) -> dict[str, str]:
    """The HTTP headers a message is POSTed with (module docstring)."""
    headers = {
        PROJECT_HEADER: msg.project_id,
        PARTITION_HEADER: str(msg.partition),
        MESSAGE_ID_HEADER: msg.message_id,
        DELIVERY_COUNT_HEADER: str(msg.delivery_count),
        STREAM_SEQUENCE_HEADER: str(msg.stream_sequence),
    }
    typed = False
    own: Mapping[str, str] = msg.headers
    for name, value in own.items():
        lowered = name.lower().replace("_", "-")
        if lowered in _LEFT_OUT:
            continue
        if not _FIELD_NAME.fullmatch(name):
            raise HeaderRefused(
                f"header {name!r} is not an HTTP field name (RFC 9110 5.1), which an HTTP "
                "request cannot carry"
            )
        if name.lower() == "content-type":  # (not Content_Type: servers drop that one)
            typed = True
        headers[name] = value
    if not typed:
        headers["Content-Type"] = OCTET_STREAM
    if _BAD_IN_VALUE.search("".join(headers.values())):
        name = next(name for name, value in headers.items() if _BAD_IN_VALUE.search(value))
        raise HeaderRefused(
            f"header {name!r} holds a control character, which an HTTP request cannot carry"
        )
    return headers


# How much of the handler's URL and of a status line's reason phrase a failure's text
# keeps (see HttpHandler._refused).
URL_IN_REASON = 120
REASON_PHRASE = 100


def _snippet(body: bytes) -> str:
    """The first bytes of a body as one line of text (a NATS header holds no newline)."""
    text = body[:BODY_BYTES].decode("utf-8", errors="replace")
    return " ".join(_CONTROL.sub(" ", text).split())


class HttpHandler:
    """A handler that POSTs each message to `url` (module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 0.0,
        connections: int = 100,
        ledger: bool = False,
        socket: str | None = None,
    ) -> None:
        self.url = check_url_handler(url)
        # spec.handlerSocket: the URL's requests go to this Unix socket.
        self.socket = socket
        parts = urlsplit(url)
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.timeout = timeout  # handlerTimeoutSeconds; 0: none
        self.connections = max(1, connections)
        # The group's ledger is on: record each message answered 2xx, before its ack.
        self.ledger = ledger
        self._client: HttpClient | None = None
        self._closed = False
        # Whether the service accepts connections (reach.py); the runtime listens, and
        # the worker sends no message while it does not.
        self.reach = Reach()
        self._probe: asyncio.Task[None] | None = None
        # spec.handlerReadyPath, once wait_ready has used it: the probe asks it too.
        self.ready_path: str | None = None

    def __repr__(self) -> str:
        via = f", socket={self.socket!r}" if self.socket else ""
        return f"HttpHandler({self.url!r}{via})"

    def client(self) -> HttpClient:
        """The member's one pool of connections, made at first use."""
        client = self._client
        if client is None:
            if self._closed:
                raise RuntimeError("the HTTP handler's client is closed (the member stopped)")
            client = self._client = HttpClient(
                self.url,
                limit=self.connections,
                idle_timeout=KEEPALIVE,
                body_limit=BODY_BYTES,
                unix_socket=self.socket,
            )
        return client

    async def __call__(self, msg: Message) -> None:
        client = self._client or self.client()
        started = time.time() if self.ledger else 0.0
        try:
            answer = await client.request(
                "POST", self.target, request_headers(msg), msg.data, timeout=self.timeout or None
            )
        except HeaderRefused as exc:
            # No attempt can carry it: dead-lettered at once, with the header named.
            raise PermanentError(f"POST {self.url}: {exc}") from None
        except TimeoutError:
            raise HandlerTimeout(
                f"POST {self.url}: no answer within {self.timeout:g} s (handlerTimeoutSeconds)"
            ) from None
        except ConnectFailed as exc:
            # Nothing was sent: not an attempt (handlers.HandlerUnreachable).
            what = f"POST {self.url}: {exc}"
            self._unreachable(what)  # (the worker counts the message's wait)
            raise HandlerUnreachable(what) from None
        except Unanswered as exc:
            if exc.reconnect is not None:
                # Sent, perhaps read, then no new connection: an attempt, and the
                # service is away all the same.
                self._unreachable(f"POST {self.url}: {exc.reconnect}")
            raise HttpUnavailable(f"POST {self.url}: {exc}") from None
        except ConnectionError as exc:  # ProtocolError: connected, then garbled
            raise HttpUnavailable(f"POST {self.url}: {exc}") from None
        if not 200 <= answer.status < 300:
            self._refused(answer)
        if self.ledger:
            await record_in_ledger(msg, started)

    def _refused(self, answer: Answer) -> None:
        """Raise what a non-2xx answer means (module docstring's table)."""
        # Short enough that the dead-letter reason header (500 characters) keeps the
        # status and the body's first bytes, whatever the URL's and the phrase's length.
        url = self.url if len(self.url) <= URL_IN_REASON else self.url[:URL_IN_REASON] + "..."
        reason = " ".join(answer.reason[:REASON_PHRASE].split())
        what = f"POST {url} answered {answer.status}{f' {reason}' if reason else ''}"
        snippet = _snippet(answer.body)
        if snippet:
            what = f"{what}: {snippet}"
        if classify(answer.status) == PERMANENT:
            raise PermanentError(what)
        retry_after = answer.headers.get("retry-after")
        if retry_after is not None:
            delay = parse_retry_after(retry_after)
            if delay is not None:
                raise RetryAfter(delay, f"{what} (Retry-After: {retry_after.strip()})")
        raise HttpStatusError(what)

    async def wait_ready(
        self,
        path: str,
        *,
        log_every: float = READY_LOG_EVERY,
        waiting: Callable[[str], None] | None = None,
    ) -> float:
        """Return once GET <origin><path> answers 2xx (seconds waited), polling with a
        short backoff; why it waits is logged once, then every `log_every` seconds, and
        given to `waiting` after each answer that is not ready ("GET <url>: <why>")."""
        url = self.origin + path
        self.ready_path = path
        start = time.monotonic()
        logged: float | None = None
        delay = 0.05
        while True:
            try:
                answer = await self.client().request("GET", path, {}, timeout=READY_PROBE_TIMEOUT)
                if 200 <= answer.status < 300:
                    waited = time.monotonic() - start
                    if logged is not None:
                        log.info("Handler ready (GET %s) after %.1f s", url, waited)
                    return waited
                reason = f" {answer.reason}" if answer.reason else ""
                why = f"answered {answer.status}{reason}"
            except TimeoutError:
                why = "no answer in time"
            except ConnectionError as exc:
                why = str(exc)
            if waiting is not None:
                waiting(f"GET {url}: {why}")
            now = time.monotonic()
            if logged is None or now - logged >= log_every:
                log.info(
                    "Not joining the group yet: the handler is not ready (GET %s: %s, "
                    "for %.0f s); asking again",
                    url,
                    why,
                    now - start,
                )
                logged = now
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _unreachable(self, what: str) -> None:
        """Note that the service accepts no connection; the probe's task (one at a time)
        ends the episode."""
        self.reach.refused(what, message=False)
        if not self._closed and (self._probe is None or self._probe.done()):
            self._probe = asyncio.create_task(self._probe_until_reached(), name="reach")

    async def _probe_until_reached(self) -> None:
        """While the service is unreachable (the worker sends it no message meanwhile),
        ask every PROBE_EVERY seconds whether it is back: its ready path answers 2xx when
        the group has one (a service may listen before it can serve), else it accepts a
        connection. Only this ends an episode: an answer on a pooled connection says
        nothing of new ones (a service draining serves its open connections only)."""
        while not self.reach.ok and not self._closed:
            await asyncio.sleep(PROBE_EVERY)
            try:
                why = await self._probe_once()
            except Exception as exc:  # a bug must not leave the member cut off for good
                log.exception("Probing the handler failed; trying again")
                why = f"the probe failed: {exc!r}"
            if why is None:
                self.reach.reached()
            else:
                self.reach.refused(why, message=False)

    async def _probe_once(self) -> str | None:
        """None if the service is back, else why not."""
        client = self.client()
        # No longer than a request may take to connect: a service that accepts within
        # the probe's time but not within the requests' would flap between episodes.
        timeout = min(READY_PROBE_TIMEOUT, self.timeout or READY_PROBE_TIMEOUT)
        if self.ready_path is None:
            try:
                await client.connect_check(timeout)
            except ConnectFailed as exc:
                return f"POST {self.url}: {exc}"
            return None
        url = self.origin + self.ready_path
        try:
            answer = await client.probe(self.ready_path, timeout)
        except TimeoutError:
            return f"GET {url}: no answer in time"
        except ConnectionError as exc:
            return f"GET {url}: {exc}"
        if 200 <= answer.status < 300:
            return None
        return f"GET {url}: answered {answer.status}{f' {answer.reason}' if answer.reason else ''}"

    async def aclose(self) -> None:
        """Close the connections (the member is stopping)."""
        self._closed = True
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)
        client, self._client = self._client, None
        if client is not None:
            await client.close()
