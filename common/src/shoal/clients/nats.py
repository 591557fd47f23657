"""The NATS connection every Shoal process makes: retried with backoff, each refusal one
log line naming its reason (natsauth.py), and a reachability check (`NatsHealth`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from nats.errors import NoRespondersError

from shoal.clients.backoff import QuietLog
from shoal.clients.natsauth import (
    NatsRefusal,
    NatsRefused,
    NatsSecurity,
    diagnose_tls,
    maybe_tls_refusal,
    redacted,
    refusal,
)
from shoal.clients.natsclient import DirectClient, TLSClient, reraise_dropped_cancel

log = logging.getLogger(__name__)


class _Callbacks:
    """One-line logs for a connection's events instead of nats-py's tracebacks."""

    def __init__(
        self, on_refusal: Callable[[NatsRefusal | None], None] | None, closed: asyncio.Event
    ) -> None:
        self.nc: Any = None
        self.on_refusal = on_refusal
        self.closed_event = closed
        # nats-py tries to reconnect every reconnect_time_wait while NATS is away, and
        # reports each failure: one line per 10 s is enough.
        self._errors = QuietLog(log)

    def _closing(self) -> bool:
        return self.nc is not None and (self.nc.is_closed or self.nc.is_draining)

    async def error(self, exc: Exception) -> None:
        if self._closing():
            return
        why = refusal(exc)
        if why is not None:
            # E.g. the password was changed on the server while we were connected.
            if self.on_refusal is not None:
                self.on_refusal(why)
            self._errors.failed(logging.ERROR, "%s (reconnecting)", why)
        else:
            self._errors.failed(logging.WARNING, "NATS connection error: %r", exc)

    async def disconnected(self) -> None:
        if not self._closing():
            log.warning("Disconnected from NATS; reconnecting")

    async def closed(self) -> None:
        self.closed_event.set()

    async def reconnected(self) -> None:
        self._errors.recovered()
        if self.on_refusal is not None:
            self.on_refusal(None)
        log.info("Reconnected to NATS")


# (asyncio's warning at the end of each TLS connection is quieted by
# shoal.logs.quiet_known_noise, which the commands install: no import-time side effect.)


async def connect(
    url: str,
    *,
    name: str,
    attempts: int | None = None,
    security: NatsSecurity | None = None,
    reconnect_buffer: int | None = None,
    on_refusal: Callable[[NatsRefusal | None], None] | None = None,
) -> Any:
    """Connect to NATS, retrying with capped backoff and saying why each attempt failed.

    With reconnects enabled nats-py never fails a first connect (it retries on its own,
    every reconnect_time_wait, without backoff or a word to us), so each attempt is made
    with reconnects off; once one succeeds the returned connection reconnects forever.

    Settings that cannot work (a missing file, a certificate without its key) raise
    NatsConfigError before any attempt. A server that refuses us (credentials, TLS) is
    logged as one line naming the reason (NatsAuthFailed, NatsTLSFailed), repeated at
    most every 10 s, and reported to `on_refusal` (None once connected): a member keeps
    retrying, since someone may fix the server or the secret; a caller with `attempts`
    (CLI, operator) gets NatsRefused at once, since retrying cannot help it.
    """
    security = security or NatsSecurity()
    security.check()
    auth = security.connect_options()
    delay = 0.2
    attempt = 0
    refused = QuietLog(log)
    while True:
        attempt += 1
        try:
            # max_reconnect_attempts=1: nats-py only gives up on a server when it is > 0.
            probe = TLSClient()
            await probe.connect(
                url,
                **auth,
                name=name,
                connect_timeout=2,
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=0,  # (no reconnects: allow_reconnect is off)
                error_cb=_quiet,
            )
            await probe.close()
            # The member reads its pull replies through the direct path (natsclient).
            nc = DirectClient()
            # closed_event: set once nats-py closed it for good (runtime waits on it).
            callbacks = _Callbacks(on_refusal, nc.closed_event)
            options: dict[str, Any] = {
                **auth,
                "name": name,
                "connect_timeout": 2,
                "max_reconnect_attempts": -1,
                "reconnect_time_wait": 0.5,
                "allow_reconnect": True,
                # A leaving member drains its connection last; nats-py's default (30 s)
                # would outlast a pod's grace period if a subscription never empties.
                "drain_timeout": 5,
                "flush_timeout": NATS_FLUSH_TIMEOUT,
                **({"pending_size": reconnect_buffer} if reconnect_buffer else {}),
                "error_cb": callbacks.error,
                "disconnected_cb": callbacks.disconnected,
                "reconnected_cb": callbacks.reconnected,
                "closed_cb": callbacks.closed,
            }
            await nc.connect(url, **options)
            callbacks.nc = nc
            if on_refusal is not None:
                on_refusal(None)
            refused.recovered()
            if attempt > 1:
                log.info("Connected to NATS at %s after %d attempts", redacted(url), attempt)
            return nc
        except Exception as exc:  # nats-py raises several unrelated types here
            why = refusal(exc)
            if why is None and maybe_tls_refusal(exc, url, security):
                why = await diagnose_tls(url, security)
            if why is not None:
                if attempts is not None:
                    raise NatsRefused(why) from None
                if on_refusal is not None:
                    on_refusal(why)
                refused.failed(logging.ERROR, "%s (NATS at %s); retrying", why, redacted(url))
            else:
                if attempts is not None and attempt >= attempts:
                    raise ConnectionError(
                        f"NATS at {redacted(url)} unreachable after {attempt} attempts: {exc!r}"
                    ) from exc
                log.warning(
                    "NATS at %s unreachable (%r); retrying in %.1f s", redacted(url), exc, delay
                )
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 10.0)


async def _quiet(exc: Exception) -> None:
    pass


# How long a publish waits for a flush it forced (more pending than the buffer holds):
# nats-py's default is for good. Through a network that drops everything without a reset
# (the kernel's buffers full, the flusher waiting on the socket) a member's acks and
# pulls waited there: a runner could not stop, its claim stayed on a live lease and the
# member the leader moved its partition to could not take it, until nats-py's ping check
# gave up on the connection minutes later. The data stays pending (sent once the
# connection drains or, after a reconnect, on the new one); the publish returns.
NATS_FLUSH_TIMEOUT = 5.0

# Nobody subscribes here: the server itself answers "no responders" at once.
HEALTH_SUBJECT = "_SHOAL.HEALTH"


async def round_trip(nc: Any, timeout: float) -> None:
    """A round trip to the server, after everything written before it (what nc.flush()
    promises, without its defect): a request nobody answers but the server ("no
    responders"). A late answer to a request that timed out is just dropped, whereas
    nats-py 2.x crashes its read loop on a PONG for a flush that timed out, leaving a
    connection that writes but never reads again (until its ping check gives up on it,
    minutes later). Raises what the request raises (a timeout, say)."""
    try:
        await nc.request(HEALTH_SUBJECT, b"", timeout=timeout)
    except NoRespondersError:
        pass  # the server answered


def reader_ended(nc: Any) -> bool:
    """Whether nats-py's read loop has ended while the connection counts as connected.

    nats-py 2.x ends its read loop on any unexpected exception while parsing (it logs
    "nats: encountered error" and stops), without closing or reconnecting: the
    connection then writes but never reads again until its ping check gives up on it
    (ping_interval x max_outstanding_pings, 4 minutes by default). A reconnect starts a
    new read loop; nothing else does. (Reads nats-py's private `_reading_task`.)"""
    task = getattr(nc, "_reading_task", None)
    return bool(nc.is_connected and task is not None and task.done())


# How long round trips may fail on a connection nats-py counts as open before a new one
# is tried (NatsHealth._replace_stranded): its own ping check takes 4 minutes and more.
STRANDED_AFTER = 10.0


def abort_connection(nc: Any) -> bool:
    """Drop nats-py's socket at once, as a reset would (its read loop then reconnects);
    False if this client's transport has none we know how to drop. (Reads nats-py's
    private `_transport`: its TCP transport keeps the asyncio writers, the TLS one over
    the plain one.)"""
    transport = getattr(nc, "_transport", None)
    dropped = False
    for name in ("_io_writer", "_bare_io_writer"):
        socket_transport = getattr(getattr(transport, name, None), "transport", None)
        if socket_transport is not None and not socket_transport.is_closing():
            socket_transport.abort()
            dropped = True
    return dropped


# A round trip that fails this much later than its timeout says more about this process
# (it did not get to run) than about NATS: NatsHealth does not count it.
STALL_SLACK = 1.0


class NatsHealth:
    """Whether this member can reach JetStream, from a round trip every `interval`.

    nats-py alone cannot tell: on a silent network (a partition, a blackhole) it keeps
    the connection "connected" until ping_interval x max_outstanding_pings (4 minutes by
    default), buffering publishes and letting every request time out. A member that can
    reach etcd but not NATS must give its partitions up (DESIGN "Faults"), so it has to
    know within seconds: `reachable()` turns false once round trips have been failing for
    `grace` seconds.
    """

    def __init__(
        self,
        nc: Any,
        *,
        interval: float = 1.0,
        grace: float = 3.0,
        stranded_after: float = STRANDED_AFTER,
        unreachable_means: str = "giving this member's partitions up",
    ) -> None:
        self.nc = nc
        # What the log line for NATS turning unreachable adds (what its user does then).
        self.unreachable_means = unreachable_means
        self.interval = interval
        self.grace = grace
        # Round trips failing this long on a connection nats-py counts as open: a new
        # connection is tried (_replace_stranded), again each time as long after.
        self.stranded_after = stranded_after
        # When the stranded clock last started again: a forced reconnect, or the last
        # look that found the client (re)connecting (a new connection gets its full time).
        self._forced_at: float | None = None
        self.stranded_reconnects = 0
        self._refusal_logged = False
        # When the round trips started failing (None: the last one succeeded). Counted
        # from failures, not from the last success, so that a process that merely got
        # no CPU for a while (its probes did not run) is not taken for one cut off.
        self._failing_since: float | None = None
        # Consecutive checks that found nats-py's read loop ended (reader_ended).
        self._reader_ended = 0
        self.read_loop_restarts = 0

    def reachable(self) -> bool:
        since = self._failing_since
        return since is None or time.monotonic() - since < self.grace

    async def run(self) -> None:
        was = True
        while True:
            started = time.monotonic()
            error_before = getattr(self.nc, "last_error", None)
            try:
                # Not a JetStream API request: in a cluster, JetStream stops answering
                # while its meta leader is re-elected, and every member would give all
                # its partitions up for nothing. A JetStream that does not serve a
                # partition shows in that partition's pulls instead.
                await round_trip(self.nc, self.interval)
                self._failing_since = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # nats-py raises several unrelated types here
                log.debug("NATS round trip failed: %r", exc)
                ended = time.monotonic()
                if self._refused_health(error_before):
                    self._failing_since = None  # the server answered: with a refusal
                elif ended - started > self.interval + STALL_SLACK:
                    # It took far longer than its own timeout: this process did not run
                    # (its event loop blocked by a handler, a long GC pause), and the
                    # answer may be waiting unread. Proves nothing: ask again at once.
                    # (Counted from its start, one such stall longer than stranded_after
                    # aborted a healthy connection, and what was written to it.)
                    log.debug("NATS round trip took %.1f s: not counted", ended - started)
                    reraise_dropped_cancel()
                    continue
                elif self._failing_since is None:
                    # From when the failed request went out (its timeout before now).
                    self._failing_since = ended - self.interval
            reraise_dropped_cancel()
            await self._restart_ended_reader()
            await self._replace_stranded()
            now = self.reachable()
            if now != was:
                was = now
                if now:
                    log.info("NATS reachable again")
                else:
                    log.warning(
                        "NATS unreachable for %.0f s%s",
                        self.grace,
                        f": {self.unreachable_means}" if self.unreachable_means else "",
                    )
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def _replace_stranded(self) -> None:
        """Reconnect when round trips have failed for `stranded_after` seconds while
        nats-py counts the connection as open: a connection that died without a word (NATS
        behind a Service whose pod was replaced, an expired NAT entry) is kept by nats-py
        until its ping check gives up, 4 minutes and more, while a new connection to the
        same address would work at once. If NATS itself is down, the reconnect finds
        that out, and nats-py goes on trying as it would have."""
        now = time.monotonic()
        if not self.nc.is_connected:
            # (Re)connecting: the clock starts again once a connection is made, so that
            # a new one is not dropped for the failures of the old.
            self._forced_at = now
            return
        since = self._failing_since
        if since is None:
            self._forced_at = None
            return
        if now - max(since, self._forced_at or since) < self.stranded_after:
            return
        self._forced_at = now
        self.stranded_reconnects += 1
        log.warning(
            "NATS has not answered for %.0f s on a connection the client counts as open "
            "(a dead connection: a replaced pod behind a Service, an expired NAT entry): "
            "reconnecting",
            now - since,
        )
        # Dropped at once, as a reset connection is: nats-py's read loop finds it ended
        # and reconnects its own way. (A close would first wait for what is buffered to
        # drain, or for TLS's close_notify: on a silent connection, for minutes.) What
        # was written to it and not yet acknowledged is lost with it; nats-py buffers
        # what comes after for the new connection, and unacknowledged deliveries come
        # back after their ack wait.
        if not abort_connection(self.nc):
            await self.nc.force_reconnect()

    def _refused_health(self, error_before: object) -> bool:
        """Whether the round trip failed because the server refused this user the
        health subject (a -ERR since `error_before`): the server answers, so the
        connection lives. Said once: the check then proves less (grant the subject:
        `shoal-consumer permissions`)."""
        error = getattr(self.nc, "last_error", None)
        if error is None or error is error_before:
            return False
        # (nats-py lowercases the server's words: 'permissions violation for publish
        # to "_shoal.health"'.)
        text = str(error).lower()
        if "permissions violation" not in text or HEALTH_SUBJECT.lower() not in text:
            return False
        if not self._refusal_logged:
            self._refusal_logged = True
            log.warning(
                "NATS refuses this user publish on %s, the health check's subject: "
                "counted as an answer, but grant it (shoal-consumer permissions lists it)",
                HEALTH_SUBJECT,
            )
        return True

    async def _restart_ended_reader(self) -> None:
        """Reconnect when nats-py's read loop ended under a live connection (seen twice
        in a row: a reconnect sets the status and starts a new loop in one step, but
        one look proves little)."""
        if not reader_ended(self.nc):
            self._reader_ended = 0
            return
        self._reader_ended += 1
        if self._reader_ended < 2:
            return
        self._reader_ended = 0
        self.read_loop_restarts += 1
        # (nats-py logs the cause itself, "nats: encountered error", when it ends.)
        log.error(
            "The NATS client stopped reading (nats-py's read loop ended) while its "
            "connection stayed up: reconnecting"
        )
        # nats-py's own path for a broken connection: a new socket, a new read loop,
        # every subscription made again.
        await self.nc._process_op_err(ConnectionError("the read loop ended"))
