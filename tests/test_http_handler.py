"""HTTP handlers (shoal.consumer.httphandler): the status-code table and the retry rules.

The full-stack tests run a real nats-server, a real etcd, a real member process whose
handler is a URL, and a real aiohttp web server in the test's own event loop, which
answers each message as its data scripts it and records what it received.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import re
import shutil
import socket
import tempfile
import time
import types
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from aiohttp import web

from harness.fleet import Fleet, settled, wait_for_status
from harness.servers import free_port
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.dispatch import Held
from shoal.consumer.handlers import (
    MAX_RETRY_AFTER,
    HandlerContext,
    HandlerTimeout,
    HandlerUnreachable,
    Message,
    PermanentError,
    RetryAfter,
    load_handler,
)
from shoal.consumer.httpclient import HeaderRefused, HttpClient
from shoal.consumer.httphandler import (
    ACK,
    PERMANENT,
    RETRY,
    HttpHandler,
    HttpStatusError,
    HttpUnavailable,
    classify,
    parse_retry_after,
    request_headers,
)
from shoal.consumer.ledger import LedgerRecord, audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.consumer.worker import Worker
from shoal.contracts.names import (
    DEAD_LETTER_REASON_HEADER,
    PROJECT_HEADER,
    SEQ_HEADER,
    dlq_subjects,
    partition_for,
    partition_subject,
)
from shoal.contracts.spec import SpecError, parse_spec
from shoal.group.config import GroupConfig, config_env, group_config
from shoal.group.handlerref import HandlerError, check_url_handler, import_handler
from shoal.group.jetstream import ensure_group
from shoal.group.status import read_status

T = TypeVar("T")


async def poll(
    check: Callable[[], T], timeout: float, what: str, *, until: Callable[[T], object] = bool
) -> T:
    """harness.waiting.eventually_async for a plain check (the service runs in this loop,
    so the test must not block it)."""

    async def value() -> T:
        return check()

    return await eventually_async(value, timeout, what, until=until)


# -- units ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, ACK),
        (201, ACK),
        (204, ACK),
        (299, ACK),
        (400, PERMANENT),
        (401, PERMANENT),
        (404, PERMANENT),
        (409, PERMANENT),
        (413, PERMANENT),
        (422, PERMANENT),
        (499, PERMANENT),
        (408, RETRY),
        (429, RETRY),
        (500, RETRY),
        (502, RETRY),
        (503, RETRY),
        (504, RETRY),
        (301, RETRY),  # redirects are not followed: a failed attempt
        (304, RETRY),
        (100, RETRY),
    ],
)
def test_status_classification(status: int, outcome: str) -> None:
    assert classify(status) == outcome


def test_retry_after_seconds_and_http_dates() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("5", now) == 5.0
    assert parse_retry_after(" 120 ", now) == 120.0
    assert parse_retry_after("0", now) == 0.0
    later = email.utils.formatdate(now + 30, usegmt=True)  # Tue, 14 Nov 2023 22:13:50 GMT
    assert parse_retry_after(later, now) == pytest.approx(30.0)
    earlier = email.utils.formatdate(now - 30, usegmt=True)
    assert parse_retry_after(earlier, now) == 0.0
    # The two obsolete forms RFC 9110 5.6.7 has recipients accept: RFC 850's, and
    # asctime's, which names no zone (GMT, as every HTTP date). Before: asctime's was None.
    assert parse_retry_after("Tuesday, 14-Nov-23 22:13:50 GMT", now) == pytest.approx(30.0)
    assert parse_retry_after("Tue Nov 14 22:13:50 2023", now) == pytest.approx(30.0)
    for bad in ("", "soon", "-1", "1.5", "Tue, 99 Foo 2023 25:61:00 GMT", "Tue, 14 Nov 2023"):
        assert parse_retry_after(bad, now) is None, bad


def test_retry_after_is_capped() -> None:
    assert RetryAfter(3600).delay == MAX_RETRY_AFTER == 300.0
    # Before: OverflowError, and ValueError past Python's 4,300-digit limit for int():
    # the answer's status and body were lost to an unexplained error.
    for huge in ("1" + "0" * 400, "9" * 5000):
        delay = parse_retry_after(huge)
        assert delay is not None and RetryAfter(delay).delay == MAX_RETRY_AFTER
    assert RetryAfter(-3).delay == 0.0
    assert RetryAfter(2.5).delay == 2.5
    assert "retry after 2.5 s" in repr(RetryAfter(2.5))


def _message(headers: dict[str, str], data: bytes = b"x") -> Message:
    context = HandlerContext("m-0", "shoal.test.g", None)
    return Message("proj-1", 7, data, headers, 42, 3, "shoal.test.g.7", context)


def test_request_headers() -> None:
    own = {
        "Nats-Msg-Id": "id-1",
        "Shoal-Project-Id": "proj-1",
        "X-Trace": "abc",
        "Content-Length": "999",
        "Host": "evil",
        "connection": "close",
        "Transfer-Encoding": "chunked",
        "Keep-Alive": "1",
        "Upgrade": "h2c",
        "Expect": "100-continue",
        "Shoal-Partition": "99",  # ours win
    }
    headers = request_headers(_message(own))
    assert headers == {
        "Shoal-Project-Id": "proj-1",
        "Shoal-Partition": "7",
        "Shoal-Message-Id": "id-1",
        "Shoal-Delivery-Count": "3",
        "Shoal-Stream-Sequence": "42",
        "Nats-Msg-Id": "id-1",
        "X-Trace": "abc",
        "Content-Type": "application/octet-stream",
    }
    typed = request_headers(_message({"content-type": "application/json"}))
    assert typed["content-type"] == "application/json" and "Content-Type" not in typed
    assert request_headers(_message({}))["Shoal-Message-Id"] == "seq-42"


def test_a_header_spelt_with_underscores_cannot_pass_for_ours() -> None:
    """CGI and WSGI servers read `Shoal_Message_Id` as `Shoal-Message-Id` (HTTP_SHOAL_
    MESSAGE_ID): the message's own header would corrupt the service's idempotency key."""
    own = {"Shoal_Message_Id": "other", "shoal_project_id": "other", "Content_Length": "9"}
    headers = request_headers(_message({**own, "X_Trace": "kept"}))
    assert headers["Shoal-Message-Id"] == "seq-42" and headers["Shoal-Project-Id"] == "proj-1"
    assert not own.keys() & headers.keys() and headers["X_Trace"] == "kept"
    # Content_Type is no Content-Type (servers drop it): the default type stays.
    typed = request_headers(_message({"Content_Type": "text/plain"}))
    assert typed["Content-Type"] == "application/octet-stream"


@pytest.mark.parametrize(
    ("own", "named"),
    [
        ({"X-Trace": "a\x00b"}, "'X-Trace' holds a control character"),
        ({"X-Trace": "a\x1bb"}, "'X-Trace' holds a control character"),
        ({"X-Trace": "a\x7f"}, "'X-Trace' holds a control character"),
        ({"X@Y": "1"}, "'X@Y' is not an HTTP field name"),
        ({"": "v"}, "'' is not an HTTP field name"),
        ({"X Y": "v"}, "'X Y' is not an HTTP field name"),
    ],
)
def test_a_header_no_http_request_can_carry_is_refused_by_name(
    own: dict[str, str], named: str
) -> None:
    with pytest.raises(HeaderRefused, match=re.escape(named)):
        request_headers(_message(own))
    # A tab is allowed in a field value, and so is any text beyond ASCII.
    assert request_headers(_message({"X-Trace": "a\tb \u00fc"}))["X-Trace"] == "a\tb \u00fc"


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/messages",
        "https://orders.prod.svc.cluster.local/v1/messages?x=1",
        "http://localhost",
        "http://[::1]:9000/m",
    ],
)
def test_url_handlers_are_accepted(url: str) -> None:
    assert parse_spec({"handler": url}).handler == url
    assert GroupConfig(group="g", handler=url).handler == url
    assert isinstance(load_handler(url), HttpHandler)
    assert check_url_handler(url) == url


@pytest.mark.parametrize(
    "url",
    [
        "http:/127.0.0.1/messages",
        "http://",
        "http://user:pw@host/messages",
        "http://host:port/messages",
        "http://host/with space",
        "http://host/#fragment",
        "ftp://host/messages",
        "http://-host/",
    ],
)
def test_malformed_urls_are_refused_readably(url: str) -> None:
    with pytest.raises(SpecError, match=re.escape("spec.handler must look like")) as refused:
        parse_spec({"handler": url})
    assert "http:// or https:// URL" in str(refused.value)
    if url.startswith("http"):
        with pytest.raises(HandlerError, match="must look like"):
            check_url_handler(url)


def test_a_port_beyond_65535_is_refused_by_the_member() -> None:
    with pytest.raises(HandlerError, match="out of range"):
        check_url_handler("http://127.0.0.1:70000/m")


def test_url_handlers_are_not_imported() -> None:
    """The operator imports Python handlers to check them; a URL is a service, and the
    check is skipped (shoal.operator.reconciler.handler_problem)."""
    from shoal.operator.reconciler import handler_problem
    from shoal.operator.settings import settings_from_env

    settings = settings_from_env({})
    assert handler_problem({"handler": "http://127.0.0.1:1/m"}, settings) is None
    assert handler_problem({"handler": "no.such.module:f"}, settings)
    with pytest.raises(HandlerError, match="is a URL"):
        import_handler("http://127.0.0.1:1/m")


def test_the_ready_path_reaches_the_pod_env() -> None:
    spec = {"handler": "http://127.0.0.1:8080/m", "handlerReadyPath": "/healthz"}
    config = group_config("ns", "g", spec, nats_url="nats://n:4222", etcd_endpoints="e:2379")
    assert config.handler_ready_path == "/healthz"
    assert config_env(config, ("handler_ready_path",)) == {"SHOAL_HANDLER_READY_PATH": "/healthz"}
    plain = group_config(
        "ns", "g", {"handler": "a:b"}, nats_url="nats://n:4222", etcd_endpoints="e:2379"
    )
    assert config_env(plain, ("handler_ready_path",)) == {}
    with pytest.raises(SpecError, match=r"spec\.handlerReadyPath must be a path"):
        parse_spec({"handler": "a:b", "handlerReadyPath": "healthz"})


def test_the_operator_puts_the_ready_path_in_the_pod_env() -> None:
    from shoal.operator.builders import POD_FIELDS

    assert "handler_ready_path" in POD_FIELDS


# -- a scripted HTTP service ------------------------------------------------------------


@dataclass
class Received:
    data: bytes
    headers: dict[str, str]
    at: float
    status: int = 0


@dataclass
class Service:
    """An aiohttp app in this loop: each POST is answered as its data says."""

    port: int
    received: list[Received] = field(default_factory=list)
    ready: bool = True
    socket: str | None = None  # listen on this Unix socket instead of the port
    runner: web.AppRunner | None = None
    aborted: list[str] = field(default_factory=list)

    def attempts(self, message_id: str) -> list[Received]:
        return [r for r in self.received if r.headers.get("Shoal-Message-Id") == message_id]

    def attempts_of(self, project: str) -> list[Received]:
        return [r for r in self.received if r.headers.get("Shoal-Project-Id") == project]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        data = await request.read()
        got = Received(data, dict(request.headers), time.time())
        self.received.append(got)
        attempt = len(self.attempts(got.headers.get("Shoal-Message-Id", "")))
        verb, _, arg = data.decode().partition(":")
        status, headers, body = 200, {}, b""
        if verb == "status":  # status:<code>[:<body>]
            code, _, text = arg.partition(":")
            status, body = int(code), text.encode()
        elif verb == "retry-after" and attempt == 1:  # retry-after:<seconds>, once
            status, headers = 503, {"Retry-After": arg}
        elif verb == "sleep" and attempt == 1:  # sleep:<seconds>, once
            try:
                await asyncio.sleep(float(arg))
            finally:
                if request.transport is None or request.transport.is_closing():
                    self.aborted.append(got.headers["Shoal-Message-Id"])
        got.status = status
        return web.Response(status=status, headers=headers, body=body)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 503)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/messages", self.handle)
        app.router.add_get("/healthz", self.healthz)
        self.runner = web.AppRunner(app, handle_signals=False)
        await self.runner.setup()
        if self.socket is not None:
            await web.UnixSite(self.runner, self.socket).start()
        else:
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @property
    def url(self) -> str:
        if self.socket is not None:
            return "http://localhost/messages"  # the Host header; the socket is the way
        return f"http://127.0.0.1:{self.port}/messages"


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    service = Service(free_port())
    yield service
    await service.stop()


# -- cancelling a request closes it -----------------------------------------------------


async def test_a_cancelled_request_is_closed_and_its_answer_ignored(service: Service) -> None:
    """A fence cancels the handler's task: the request's connection is closed (the
    service sees it), nothing is returned, and the session goes on serving."""
    await service.start()
    handler = HttpHandler(service.url, timeout=30, connections=4)
    try:
        task = asyncio.create_task(handler(_message({"Nats-Msg-Id": "slow"}, b"sleep:1")))
        await poll(lambda: len(service.received), 5, "the request", until=bool)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await poll(lambda: service.aborted, 5, "the service to see it", until=bool)
        assert service.aborted == ["slow"]
        await handler(_message({"Nats-Msg-Id": "next"}, b"ok"))
        with pytest.raises(PermanentError, match="answered 400 Bad Request: nope"):
            await handler(_message({"Nats-Msg-Id": "bad"}, b"status:400:nope"))
        with pytest.raises(HttpStatusError, match="answered 500"):
            await handler(_message({"Nats-Msg-Id": "err"}, b"status:500"))
        with pytest.raises(RetryAfter) as asked:
            await handler(_message({"Nats-Msg-Id": "ra"}, b"retry-after:7"))
        assert asked.value.delay == 7.0
    finally:
        await handler.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await handler(_message({"Nats-Msg-Id": "late"}, b"ok"))


async def test_a_request_dropped_after_it_connected_is_an_attempt() -> None:
    """A service that accepts the connection and closes it without answering may have
    read the message: a failed attempt (HttpUnavailable), and the service is reachable."""

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    handler = HttpHandler(f"http://127.0.0.1:{port}/messages", timeout=5)
    try:
        with pytest.raises(HttpUnavailable, match="before the answer was complete"):
            await handler(_message({}, b"ok"))
        assert handler.reach.ok
    finally:
        await handler.aclose()
        server.close()
        await server.wait_closed()


async def test_an_episode_ends_only_when_the_probe_finds_the_service_back() -> None:
    """A pooled connection closed unanswered, then a new connection refused: a failed
    attempt (the service may have read it) and the service is away, not back (an answer,
    or a loss, on a pooled connection says nothing of new ones). The probe ends the
    episode once a new connection is accepted."""
    served = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"Content-Length: (\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                served += 1
                if served == 2:  # dies on it: closed without a byte
                    writer.transport.abort()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    handler = HttpHandler(f"http://127.0.0.1:{port}/messages", timeout=5)
    told: list[str | None] = []
    handler.reach.on_change = told.append
    try:
        await handler(_message({}, b"ok"))  # a pooled connection
        server.close()  # new connections refused; the pooled one lives on
        with pytest.raises(HttpUnavailable, match="a new one failed"):
            await handler(_message({}, b"ok"))
        assert not handler.reach.ok and len(told) == 1 and told[0] is not None
        with pytest.raises(HandlerUnreachable):
            await handler(_message({}, b"ok"))
        server = await asyncio.start_server(serve, "127.0.0.1", port)
        await poll(lambda: handler.reach.ok, 5, "the probe to find it back", until=bool)
        assert told[-1] is None
    finally:
        await handler.aclose()
        server.close()


async def test_the_probe_takes_no_connection_a_request_waits_for(service: Service) -> None:
    """A member with one connection, busy: the probe connects beside it (a probe that
    waited for the pool's one slot timed out the requests waiting for it, each counted
    as an attempt though nothing was sent)."""
    await service.start()
    handler = HttpHandler(service.url, timeout=10, connections=1)
    try:
        busy = asyncio.create_task(handler(_message({}, b"sleep:2")))
        await poll(lambda: service.received, 5, "the busy request", until=bool)
        async with asyncio.timeout(1.0):
            await handler.client().connect_check(5)
        await busy
    finally:
        await handler.aclose()


async def test_a_connect_timeout_is_no_attempt_even_when_the_loop_is_late() -> None:
    """A service that accepts no connection in time (its accept queue full) under
    handlerTimeoutSeconds: the request's own deadline says so (no attempt). The worker's
    sweep, which cancels handlers past the timeout as failed attempts, used to fire in
    the same turn of a late event loop and count it as one."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = []
    for _ in range(3):  # fill the accept queue: further SYNs are dropped
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        queued.append(s)
    timeout = 1.0
    outcomes = []
    try:
        for _ in range(2):
            handler = HttpHandler(f"http://127.0.0.1:{port}/messages", timeout=timeout)
            held = Held(None, "p", 1, 1, time.monotonic())
            running: dict[asyncio.Task[Any], None] = {}
            worker = types.SimpleNamespace(
                config=types.SimpleNamespace(handler_timeout=timeout, partitions=1),
                dispatcher=types.SimpleNamespace(
                    running_heads=lambda held=held, running=running: [
                        (t, None, held) for t in running
                    ]
                ),
                _reach=handler.reach,
            )
            sweep = asyncio.create_task(Worker._watch_handlers(worker))  # type: ignore[arg-type]
            await asyncio.sleep(0.1)  # its checks a little ahead of the request's deadline

            async def lane(handler: HttpHandler = handler, held: Held = held) -> str:
                held.started = time.perf_counter()
                try:
                    await handler(_message({}, b"ok"))
                except HandlerUnreachable:
                    return "no attempt"
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    assert task is not None and held.timed_out
                    task.uncancel()
                    return "attempt"
                return "answered"

            task = asyncio.create_task(lane())
            running[task] = None
            await asyncio.sleep(timeout - 0.15)
            # The event loop is late (a busy member on a busy machine): blocked on purpose.
            time.sleep(0.4)  # noqa: ASYNC251
            outcomes.append(await task)
            sweep.cancel()
            await asyncio.gather(sweep, return_exceptions=True)
            await handler.aclose()
    finally:
        for s in queued:
            s.close()
        listener.close()
    assert outcomes == ["no attempt", "no attempt"]


async def test_a_refusal_of_a_long_url_keeps_its_status_and_body_in_the_reason(
    service: Service,
) -> None:
    """The dead-letter reason header keeps 500 characters: with a long handler URL the
    status and the body's first bytes were cut off."""
    await service.start()
    handler = HttpHandler(service.url + "?pad=" + "x" * 600, timeout=5)
    try:
        with pytest.raises(PermanentError) as refused:
            await handler(_message({"Nats-Msg-Id": "long"}, b"status:400:bad field"))
        reason = f"permanent error: {refused.value}"[:500]
        assert "answered 400 Bad Request: bad field" in reason, reason
    finally:
        await handler.aclose()


async def test_the_request_timeout_and_a_refused_connection(service: Service) -> None:
    handler = HttpHandler(service.url, timeout=0.3)
    try:
        # Nothing was sent: the message never reached the service (not an attempt).
        with pytest.raises(
            HandlerUnreachable,
            match=r"cannot connect to 127\.0\.0\.1:[0-9]+: Connection refused",
        ):
            await handler(_message({}, b"ok"))
        assert not handler.reach.ok
        assert handler.reach.waits == 0  # the worker counts the message's wait, once
        await service.start()
        # The probe finds it back with no message sent (a member the leader emptied).
        await poll(lambda: handler.reach.ok, 5, "the probe to connect", until=bool)
        started = time.monotonic()
        with pytest.raises(HandlerTimeout, match=r"no answer within 0\.3 s"):
            await handler(_message({}, b"sleep:2"))
        assert time.monotonic() - started < 1.5
    finally:
        await handler.aclose()


# -- a member on real servers -----------------------------------------------------------

PARTITIONS = 4
SETTINGS = (
    "handler",
    "partitions",
    "ledger",
    "max_deliver",
    "backoff",
    "handler_timeout",
    "handler_ready_path",
)


async def dead_letters(js: Any, config: GroupConfig, count: int) -> list[Any]:
    sub = await js.pull_subscribe(dlq_subjects(config.subject_prefix)[0], stream=config.dlq_stream)
    try:
        letters: list[Any] = []
        deadline = time.monotonic() + 30
        while len(letters) < count and time.monotonic() < deadline:
            try:
                letters += await sub.fetch(count - len(letters), timeout=2)
            except TimeoutError:
                pass
        return letters
    finally:
        await sub.unsubscribe()


def same_partition(base: str, count: int) -> list[str]:
    """`count` project ids on `base`'s partition (so they share a runner)."""
    target = partition_for(base, PARTITIONS)
    names = [base]
    i = 0
    while len(names) < count:
        name = f"{base}-{i}"
        i += 1
        if partition_for(name, PARTITIONS) == target:
            names.append(name)
    return names


@pytest.mark.e2e
@pytest.mark.timeout(180)
async def test_the_status_table_on_real_servers(
    service: Service,
    make_fleet: Callable[..., Fleet],
    make_config: Callable[..., GroupConfig],
    etcd: Etcd,
    js: Any,
) -> None:
    """One member, its handler the test's service:
    - 2xx acks, with the Shoal headers and the message's own;
    - 400 is dead-lettered at once, its status and body in the reason;
    - 503 with Retry-After: 2 is retried no sooner than 2 s later, and the project's next
      message waits for it (in order), while other projects go on;
    - 500 every time: retried, then dead-lettered after maxDeliver (3);
    - a request that sleeps past handlerTimeoutSeconds (1.5 s) is a failed attempt,
      and the retry succeeds."""
    await service.start()
    config = make_config(
        handler=service.url,
        partitions=PARTITIONS,
        ledger=False,
        max_deliver=3,
        backoff=(0.3,),
        handler_timeout=1.5,
    )
    await ensure_group(js, config)
    fleet = make_fleet(handler=service.url, partitions=PARTITIONS, ledger=False)
    fleet.start("m-0", **config_env(config, SETTINGS))
    await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 30)

    waiting, other = same_partition("waits", 2)
    items = [
        Outgoing("ok", b"ok", "ok-0", {"X-Trace": "t-1", "Content-Type": "text/plain"}),
        Outgoing("bad", b"status:400:no such order\r\nat all", "bad-0"),
        Outgoing(waiting, b"retry-after:2", "waits-0"),
        Outgoing(waiting, b"ok", "waits-1"),
        Outgoing("broken", b"status:500:down", "broken-0"),
        Outgoing("slow", b"sleep:4", "slow-0"),
        *[Outgoing(other, b"ok", f"other-{i}") for i in range(5)],
    ]
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)

    def settled_ids() -> set[str]:
        return {
            r.headers["Shoal-Message-Id"]
            for r in service.received
            if r.status == 200 and "Shoal-Message-Id" in r.headers
        }

    wanted = {"ok-0", "waits-0", "waits-1", "slow-0", *(f"other-{i}" for i in range(5))}
    await poll(settled_ids, 60, "the messages to be acked", until=wanted.__le__)
    letters = await dead_letters(js, config, 2)
    by_data = {m.data: m.headers[DEAD_LETTER_REASON_HEADER] for m in letters}
    assert len(letters) == 2, by_data

    # 2xx: acked; what arrived.
    (ok,) = service.attempts("ok-0")
    assert ok.data == b"ok"
    h = ok.headers
    assert h["Shoal-Project-Id"] == "ok"
    assert h["Shoal-Partition"] == str(partition_for("ok", PARTITIONS))
    assert h["Shoal-Message-Id"] == h["Nats-Msg-Id"] == "ok-0"
    assert h["Shoal-Delivery-Count"] == "1"
    assert int(h["Shoal-Stream-Sequence"]) >= 1
    assert h["X-Trace"] == "t-1" and h["Content-Type"] == "text/plain"

    # 400: dead-lettered at once, status and body (on one line) in the reason.
    assert len(service.attempts("bad-0")) == 1
    reason = by_data[b"status:400:no such order\r\nat all"]
    assert reason.startswith("permanent error: POST "), reason
    assert "answered 400 Bad Request: no such order at all" in reason, reason

    # 503 + Retry-After 2: not before 2 s, and its project's next message after it.
    first, second = service.attempts("waits-0")
    assert (first.status, second.status) == (503, 200)
    assert second.at - first.at >= 2.0, second.at - first.at
    assert second.headers["Shoal-Delivery-Count"] == "2"
    (later,) = service.attempts("waits-1")
    assert later.at >= second.at
    # ... while the other project of the same partition went on.
    others = [r for r in service.received if r.headers.get("Shoal-Project-Id") == other]
    assert len(others) == 5 and all(r.at < second.at for r in others)

    # 500 until maxDeliver (3), then dead-lettered.
    broken = service.attempts("broken-0")
    assert [r.status for r in broken] == [500, 500, 500]
    assert [r.headers["Shoal-Delivery-Count"] for r in broken] == ["1", "2", "3"]
    reason = by_data[b"status:500:down"]
    assert "failed 3 times" in reason and "answered 500 Internal Server Error: down" in reason

    # A request past handlerTimeoutSeconds: a failed attempt, then the retry succeeds.
    slow = service.attempts("slow-0")
    assert [r.headers["Shoal-Delivery-Count"] for r in slow] == ["1", "2"]
    assert slow[1].at - slow[0].at >= 1.5
    await poll(lambda: service.aborted, 10, "the slow request closed", until=bool)
    log = fleet.members["m-0"].log_text()
    assert "no answer within 1.5 s (handlerTimeoutSeconds)" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


async def handler_problem(etcd: Etcd, config: GroupConfig, member: str) -> str:
    """What etcd says keeps `member` from its handler (the operator and `status` show it)."""
    status = await read_status(etcd, config.namespace, config.group, PARTITIONS)
    problem = status.problems.get(member)
    return problem.message if problem is not None and problem.waits_for_handler else ""


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_service_away_costs_its_messages_no_attempt(
    service: Service,
    make_fleet: Callable[..., Fleet],
    make_config: Callable[..., GroupConfig],
    etcd: Etcd,
    js: Any,
) -> None:
    """The service accepts no connection (a sidecar restarting) for far longer than
    maxDeliver (2) backoffs (0.3 s): nothing is dead-lettered, the member says why it
    waits (log, etcd), and once the service is up the messages arrive in order, each
    at its first attempt. (A refused connection once counted as an attempt: every
    active project's head was dead-lettered within a second.)"""
    config = make_config(
        handler=service.url, partitions=PARTITIONS, ledger=False, max_deliver=2, backoff=(0.3,)
    )
    await ensure_group(js, config)
    fleet = make_fleet(handler=service.url, partitions=PARTITIONS, ledger=False)
    member = fleet.start("m-0", **config_env(config, SETTINGS))
    await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 30)
    items = [Outgoing(p, b"ok", f"{p}-{i}") for p in ("p", "q", "r") for i in range(3)]
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)
    await poll(member.log_text, 20, "the member to say", until=lambda t: "Cannot reach" in t)
    await eventually_async(
        lambda: handler_problem(etcd, config, "m-0"),
        10,
        "etcd to say why",
        until=lambda m: "Connection refused" in m,
    )
    await asyncio.sleep(4)  # ~13 backoffs of 0.3 s: maxDeliver 2 many times over
    await service.start()
    await poll(
        lambda: [r.headers["Shoal-Message-Id"] for r in service.received],
        30,
        "the messages",
        until=lambda ids: len(ids) >= len(items),
    )
    for project in ("p", "q", "r"):
        got = [r for r in service.received if r.headers["Shoal-Project-Id"] == project]
        assert [r.headers["Shoal-Message-Id"] for r in got] == [f"{project}-{i}" for i in range(3)]
        assert {r.headers["Shoal-Delivery-Count"] for r in got} == {"1"}
    assert len(service.received) == len(items)
    stream = await js.stream_info(config.dlq_stream)
    assert stream.state.messages == 0
    await eventually_async(
        lambda: handler_problem(etcd, config, "m-0"),
        10,
        "the problem to go",
        until=lambda m: m == "",
    )
    log = member.log_text()
    assert "The handler accepts connections again, after" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_service_back_but_not_ready_gets_no_message(
    service: Service,
    make_fleet: Callable[..., Fleet],
    make_config: Callable[..., GroupConfig],
    etcd: Etcd,
    js: Any,
) -> None:
    """A sidecar restarting listens before it can serve: with handlerReadyPath the member
    sends it nothing while the path answers 503 (each message would fail an attempt, and
    with maxDeliver 2, be dead-lettered), and everything once it answers 200."""
    config = make_config(
        handler=service.url,
        partitions=PARTITIONS,
        ledger=False,
        max_deliver=2,
        backoff=(0.3,),
        handler_ready_path="/healthz",
    )
    await ensure_group(js, config)
    await service.start()
    fleet = make_fleet(handler=service.url, partitions=PARTITIONS, ledger=False)
    fleet.start("m-0", **config_env(config, SETTINGS))
    await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 30)
    await service.stop()  # the sidecar restarts
    items = [Outgoing(p, b"ok", f"{p}-{i}") for p in ("p", "q") for i in range(3)]
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)
    await eventually_async(
        lambda: handler_problem(etcd, config, "m-0"),
        10,
        "etcd to say why",
        until=lambda m: "Connection refused" in m,
    )
    service.ready = False
    await service.start()  # listening, not ready
    await eventually_async(
        lambda: handler_problem(etcd, config, "m-0"),
        10,
        "the probe's 503 in etcd",
        until=lambda m: "answered 503" in m,
    )
    await asyncio.sleep(3)
    assert service.received == []
    service.ready = True
    await poll(lambda: service.received, 30, "the messages", until=lambda r: len(r) >= len(items))
    assert {r.headers["Shoal-Delivery-Count"] for r in service.received} == {"1"}
    for project in ("p", "q"):
        got = [r.headers["Shoal-Message-Id"] for r in service.attempts_of(project)]
        assert got == [f"{project}-{i}" for i in range(3)], got
    assert (await js.stream_info(config.dlq_stream)).state.messages == 0


@pytest.mark.e2e
@pytest.mark.timeout(150)
async def test_the_leader_gives_nothing_to_a_member_whose_handler_is_away(
    service: Service,
    make_fleet: Callable[..., Fleet],
    make_config: Callable[..., GroupConfig],
    etcd: Etcd,
    js: Any,
) -> None:
    """Two members, each with its own service (a sidecar each): m-1's accepts no
    connection. The leader gives every partition to m-0, whose service receives every
    message, in order, none dead-lettered; once m-1's service is up, m-1 owns partitions
    again."""
    away = Service(free_port())
    try:
        settings: dict[str, Any] = dict(
            partitions=PARTITIONS, ledger=False, max_deliver=2, backoff=(0.3,)
        )
        config = make_config(handler=service.url, **settings)
        await ensure_group(js, config)
        await service.start()
        fleet = make_fleet(handler=service.url, partitions=PARTITIONS, ledger=False)
        fleet.start("m-0", **config_env(config, SETTINGS))
        fleet.start("m-1", **config_env(make_config(handler=away.url, **settings), SETTINGS))
        await wait_for_status(
            etcd, config.namespace, config.group, PARTITIONS, settled({"m-0", "m-1"}), 30
        )
        projects = [f"project-{i}" for i in range(24)]
        items = [Outgoing(p, b"ok", f"{p}-{i}") for i in range(3) for p in projects]
        await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)

        def only_m0(status: Any) -> bool:
            return bool(status.owners) and set(status.owners.values()) == {"m-0"}

        await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, only_m0, 30)
        assert "Connection refused" in await handler_problem(etcd, config, "m-1")
        await poll(
            lambda: service.received, 30, "every message", until=lambda r: len(r) >= len(items)
        )
        for project in projects:
            got = [r.headers["Shoal-Message-Id"] for r in service.attempts_of(project)]
            assert got == [f"{project}-{i}" for i in range(3)], got
        assert len(service.received) == len(items)
        assert (await js.stream_info(config.dlq_stream)).state.messages == 0

        await away.start()
        await wait_for_status(
            etcd, config.namespace, config.group, PARTITIONS, settled({"m-0", "m-1"}), 30
        )
        assert await handler_problem(etcd, config, "m-1") == ""
    finally:
        await away.stop()


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_the_member_joins_once_the_handler_is_ready(
    service: Service,
    make_fleet: Callable[..., Fleet],
    make_config: Callable[..., GroupConfig],
    etcd: Etcd,
    js: Any,
) -> None:
    """handlerReadyPath: while nothing listens, then while it answers 503, the member
    does not register in etcd, and says why; once it answers 200, it joins."""
    config = make_config(
        handler=service.url, partitions=PARTITIONS, ledger=False, handler_ready_path="/healthz"
    )
    await ensure_group(js, config)
    fleet = make_fleet(handler=service.url, partitions=PARTITIONS, ledger=False)
    member = fleet.start("m-0", **config_env(config, SETTINGS))
    await poll(
        member.log_text, 20, "the member to say why it waits", until=lambda t: "Not joining" in t
    )
    assert "Connection refused" in member.log_text()

    async def waiting_for() -> str:
        return await handler_problem(etcd, config, "m-0")

    await eventually_async(waiting_for, 10, "etcd to say why", until=lambda m: "refused" in m)
    service.ready = False
    await service.start()
    await eventually_async(waiting_for, 10, "the 503 in etcd", until=lambda m: "answered 503" in m)
    status = await read_status(etcd, config.namespace, config.group, PARTITIONS)
    assert status.members == {}, status.as_dict()
    assert (await waiting_for()).startswith("GET http://127.0.0.1:")
    assert member.alive()
    service.ready = True
    joined = time.monotonic()
    await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 30)
    assert time.monotonic() - joined < 10
    assert "Handler ready (GET" in member.log_text()
    await eventually_async(waiting_for, 10, "the wait to leave etcd", until=lambda m: m == "")


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_the_member_writes_the_ledger_for_a_url_handler(
    service: Service,
    make_fleet: Callable[..., Fleet],
    make_config: Callable[..., GroupConfig],
    etcd: Etcd,
    js: Any,
) -> None:
    """With the group's ledger on, the member records each message its service answered
    2xx, with the built-in ledger handler's record, before it acks it: the audit of a
    group whose handler is a service in any language. A 503 answered once is recorded
    once, at its second attempt; a 400 (dead-lettered) is not recorded at all."""
    await service.start()
    config = make_config(
        handler=service.url, partitions=PARTITIONS, ledger=True, max_deliver=3, backoff=(0.2,)
    )
    await ensure_group(js, config)
    fleet = make_fleet(handler=service.url, partitions=PARTITIONS, ledger=True)
    fleet.start("m-0", **config_env(config, SETTINGS))
    await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 30)

    items = [
        Outgoing(f"project-{i % 20}", b"ok", f"led-{i}", {SEQ_HEADER: str(i // 20)})
        for i in range(200)
    ]
    items[7] = Outgoing("project-7", b"retry-after:0", "led-7", {SEQ_HEADER: "0"})
    refused = Outgoing("refused", b"status:400:no", "refused-0")
    started = time.time()
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many([*items, refused])
    await poll(
        lambda: {r.headers["Shoal-Message-Id"] for r in service.received if r.status == 200},
        60,
        "every message answered 200",
        until=lambda ids: len(ids) == len(items),
    )
    assert len(await dead_letters(js, config, 1)) == 1

    async def records() -> list[LedgerRecord]:
        return await read_ledger(js, config.ledger_stream)

    ledger = await eventually_async(
        records, 20, "the ledger", until=lambda r: len(r) >= len(items), interval=0.2
    )
    assert audit(ledger, [i.message_id or "" for i in items]).summary() == {
        "expected": len(items),
        "processed": len(items),
        "lost": 0,
        "duplicates": 0,
        "out_of_order": 0,
        "overlaps": 0,
    }
    assert "refused-0" not in {r.message_id for r in ledger}
    # The record is the built-in ledger handler's (handlers.ledger_record), its times
    # those of the request that was answered 2xx.
    (retried,) = [r for r in ledger if r.message_id == "led-7"]
    assert (retried.project_id, retried.partition, retried.member) == (
        "project-7",
        partition_for("project-7", PARTITIONS),
        "m-0",
    )
    assert retried.delivery_count == 2 and retried.seq == 0
    (second,) = [r for r in service.attempts("led-7") if r.status == 200]
    assert started <= retried.started <= second.at <= retried.finished
    assert "Traceback" not in fleet.members["m-0"].log_text()


async def publish_raw(nats_url: str, subject: str, header_block: bytes, data: bytes) -> None:
    """Publish as a client that writes its own protocol does: nats-py and nats.go take
    line breaks out of header values, nats-server passes a bare LF through."""
    host, port = nats_url.removeprefix("nats://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await reader.readline()  # INFO
        writer.write(b'CONNECT {"verbose":false,"headers":true,"protocol":1}\r\n')
        total = len(header_block) + len(data)
        writer.write(f"HPUB {subject} {len(header_block)} {total}\r\n".encode())
        writer.write(header_block + data + b"\r\nPING\r\n")
        await writer.drain()
        async with asyncio.timeout(5):
            await reader.readuntil(b"PONG\r\n")
    finally:
        writer.close()


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("header", "named"),
    [
        ("X-Note: a\n\nPOST /smuggled HTTP/1.1\nX-Pad: x", "'X-Note' holds a line break"),
        # The service's server would refuse these with a 400 naming nothing (aiohttp,
        # Node, Go): dead-lettered as the service's "400 Bad Request" before.
        ("X-Trace: a\x00b", "'X-Trace' holds a control character"),
        ("X@Y: 1", "'X@Y' is not an HTTP field name"),
    ],
    ids=["line-break", "control-character", "bad-name"],
)
async def test_a_header_with_a_line_break_is_dead_lettered_not_smuggled(
    header: str,
    named: str,
    service: Service,
    make_fleet: Callable[..., Fleet],
    make_config: Callable[..., GroupConfig],
    etcd: Etcd,
    js: Any,
    nats_url: str,
) -> None:
    """A NATS header value holding a bare LF (nats-server passes it through) written into
    the POST as it is would end the request's head early, and what follows would reach
    the service as a second request whose answer the next message on that connection
    took for its own. The member dead-letters such a message at once, naming the header,
    sends the service nothing of it, and goes on with the project's next message."""
    await service.start()
    config = make_config(handler=service.url, partitions=PARTITIONS, ledger=False, max_deliver=3)
    await ensure_group(js, config)
    fleet = make_fleet(handler=service.url, partitions=PARTITIONS, ledger=False)
    fleet.start("m-0", **config_env(config, SETTINGS))
    await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 30)
    subject = partition_subject(config.subject_prefix, partition_for("p", PARTITIONS))
    block = f"NATS/1.0\r\n{PROJECT_HEADER}: p\r\nNats-Msg-Id: bad-0\r\n{header}\r\n\r\n".encode()
    await publish_raw(nats_url, subject, block, b"ok")
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(
        [Outgoing("p", b"ok", "next-0")]
    )
    (letter,) = await dead_letters(js, config, 1)
    reason = letter.headers[DEAD_LETTER_REASON_HEADER]
    assert "permanent error" in reason and named in reason, reason
    await poll(lambda: service.attempts("next-0"), 30, "the project's next message")
    assert service.attempts("bad-0") == []
    assert [r.headers.get("Shoal-Message-Id") for r in service.received] == ["next-0"]


# -- spec.handlerSocket: the service on a Unix socket --------------------------------------


@pytest.fixture
async def socket_service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Service]:
    # A short directory: a socket's path must fit in 107 bytes.
    directory = tempfile.mkdtemp(prefix="shoal-sock-", dir="/tmp")
    service = Service(0, socket=f"{directory}/http.sock")
    yield service
    await service.stop()
    shutil.rmtree(directory, ignore_errors=True)


async def test_requests_go_to_the_unix_socket(socket_service: Service) -> None:
    """No socket yet: a refusal that names the socket (the message never reached the
    service, as for a refused connection). Then the request goes there, with the URL's
    path and Host."""
    assert socket_service.socket is not None
    handler = HttpHandler(socket_service.url, timeout=5, socket=socket_service.socket)
    try:
        with pytest.raises(HandlerUnreachable) as refused:
            await handler(_message({"Nats-Msg-Id": "early"}, b"ok"))
        assert f"cannot connect to Unix socket {socket_service.socket}" in str(refused.value)
        await socket_service.start()
        await handler(_message({"Nats-Msg-Id": "m-1"}, b"ok"))
        with pytest.raises(PermanentError, match="400"):
            await handler(_message({"Nats-Msg-Id": "m-2"}, b"status:400:no"))
        (got, _) = socket_service.received
        assert got.headers["Host"] == "localhost" and got.data == b"ok"
        assert got.headers["Shoal-Message-Id"] == "m-1"
    finally:
        await handler.aclose()


def test_a_socket_is_for_http_urls_only() -> None:
    with pytest.raises(ValueError, match="Unix socket serves http:// URLs only"):
        HttpClient("https://localhost/m", unix_socket="/run/h/s.sock")
    with pytest.raises(ValueError, match="needs an http:// URL handler"):
        GroupConfig(
            group="g",
            namespace="n",
            nats_url="nats://n:4222",
            etcd_endpoints="e:2379",
            handler="a:b",
            handler_socket="/run/h/s.sock",
        )


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_member_consumes_through_a_unix_socket(
    socket_service: Service,
    make_fleet: Callable[..., Fleet],
    make_config: Callable[..., GroupConfig],
    etcd: Etcd,
    js: Any,
) -> None:
    """spec.handlerSocket end to end: the member waits for the service's ready path on
    the socket, then every message reaches the service through it, once, in order per
    project (the ledger's audit)."""
    config = make_config(
        handler=socket_service.url,
        handler_socket=socket_service.socket,
        handler_ready_path="/healthz",
        partitions=PARTITIONS,
        ledger=True,
    )
    await ensure_group(js, config)
    fleet = make_fleet(handler=socket_service.url, partitions=PARTITIONS, ledger=True)
    member = fleet.start("m-0", **config_env(config, (*SETTINGS, "handler_socket")))
    await poll(
        member.log_text, 20, "the member to say why it waits", until=lambda t: "Not joining" in t
    )
    assert f"Unix socket {socket_service.socket}" in member.log_text()
    await socket_service.start()
    await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 30)
    items = [
        Outgoing(f"project-{i % 10}", b"ok", f"uds-{i}", {SEQ_HEADER: str(i // 10)})
        for i in range(300)
    ]
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)
    ledger = await eventually_async(
        lambda: read_ledger(js, config.ledger_stream),
        30,
        "the ledger",
        until=lambda r: len(r) >= len(items),
        interval=0.2,
    )
    summary = audit(ledger, [i.message_id or "" for i in items]).summary()
    assert summary == {
        "expected": len(items),
        "processed": len(items),
        "lost": 0,
        "duplicates": 0,
        "out_of_order": 0,
        "overlaps": 0,
    }
    assert len(socket_service.received) == len(items)
    assert "Traceback" not in member.log_text()
