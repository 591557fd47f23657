"""An asyncio face on the synchronous etcd3 client.

etcd3 blocks; every call here runs in a worker thread so the event loop never stalls
(a stalled loop would miss lease keep-alives and fetch deadlines): the client a call
uses is looked up (and built, when that is an RPC) in that thread too. Watches run on a
watcher thread per client (_Watcher, etcd3's without its spin) and are handed to the
loop with call_soon_threadsafe. Every call and watch requires etcd to have a leader, and
when calls fail over to another endpoint, watchers are told (on_new_client).

TLS and authentication: `Etcd(endpoints, ca_file=, cert_file=, key_file=, username=,
password=)` uses the same settings for every endpoint. The files are checked when the
`Etcd` is made (EtcdConfigError: one line naming the file), etcd3 reads them whenever it
opens a channel. With a username, etcd3 authenticates while it builds its client (a
blocking RPC), so that client is made in `connect()`, in a worker thread (never on the
event loop: during an outage each build can take the whole timeout), and made again
when etcd refuses its token (an expired simple token, or a JWT from an older auth store):
the refused call fails as a transient error and the caller's retry uses the new token.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import etcd3
import etcd3.exceptions
import etcd3.utils
import etcd3.watch
import grpc
from etcd3 import etcdrpc
from etcd3.client import Transactions

from shoal.clients.backoff import QuietLog

log = logging.getLogger(__name__)

T = TypeVar("T")


def _created_revision(responses: list[Any]) -> int | None:
    """The create_revision a transaction's get (after its put) read, if it read a key."""
    for response in responses:
        if isinstance(response, list) and response:
            _value, meta = response[0]
            return int(meta.create_revision)
    return None


class EtcdNoSpace(RuntimeError):
    """etcd refuses writes: its NOSPACE alarm is raised (the database reached its quota).

    It lasts until an operator compacts, defragments and disarms the alarm; reads, deletes
    and keep-alives still work. A retry later is right; a crash (and a crash loop, since
    joining needs a write) is not.
    """


# Builds transactions' compares and operations; holds no client (etcd3 gives each
# client one, and reading it on the loop would build a client there).
_TX = Transactions()

# Clients left behind by endpoint fail-overs that are kept open (calls may still run on
# them); older ones are closed.
MAX_RETIRED_CLIENTS = 4
# Timeouts' worth of silence (no call answered) after which a timed-out call on the one
# endpoint makes a new connection (Etcd._silent_connection).
SILENT_AFTER = 2

# Errors that mean "etcd is not reachable right now": worth a retry, never a crash.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.InternalServerError,
    EtcdNoSpace,
    TimeoutError,
)

# While etcd's NOSPACE alarm lasts, a reminder this often (the raise and the clearing
# are logged once each, when they happen; every refused write would flood the log).
NOSPACE_LOG_INTERVAL = 300.0

# The client calls that write: once one succeeds again, the NOSPACE alarm is gone (etcd
# refuses puts, lease grants and transactions with writes while it lasts; reads, deletes
# and keep-alives go on).
_WRITES = frozenset({"put", "transaction", "lease"})


# (etcd3's watcher thread's traceback at a clean exit is quieted by
# shoal.logs.quiet_known_noise, which the commands install: no import-time side effect.)

# gRPC's own reconnect backoff grows to 120 s: after a minute-long etcd outage a member
# went on failing every call, without trying, for 10-15 s after etcd was back. Capped at
# 5 s it still costs nothing while etcd is away.
#
# Keep-alive pings: a connection that dies without a word (etcd behind one Service
# address whose pod was replaced, an expired NAT entry: no FIN, no RST) otherwise stays
# in use until the kernel gives it up, some 15 minutes of retransmissions, with watches
# silent all along (tests/test_etcd_stranded.py). With a ping every 10 s, answered
# within 5 s, gRPC drops such a connection and makes a new one. gRPC puts the ping off
# while calls keep writing on the connection, so a client that also calls (every
# member) needs Etcd._silent_connection too. 10 s, not less: etcd refuses pings more
# often than its --grpc-keepalive-min-time (5 s by default) with a GOAWAY. Only while
# calls or watches are open, and with no limit on pings between data frames (a quiet
# watch sends none; gRPC's default of 2 would stop pinging it).
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5000),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    # A channel of its own connections: by default gRPC shares subchannels (connections)
    # between every channel to the same address with the same options in the process,
    # so a new client would go on using the old, dead connection.
    ("grpc.use_local_subchannel_pool", 1),
]

# gRPC metadata asking etcd to refuse (and for watches: cancel) a call on a member
# that has no leader.
REQUIRE_LEADER = ("hasleader", "true")

# How often an idle watcher thread looks for a new watch to open a stream for.
WATCHER_IDLE_POLL = 0.05


class _Watcher(etcd3.watch.Watcher):  # type: ignore[misc]
    """etcd3's watcher thread, without its spin, and with a leader required.

    etcd3 opens a new watch stream the moment the last one failed, for ever: with etcd
    down each attempt fails at once, and that loop burnt more than a core for as long as
    the outage lasted (also in every client a fail-over had retired). Here a stream is
    opened only while somebody wants a watch; its failure goes to the watchers, who
    watch again after their own backoff.

    Its streams carry the client's metadata, so `hasleader=true` (REQUIRE_LEADER): an
    etcd member cut from its peers still answers on its client port but sees no writes,
    so its watches would go silent, no event and no error, and every view on it would
    freeze. With the flag, etcd cancels them once the member has lost its leader (after
    three election timeouts), and the watchers move on (see Etcd.on_new_client: calls
    fail over to the next endpoint).
    """

    # etcd3's own state (untyped there).
    _callbacks: dict[int, Callable[[Any], None]]
    _request_queue: queue.Queue[Any]
    _new_watch: Any

    def __init__(self, client: Any) -> None:
        super().__init__(
            etcdrpc.WatchStub(client.channel),
            timeout=client.timeout,
            call_credentials=client.call_credentials,
            metadata=client.metadata,
        )
        self.closed = threading.Event()

    def _wanted(self) -> bool:
        return bool(self._callbacks) or self._new_watch is not None

    def _run(self) -> None:
        while not self.closed.is_set():
            with self._lock:
                if not self._wanted():
                    self._new_watch_cond.wait(WATCHER_IDLE_POLL)
                    continue
                requests = self._request_queue
            try:
                stream = self._watch_stub.Watch(
                    etcd3.watch._new_request_iter(requests),
                    credentials=self._credentials,
                    metadata=self._metadata,
                )
                for response in stream:
                    self._handle_response(response)
                # A stream etcd ended without an error: its watches are gone all the same.
                error: BaseException = etcd3.exceptions.ConnectionFailedError()
            except grpc.RpcError as exc:
                error = exc
            except ValueError:  # "Channel closed": the client was closed
                return
            with self._lock:
                if self._new_watch:
                    self._new_watch.err = error
                    self._new_watch_cond.notify_all()
                callbacks, self._callbacks = self._callbacks, {}
                # A new queue for the next stream (as etcd3 does): requests meant for
                # this one must not leak into it.
                requests.put(None)
                self._request_queue = queue.Queue(maxsize=10)
            for callback in callbacks.values():
                etcd3.watch._safe_callback(callback, error)

    def _handle_response(self, response: Any) -> None:
        # etcd3 drops a response that says etcd cancelled a watch (other than for a
        # compaction) and keeps its callback: that watch would be silent for ever.
        if response.canceled and not response.created and not response.compact_revision:
            with self._lock:
                callback = self._callbacks.pop(response.watch_id, None)
            if callback is not None:  # None: we cancelled it ourselves
                reason = response.cancel_reason or "no reason given"
                etcd3.watch._safe_callback(callback, WatchCanceled(reason))
            return
        super()._handle_response(response)


class WatchCanceled(RuntimeError):
    """etcd cancelled a watch (its cancel_reason)."""


def _close_client(client: Any) -> None:
    watcher = getattr(client, "watcher", None)
    if isinstance(watcher, _Watcher):
        watcher.closed.set()
    client.close()


class EtcdUnavailable(RuntimeError):
    """etcd could not be reached within the allowed attempts."""


class EtcdConfigError(ValueError):
    """The TLS or credential settings cannot work: an unreadable file, half a pair."""


class EtcdAuthError(RuntimeError):
    """etcd refused the username and password (retrying will not help)."""


# What gRPC says when a TLS handshake fails (no client certificate, an unknown CA, TLS
# spoken to a plain port).
_TLS_SIGNS = ("TSI_", "SSL", "ssl", "handshake", "certificate")


def prefix_end(prefix: str) -> str:
    """The end of the range of keys under prefix (etcd's: its last byte plus one)."""
    end: bytes = etcd3.utils.increment_last_byte(prefix.encode())
    return end.decode()


def describe(exc: BaseException) -> str:
    """An etcd3 error with what gRPC said (etcd3 raises its errors without a message)."""
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        # A raw one (a watch stream's end): its str() is gRPC's whole debug dump.
        return f"{exc.code().name}: {exc.details()}"
    text = str(exc)
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, grpc.RpcError):
        details = str(cause.details() or "")
        if details:
            text = f"{text}: {details}" if text else details
            if any(sign in details for sign in _TLS_SIGNS):
                text += (
                    " (a TLS problem? check that the CA, client certificate and key match"
                    " the etcd server's TLS settings)"
                )
    return text or type(exc).__name__


def _check_readable(what: str, path: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise EtcdConfigError(
            f"etcd {what} file {path} is not readable: {exc.strerror or exc}"
        ) from None


def check_security(
    ca_file: str | None,
    cert_file: str | None,
    key_file: str | None,
    username: str | None,
    password: str | None,
) -> None:
    """Raise EtcdConfigError (one line) unless these settings can make an etcd3 client."""
    if bool(cert_file) != bool(key_file):
        raise EtcdConfigError(
            "etcd client certificate and key go together: set both files or neither"
        )
    if cert_file and not ca_file:
        raise EtcdConfigError("an etcd client certificate needs the CA file of the etcd server")
    if bool(username) != bool(password):
        raise EtcdConfigError("etcd username and password go together: set both or neither")
    if username and not ca_file:
        # etcd3 sends the token as gRPC call credentials, which gRPC sends only over TLS
        # (and a password in clear text would be a bad idea anyway).
        raise EtcdConfigError("an etcd username and password need TLS: set the CA file too")
    for what, path in (("CA", ca_file), ("client certificate", cert_file), ("key", key_file)):
        if path:
            _check_readable(what, path)


def parse_endpoints(value: str | Sequence[str]) -> list[tuple[str, int]]:
    """Parse "host:port,host2:port2" (an optional http:// is dropped) into pairs."""
    items = value.split(",") if isinstance(value, str) else list(value)
    endpoints: list[tuple[str, int]] = []
    for raw in items:
        item = raw.strip()
        if not item:
            continue
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme) :]
        host, sep, port = item.rstrip("/").rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"etcd endpoint {raw!r} is not host:port")
        endpoints.append((host, int(port)))
    if not endpoints:
        raise ValueError("no etcd endpoint given (set ETCD_ENDPOINTS or --etcd)")
    return endpoints


def key_text(key: bytes) -> str:
    """An etcd key as text. Bytes that are not UTF-8 become backslash escapes: such a key
    is then garbage to its readers (logged and ignored) rather than an error that fails
    every listing of the group's keys, and with it every member's view."""
    return key.decode(errors="backslashreplace")


@dataclass(frozen=True)
class KV:
    """One key as etcd last reported it."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class Watch:
    """A watch, and the client it lives on."""

    client: Any
    watch_id: int


# How a refused token shows: an expired one, or (JWT) one from before an auth store change.
_TOKEN_REFUSED = ("invalid auth token", "revision of auth store is old")


class Etcd:
    """A connection to one of several etcd endpoints, with async wrappers."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: float = 3.0,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = timeout
        check_security(ca_file, cert_file, key_file, username, password)
        self.ca_file = ca_file or None
        self.cert_file = cert_file or None
        self.key_file = key_file or None
        self.username = username or None
        self._password = password or None
        self._index = 0
        self._lock = threading.Lock()
        self._renewed = 0.0
        self._no_space_logged = 0.0
        # Whether etcd refuses our writes (NOSPACE alarm) as far as our last write knows.
        self.no_space = False
        # Clients replaced after a refused token: their watches may still deliver, so
        # they are closed with this one, not at once.
        self._retired: list[Any] = []
        # Told (from whichever thread) when calls move to a new client: watches live on
        # the client that made them, and must move too (GroupView).
        self._on_new_client: list[Callable[[], None]] = []
        self._fail_overs = QuietLog(log)
        # When a call last got an answer, and when the client was last replaced (for a
        # silent connection: _silent_connection).
        self._answered = time.monotonic()
        self._replaced = 0.0
        # With a username, building a client is an RPC: connect() does it, off the loop.
        self._client: Any = None if self.username else self._make_client()
        # Our own threads: a hand-over issues dozens of claims and releases at once, and
        # asyncio's default executor (cores + 4 threads) would queue them one behind the
        # other. The gRPC channel multiplexes the calls.
        self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="etcd")

    def _make_client(self) -> Any:
        """A client for the current endpoint (blocking when it must authenticate)."""
        host, port = self.endpoints[self._index % len(self.endpoints)]
        try:
            client = etcd3.client(
                host=host,
                port=port,
                timeout=self.timeout,
                ca_cert=self.ca_file,
                cert_cert=self.cert_file,
                cert_key=self.key_file,
                user=self.username,
                password=self._password,
                grpc_options=GRPC_OPTIONS,
            )
            # WithRequireLeader, as etcd's own client offers it: an etcd member cut from
            # its peers answers every call with "no leader" at once (not after the whole
            # timeout), so calls fail over, and it cancels our watches (see _Watcher).
            client.metadata = (*(client.metadata or ()), REQUIRE_LEADER)
            client.watcher = _Watcher(client)
            return client
        except OSError as exc:  # etcd3 reads the TLS files here
            raise EtcdConfigError(f"etcd TLS file unreadable: {exc}") from None
        except grpc.RpcError as exc:  # only the Authenticate call raises these
            code = exc.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                raise etcd3.exceptions.ConnectionFailedError() from exc
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise etcd3.exceptions.ConnectionTimeoutError() from exc
            raise EtcdAuthError(
                f"etcd at {host}:{port} refused user {self.username!r}: {exc.details()}"
            ) from None

    @property
    def client(self) -> Any:
        """The etcd3 client. With a username, connect() first (building it blocks)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    @client.setter
    def client(self, value: Any) -> None:
        self._client = value

    def _ensure_client(self) -> None:
        _ = self.client  # builds it

    def on_new_client(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from any thread) whenever calls move to another client: an
        endpoint fail-over, a token renewal. Watches made before stay on the old one."""
        self._on_new_client.append(callback)

    def _new_client(self) -> None:
        for callback in self._on_new_client:
            try:
                callback()
            except Exception:
                log.exception("A new-client callback failed")

    @property
    def endpoint(self) -> str:
        host, port = self.endpoints[self._index % len(self.endpoints)]
        return f"{host}:{port}"

    def rotate(self) -> None:
        """Move to the next endpoint (after a connection failure)."""
        if len(self.endpoints) > 1:
            self._index += 1
            old, self._client = self._client, None
            if old is not None:
                _close_client(old)
            if not self.username:
                self._client = self._make_client()
            self._new_client()

    def _renew_token(self) -> None:
        """etcd refused our token: authenticate again (in a worker thread)."""
        with self._lock:
            if time.monotonic() - self._renewed < 1.0:
                return  # another thread just did
            fresh = self._make_client()
            self._renewed = time.monotonic()
            if self._client is not None:
                self._retired.append(self._client)
            self._client = fresh
        log.info("Authenticated again to etcd at %s (its token was refused)", self.endpoint)
        self._new_client()

    def _fail_over(self, failed: Any) -> None:
        """`failed`, the client in use, lost its endpoint: use the next one from now on.

        Endpoints used to rotate only in connect(), so once connected a member stayed on
        its first endpoint: with that etcd member down, every call failed, the member
        fenced itself and its lease expired, while the rest of the cluster was fine.
        Only the first failure of the current client moves on (the calls in flight on it
        fail too), and the old client is retired, not closed: closing it under those
        calls would make them fail with errors nobody retries.
        """
        if len(self.endpoints) < 2:
            return
        self._replace_client(failed, moved=True)

    def _replace_client(self, failed: Any, *, moved: bool) -> None:
        """Retire `failed` (if it is still the current client) for a new one: on the
        next endpoint (`moved`), or on the same one (a new connection)."""
        with self._lock:
            # `failed` is None when building the client failed (with a username that is
            # an RPC): the endpoint is as dead as if a call on it had failed.
            if self._client is not failed:
                return  # another call moved on already
            old = self.endpoint
            if moved:
                self._index += 1
            self._replaced = time.monotonic()
            if failed is not None:
                self._retired.append(failed)
            while len(self._retired) > MAX_RETIRED_CLIENTS:
                try:
                    _close_client(self._retired.pop(0))
                except Exception:
                    log.debug("Closing a retired etcd client failed", exc_info=True)
            try:
                self._client = self._make_client()
            except Exception as exc:  # with a username, building it is an RPC
                log.debug("etcd client for %s not built yet: %r", self.endpoint, exc)
                self._client = None
        if moved:
            # With every endpoint down, each failure moves on: one line per 10 s says so.
            self._fail_overs.failed(
                logging.WARNING, "etcd at %s unreachable; using %s from now on", old, self.endpoint
            )
        else:
            self._fail_overs.failed(
                logging.WARNING,
                "etcd at %s: no answer on this connection for %.0f s; opening a new one",
                old,
                time.monotonic() - self._answered,
            )
        self._new_client()

    def _silent_connection(self, failed: Any) -> None:
        """A call on the one endpoint timed out. If nothing has answered for a while,
        the connection may be dead without a word (etcd behind one Service address whose
        pod was replaced, an expired NAT entry: no FIN, no RST): gRPC would go on using
        it until the kernel gives it up, some 15 minutes, and keep-alive pings do not
        fire while calls keep writing on it. A new client makes a new connection, and
        its watches are made again (on_new_client). At most once per SILENT_AFTER
        timeouts: an etcd that is merely slow costs one reconnection now and then."""
        now = time.monotonic()
        bound = SILENT_AFTER * self.timeout
        if now - self._answered >= bound and now - self._replaced >= bound:
            self._replace_client(failed, moved=False)

    def _run(self, op: Callable[[Any], T], name: str, resolve: bool) -> T:
        """op(client), in a worker thread: with `resolve`, the client is resolved (and,
        with a username, built: an RPC that can take the whole timeout) here, never on
        the event loop."""
        client = self._client
        try:
            if client is None and resolve:
                client = self.client
            result = op(client)
        except (
            etcd3.exceptions.ConnectionFailedError,
            etcd3.exceptions.ConnectionTimeoutError,
        ) as exc:
            if client is not None or resolve:  # (connect() rotates on its own)
                self._fail_over(client)
                if len(self.endpoints) == 1 and isinstance(
                    exc, etcd3.exceptions.ConnectionTimeoutError
                ):
                    self._silent_connection(client)
            raise
        except grpc.RpcError as exc:
            code, details = exc.code(), str(exc.details() or "")
            if self.username and (
                code == grpc.StatusCode.UNAUTHENTICATED
                or any(text in details for text in _TOKEN_REFUSED)
            ):
                self._renew_token()
                # Refused, so not applied: the caller's usual retry is safe.
                raise etcd3.exceptions.ConnectionFailedError() from exc
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # etcd3 re-raises this one as a raw gRPC error, which no caller retries:
                # every component that writes would die on it.
                self._log_no_space(details)
                raise EtcdNoSpace(details) from exc
            if code == grpc.StatusCode.PERMISSION_DENIED or "user name is empty" in details:
                who = f"user {self.username!r}" if self.username else "an anonymous client"
                raise EtcdAuthError(
                    f"etcd at {self.endpoint} refused {who}: {details or code}"
                ) from None
            raise
        self._answered = time.monotonic()
        if self.no_space and name in _WRITES:
            self.no_space = False
            log.warning(
                "etcd at %s accepts writes again: its NOSPACE alarm is cleared", self.endpoint
            )
        return result

    def _log_no_space(self, details: str) -> None:
        """One line when the alarm is first met, then a reminder every 5 minutes."""
        now = time.monotonic()
        if self.no_space and now - self._no_space_logged < NOSPACE_LOG_INTERVAL:
            return
        again = self.no_space
        self.no_space = True
        self._no_space_logged = now
        log.error(
            "etcd at %s refuses writes (%s): its NOSPACE alarm is raised%s. This member goes "
            "on consuming the partitions it holds, but cannot join, claim or move any until "
            "an operator frees space (etcdctl compact, defrag, alarm disarm)",
            self.endpoint,
            details or "RESOURCE_EXHAUSTED",
            " (still)" if again else "",
        )

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) in a worker thread. A bound method of `client` names the
        client as it was on the loop; the methods below use `_call`, which does not."""
        name = getattr(fn, "__name__", "")
        return await self._in_thread(lambda _client: fn(*args, **kwargs), name, resolve=False)

    async def _call(self, op: Callable[[Any], T], name: str = "") -> T:
        """op(client) in a worker thread, on the client current there; `name` is the
        etcd3 method's (the NOSPACE alarm clears with the first write that works)."""
        return await self._in_thread(op, name, resolve=True)

    async def _in_thread(self, op: Callable[[Any], T], name: str, *, resolve: bool) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, functools.partial(self._run, op, name, resolve)
        )

    async def connect(self, *, attempts: int | None = None, max_delay: float = 10.0) -> None:
        """Wait until etcd answers, retrying with capped exponential backoff and jitter.

        EtcdAuthError (wrong username or password) is not retried.
        """
        delay = 0.2
        attempt = 0
        while True:
            attempt += 1
            try:
                await self.call(self._ensure_client)
                await self._call(lambda c: c.status())
                if attempt > 1:
                    log.info("Connected to etcd at %s after %d attempts", self.endpoint, attempt)
                return
            except TRANSIENT_ERRORS as exc:
                why = describe(exc)
                if attempts is not None and attempt >= attempts:
                    raise EtcdUnavailable(
                        f"etcd at {self.endpoint} unreachable after {attempt} attempts: {why}"
                    ) from exc
                log.warning(
                    "etcd at %s unreachable (%s); retrying in %.1f s", self.endpoint, why, delay
                )
                await self.call(self.rotate)
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, max_delay)

    async def get_prefix(self, prefix: str) -> tuple[int, dict[str, KV]]:
        """All keys under prefix and the store revision they were read at."""
        return await self.get_range(prefix, prefix_end(prefix))

    async def get_range(
        self, start: str, end: str, *, min_mod_revision: int | None = None
    ) -> tuple[int, dict[str, KV]]:
        """All keys in [start, end) (modified at min_mod_revision or later, when given) and
        the store revision they were read at."""
        response = await self._call(
            lambda c: c.get_range_response(start, end, min_mod_revision=min_mod_revision)
        )
        kvs = {
            key_text(kv.key): KV(
                key_text(kv.key), kv.value, kv.create_revision, kv.mod_revision, kv.lease
            )
            for kv in response.kvs
        }
        return int(response.header.revision), kvs

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        await self._call(lambda c: c.put(key, value, lease=lease), "put")

    async def delete(self, key: str) -> bool:
        return bool(await self._call(lambda c: c.delete(key)))

    async def delete_prefix(self, prefix: str) -> None:
        await self._call(lambda c: c.delete_prefix(prefix))

    async def _transaction(
        self, *, compare: list[Any], success: list[Any], failure: list[Any]
    ) -> tuple[bool, list[Any]]:
        ok, responses = await self._call(
            lambda c: c.transaction(compare=compare, success=success, failure=failure),
            "transaction",
        )
        return bool(ok), list(responses)

    async def create_returning_revision(
        self, key: str, value: bytes, lease: int | None
    ) -> int | None:
        """Create key only if absent; its create_revision if we created it, else None.

        One round trip: the put and a read of the new key in the same transaction.
        """
        tx = _TX
        ok, responses = await self._transaction(
            compare=[tx.create(key) == 0],
            success=[tx.put(key, value, lease=lease), tx.get(key)],
            failure=[],
        )
        return _created_revision(responses) if ok else None

    async def create_all_returning_revision(
        self, keys: list[str], value: bytes, lease: int | None
    ) -> int | None:
        """Create every key only if none of them exists, in one transaction; their
        create_revision (one for all), or None when any existed (nothing created).

        etcd refuses a transaction of more than --max-txn-ops (128 by default) compares
        or operations: callers pass at most CLAIM_BATCH keys.
        """
        tx = _TX
        ok, responses = await self._transaction(
            compare=[tx.create(key) == 0 for key in keys],
            success=[*(tx.put(key, value, lease=lease) for key in keys), tx.get(keys[0])],
            failure=[],
        )
        return _created_revision(responses) if ok else None

    async def put_returning_revision(self, key: str, value: bytes, lease: int | None) -> int:
        """Put key (created or overwritten); its create_revision, in one round trip."""
        tx = _TX
        _, responses = await self._transaction(
            compare=[],
            success=[tx.put(key, value, lease=lease), tx.get(key)],
            failure=[],
        )
        revision = _created_revision(responses)
        if revision is None:
            raise etcd3.exceptions.InternalServerError()  # the get in the same txn found nothing
        return revision

    async def put_all_if_created_at(
        self, guard: str, create_revision: int, items: dict[str, bytes], lease: int | None
    ) -> bool:
        """Put every item, in one transaction, only if `guard` is still the incarnation
        created at create_revision: False (nothing written) when it is gone or was created
        again since, for updates that must never bring a deleted key back."""
        tx = _TX
        ok, _ = await self._transaction(
            compare=[tx.create(guard) == create_revision],
            success=[tx.put(key, value, lease=lease) for key, value in items.items()],
            failure=[],
        )
        return bool(ok)

    async def delete_if_created_at(self, key: str, create_revision: int) -> bool:
        """Delete key only if it is still the incarnation created at create_revision."""
        tx = _TX
        ok, _ = await self._transaction(
            compare=[tx.create(key) == create_revision],
            success=[tx.delete(key)],
            failure=[],
        )
        return bool(ok)

    async def delete_if_unchanged(self, key: str, mod_revision: int) -> bool:
        """Delete key only if nobody wrote it since mod_revision (a put that gave it a
        lease, say): for removing a value seen in a view without racing its writer."""
        tx = _TX
        ok, _ = await self._transaction(
            compare=[tx.mod(key) == mod_revision],
            success=[tx.delete(key)],
            failure=[],
        )
        return bool(ok)

    async def release_claim(
        self, claim: str, create_revision: int, record: str, value: bytes | None
    ) -> bool:
        """Delete claim if it is still the incarnation created at create_revision, and in
        the same transaction put `record` (or delete it, for None): whoever sees the
        claim gone sees the record too."""
        # (Through _transaction, as every other write: reading self.client here, on the
        # event loop, built a client that was missing (a failed fail-over) right there,
        # blocking the loop for an Authenticate call per release.)
        tx = _TX
        ok, _ = await self._transaction(
            compare=[tx.create(claim) == create_revision],
            success=[tx.delete(claim), tx.put(record, value) if value else tx.delete(record)],
            failure=[],
        )
        return ok

    async def guarded_put_many(
        self, guard_key: str, guard_create_revision: int, items: dict[str, bytes]
    ) -> bool:
        """Put all items in one transaction that holds only if guard_key has that incarnation.

        etcd allows 128 operations per transaction by default; larger writes go in chunks,
        each guarded on its own, so a deposed writer stops at the first failed chunk.
        """
        tx = _TX
        keys = sorted(items)
        for start in range(0, len(keys), 128):
            chunk = keys[start : start + 128]
            ok, _ = await self._transaction(
                compare=[tx.create(guard_key) == guard_create_revision],
                success=[tx.put(k, items[k]) for k in chunk],
                failure=[],
            )
            if not ok:
                return False
        return True

    async def grant_lease(self, ttl: int) -> int:
        lease = await self._call(lambda c: c.lease(ttl), "lease")
        return int(lease.id)

    async def refresh_lease(self, lease_id: int) -> int:
        """Send one keep-alive; return the remaining TTL (0 or less: the lease is gone)."""
        responses = await self._call(lambda c: list(c.refresh_lease(lease_id)))
        if not responses:
            return 0
        return int(responses[-1].TTL)

    async def revoke_lease(self, lease_id: int) -> None:
        await self._call(lambda c: c.revoke_lease(lease_id))

    async def watch_prefix(
        self, prefix: str, start_revision: int, callback: Callable[[Any], None]
    ) -> Watch:
        """Watch prefix from start_revision on the current client; the callback runs on
        the watcher's thread, with each response or the error that ended the watch."""
        return await self.watch_range(prefix, prefix_end(prefix), start_revision, callback)

    async def watch_range(
        self, start: str, end: str, start_revision: int, callback: Callable[[Any], None]
    ) -> Watch:
        """watch_prefix for the keys in [start, end)."""

        def add(client: Any) -> Watch:
            watch_id = client.add_watch_callback(
                start, callback, range_end=end, start_revision=start_revision
            )
            return Watch(client, int(watch_id))

        return await self._call(add)

    async def cancel_watch(self, watch: Watch) -> None:
        """Cancel it on the client that made it (calls may have moved on since)."""

        def cancel(_client: Any) -> None:
            try:
                watch.client.cancel_watch(watch.watch_id)
            except Exception:  # cancelling a watch on a dead connection is not an error
                log.debug("Cancelling watch %s failed", watch.watch_id, exc_info=True)

        await self._in_thread(cancel, "", resolve=False)

    def close(self) -> None:
        for client in [*self._retired, self._client]:
            if client is None:
                continue
            try:
                _close_client(client)
            except Exception:
                log.debug("Closing the etcd client failed", exc_info=True)
        self._retired.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
