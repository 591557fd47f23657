"""The JetStream objects of a group: the partition stream, its durables, DLQ and ledger.

Idempotent: creating what exists with the same config is a no-op, so every member (and
later the operator) may call `ensure_group` at start.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import nats
from nats.errors import NoRespondersError
from nats.js import api
from nats.js.errors import APIError, BadRequestError, NotFoundError

from shoal.consumer.backoff import QuietLog
from shoal.consumer.config import GroupConfig
from shoal.consumer.natsauth import (
    NatsRefusal,
    NatsRefused,
    NatsSecurity,
    diagnose_tls,
    maybe_tls_refusal,
    refusal,
)
from shoal.consumer.natsclient import DirectClient
from shoal.contracts.names import (
    assignments_subject,
    dlq_subjects,
    durable_name,
    ledger_subjects,
    partition_subject,
    stream_subjects,
)

log = logging.getLogger(__name__)

_RETENTION = {
    "workqueue": api.RetentionPolicy.WORK_QUEUE,
    "limits": api.RetentionPolicy.LIMITS,
    "interest": api.RetentionPolicy.INTEREST,
}
_STORAGE = {"file": api.StorageType.FILE, "memory": api.StorageType.MEMORY}


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
            probe = await nats.connect(
                url,
                **auth,
                name=name,
                connect_timeout=2,
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=0.1,
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
                log.info("Connected to NATS at %s after %d attempts", url, attempt)
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
                refused.failed(logging.ERROR, "%s (NATS at %s); retrying", why, url)
            else:
                if attempts is not None and attempt >= attempts:
                    raise ConnectionError(
                        f"NATS at {url} unreachable after {attempt} attempts: {exc!r}"
                    ) from exc
                log.warning("NATS at %s unreachable (%r); retrying in %.1f s", url, exc, delay)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 10.0)


async def _quiet(exc: Exception) -> None:
    pass


# Nobody subscribes here: the server itself answers "no responders" at once.
HEALTH_SUBJECT = "_SHOAL.HEALTH"


class NatsHealth:
    """Whether this member can reach JetStream, from a round trip every `interval`.

    nats-py alone cannot tell: on a silent network (a partition, a blackhole) it keeps
    the connection "connected" until ping_interval x max_outstanding_pings (4 minutes by
    default), buffering publishes and letting every request time out. A member that can
    reach etcd but not NATS must give its partitions up (DESIGN "Faults"), so it has to
    know within seconds: `reachable()` turns false once round trips have been failing for
    `grace` seconds.
    """

    def __init__(self, nc: Any, *, interval: float = 1.0, grace: float = 3.0) -> None:
        self.nc = nc
        self.interval = interval
        self.grace = grace
        # When the round trips started failing (None: the last one succeeded). Counted
        # from failures, not from the last success, so that a process that merely got
        # no CPU for a while (its probes did not run) is not taken for one cut off.
        self._failing_since: float | None = None

    def reachable(self) -> bool:
        since = self._failing_since
        return since is None or time.monotonic() - since < self.grace

    async def run(self) -> None:
        was = True
        while True:
            started = time.monotonic()
            try:
                # A request nobody answers but the server ("no responders"), not
                # nc.flush(): a late answer to a timed-out request is just dropped.
                # (nats-py 2.x crashes its read loop on a PONG for a flush that timed
                # out, leaving a connection that writes but never reads again.) Not a
                # JetStream API request: in a cluster, JetStream stops answering while
                # its meta leader is re-elected, and every member would give all its
                # partitions up for nothing. A JetStream that does not serve a partition
                # shows in that partition's pulls instead.
                try:
                    await self.nc.request(HEALTH_SUBJECT, b"", timeout=self.interval)
                except NoRespondersError:
                    pass  # the server answered: reachable
                self._failing_since = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # nats-py raises several unrelated types here
                log.debug("NATS round trip failed: %r", exc)
                if self._failing_since is None:
                    self._failing_since = started
            now = self.reachable()
            if now != was:
                was = now
                if now:
                    log.info("NATS reachable again")
                else:
                    log.warning(
                        "NATS unreachable for %.0f s: giving this member's partitions up",
                        self.grace,
                    )
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))


def consumer_config(config: GroupConfig, partition: int) -> api.ConsumerConfig:
    return api.ConsumerConfig(
        durable_name=durable_name(partition),
        filter_subject=partition_subject(config.subject_prefix, partition),
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=config.ack_wait,
        max_ack_pending=config.max_ack_pending,
        # Unlimited: the members count attempts themselves (partition.py, credits), because
        # JetStream counts every delivery, and each hand-over gives unstarted messages
        # back with a nak, a delivery that was no attempt. With JetStream's limit at
        # max_deliver, a message moved k times had max_deliver - k attempts left, and
        # one moved often enough was stranded by moves alone.
        max_deliver=-1,
        # No backoff on the durable: with one, JetStream uses its first step as the
        # ack_wait of every first delivery. The backoff is the member's: it spaces the
        # in-place retries (and, with NakAndContinue, the delays of its naks); JetStream
        # redelivers only what a member failed to settle, after ack_wait.
        backoff=None,
        max_waiting=64,
        num_replicas=config.stream_replicas,
        # A work-queue stream deletes each message once it is acked, so the stream itself
        # records what is done: the durable's state can live in memory. On disk,
        # nats-server rewrites it (a new file, renamed over the old) up to 10 times a
        # second per busy durable; with 128 partitions that was about half the server's
        # CPU, and on a host where creating files is slow its acks came later than
        # ack_wait (docs/data-path.md). After a restart of a lone server such a durable
        # is gone; the members recreate it, and it delivers what the stream still holds.
        mem_storage=True if config.retention == "workqueue" else None,
    )


class StreamConfigConflict(RuntimeError):
    """A stream exists with a configuration JetStream cannot change in place."""


async def _ensure_stream(js: Any, name: str, subjects: list[str], **kwargs: Any) -> None:
    try:
        await js.add_stream(name=name, subjects=subjects, **kwargs)
    except BadRequestError:
        # It exists with another configuration: apply ours in place where JetStream can.
        try:
            await js.update_stream(name=name, subjects=subjects, **kwargs)
            log.info("Updated stream %s to the declared configuration", name)
        except APIError as exc:  # JetStream refuses some changes as 400, others as 500
            raise StreamConfigConflict(
                f"stream {name} exists with a configuration JetStream cannot change in "
                f"place: {exc.description}"
            ) from exc


async def ensure_group(js: Any, config: GroupConfig) -> None:
    """Create the partition stream, one durable per partition, the DLQ and log streams,
    and the ledger stream when the config asks for it."""
    await _ensure_stream(
        js,
        config.stream,
        stream_subjects(config.subject_prefix),
        retention=_RETENTION[config.retention],
        storage=_STORAGE[config.storage],
        num_replicas=config.stream_replicas,
        duplicate_window=120.0,
    )
    await _ensure_stream(
        js,
        config.dlq_stream,
        dlq_subjects(config.subject_prefix),
        storage=_STORAGE[config.storage],
        num_replicas=config.stream_replicas,
    )
    await _ensure_stream(
        js,
        config.log_stream,
        [assignments_subject(config.subject_prefix)],
        storage=_STORAGE[config.storage],
        num_replicas=config.stream_replicas,
    )
    if config.ledger:
        await _ensure_stream(
            js,
            config.ledger_stream,
            ledger_subjects(config.subject_prefix),
            storage=_STORAGE[config.storage],
            num_replicas=config.stream_replicas,
        )
    try:
        existing = {info.name: info.config for info in await js.consumers_info(config.stream)}
    except NotFoundError:
        existing = {}
    missing = [p for p in range(config.partitions) if durable_name(p) not in existing]
    # Durables whose settings changed (ack_wait, max_deliver, backoff, max_ack_pending,
    # e.g. the ConsumerGroup spec was edited and the pods rolled): creating a durable
    # with a new config updates it in place. Without this they kept the settings they
    # were created with, while the members worked with the new ones (in-progress acks
    # paced for a longer ack_wait than the server's: redeliveries, duplicates).
    outdated = [
        p
        for p in range(config.partitions)
        if durable_name(p) in existing
        and _settings_differ(existing[durable_name(p)], consumer_config(config, p))
    ]
    sem = asyncio.Semaphore(16)

    async def add(p: int) -> None:
        async with sem:
            await js.add_consumer(config.stream, config=consumer_config(config, p))

    await asyncio.gather(*(add(p) for p in missing + outdated))
    if missing:
        log.info("Created %d durable consumers on stream %s", len(missing), config.stream)
    if outdated:
        log.info("Updated %d durable consumers to the configured settings", len(outdated))


def _settings_differ(current: api.ConsumerConfig, wanted: api.ConsumerConfig) -> bool:
    """Whether an existing durable lacks settings a member would apply to it.

    A durable that still has a backoff (from an older Shoal) is outdated: the backoff
    replaced its ack_wait.
    """
    if list(current.backoff or []) != list(wanted.backoff or []):
        return True
    if current.ack_wait != wanted.ack_wait:
        return True
    return bool(
        current.max_deliver != wanted.max_deliver
        or current.max_ack_pending != wanted.max_ack_pending
    )


async def partition_lag(js: Any, config: GroupConfig, partition: int) -> int:
    """num_pending + num_ack_pending of the partition's durable."""
    info = await js.consumer_info(config.stream, durable_name(partition), timeout=2)
    return int(info.num_pending or 0) + int(info.num_ack_pending or 0)
