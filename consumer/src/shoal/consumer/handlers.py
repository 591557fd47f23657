"""Message handlers: user code named `module:function`, plus the built-in ones.

A handler is `async def handle(msg: Message) -> None`. Returning acks the message;
raising retries it after a backoff, before any later message of its project (at most
max_deliver attempts, then it goes to the dead-letter subject); raising `RetryAfter(s)`
does the same, waiting at least `s` seconds (at most MAX_RETRY_AFTER); raising
`PermanentError` dead-letters it at once.

A handler may also be a URL, `http(s)://host[:port][/path]`: `load_handler` then returns
an `HttpHandler` (shoal.consumer.httphandler), which POSTs each message there and turns
the answer into the same outcomes. A member runs up to maxConcurrency messages of different
projects at once, so a handler must not assume it runs alone. Delivery is at-least-once,
so handlers should be idempotent (key side effects on `msg.message_id`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from shoal.contracts.names import (
    MSG_ID_HEADER,
    ORIGINAL_MSG_ID_HEADER,
    SEQ_HEADER,
    ledger_subject,
)
from shoal.group.handlerref import HandlerError as HandlerError  # re-exported: the API
from shoal.group.handlerref import import_handler, is_url_handler


class PermanentError(Exception):
    """Raised by a handler for a message that can never succeed: dead-letter it now."""


# The longest a RetryAfter holds its message (and its project's later ones): a service
# asking for an hour (Retry-After: 3600) is still retried after 5 minutes.
MAX_RETRY_AFTER = 300.0


class RetryAfter(Exception):
    """Raised by a handler: a failed attempt like any other (retried in place, dead-
    lettered after maxDeliver), retried after `delay` seconds when that is longer than
    the backoff's delay (capped at MAX_RETRY_AFTER). The HTTP handler raises it for a
    Retry-After header."""

    def __init__(self, delay: float, message: str = "") -> None:
        super().__init__(message or f"retry after {delay:g} s")
        self.delay = min(max(0.0, delay), MAX_RETRY_AFTER)


class HandlerTimeout(Exception):
    """The handler ran longer than handlerTimeoutSeconds and was cancelled: a failed
    attempt (retried with the backoff, dead-lettered after maxDeliver)."""


class HandlerUnreachable(Exception):
    """Raised by the HTTP handler: the message never reached its service, which refused
    the connection, has no such name, refused TLS, or whose Unix socket is missing
    (nothing of the request was sent). **Not an attempt**: the message waits in place
    (its project's later ones behind it), nothing more is sent until the handler's probe
    finds the service back, and it is never dead-lettered for it. A service that is down
    (a sidecar restarting, crash-looping) must not cost its messages their attempts:
    every active project's head would be dead-lettered within seconds. The member says
    so meanwhile (reach.py): logs, `shoal_handler_reachable`, its readiness, etcd, and
    the leader moves its partitions to members whose handler answers. (From a Python
    handler, which has no probe, it is a failed attempt like any error.)"""


class Fenced(RuntimeError):
    """This member may no longer own the partition (its lease may have expired)."""


@dataclass
class HandlerContext:
    """What a handler may use besides the message: the member and the JetStream context."""

    member_id: str
    subject_prefix: str
    js: Any  # nats.js.JetStreamContext
    # True while this member's lease is certainly alive (see membership.Membership.safe).
    safe: Callable[[], bool] = lambda: True


def message_id_of(headers: Mapping[str, str] | None, stream_sequence: int) -> str:
    """A message's id: the one it was published with (Nats-Msg-Id), or, on a message
    redriven from the dead letters (`shoal-consumer dlq redrive`), the original's
    (Shoal-Original-Msg-Id: its own Nats-Msg-Id is the redrive's), so that side effects
    keyed on it stay keyed alike; its stream sequence if it has neither."""
    headers = headers or {}
    value = headers.get(ORIGINAL_MSG_ID_HEADER) or headers.get(MSG_ID_HEADER)
    return str(value) if value else f"seq-{stream_sequence}"


class Message:
    """One message, as a handler gets it.

    The member builds one per message, so its headers and subject are read from the
    delivery only when the handler asks for them (see `DeliveredMessage`): for a noop
    handler, building a dataclass with both was 5 % of a member's CPU.
    """

    __slots__ = (
        "_headers",
        "_source",
        "_subject",
        "context",
        "data",
        "delivery_count",
        "partition",
        "project_id",
        "stream_sequence",
    )

    def __init__(
        self,
        project_id: str,
        partition: int,
        data: bytes,
        headers: Mapping[str, str],
        stream_sequence: int,
        delivery_count: int,
        subject: str,
        context: HandlerContext,
    ) -> None:
        self.project_id = project_id
        self.partition = partition
        self.data = data
        self._headers: Mapping[str, str] | None = headers
        self.stream_sequence = stream_sequence
        self.delivery_count = delivery_count
        self._subject: str | None = subject
        self.context = context
        self._source: _Delivered | None = None

    @property
    def headers(self) -> Mapping[str, str]:
        headers = self._headers
        if headers is None:
            assert self._source is not None
            headers = self._headers = self._source.headers
        return headers

    @property
    def subject(self) -> str:
        subject = self._subject
        if subject is None:
            assert self._source is not None
            subject = self._subject = self._source.subject
        return subject

    def _fields(self) -> tuple[Any, ...]:
        return (
            self.project_id,
            self.partition,
            self.data,
            dict(self.headers),
            self.stream_sequence,
            self.delivery_count,
            self.subject,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __repr__(self) -> str:
        return (
            f"Message(project_id={self.project_id!r}, partition={self.partition!r}, "
            f"data={self.data!r}, headers={dict(self.headers)!r}, "
            f"stream_sequence={self.stream_sequence!r}, "
            f"delivery_count={self.delivery_count!r}, subject={self.subject!r})"
        )

    @property
    def message_id(self) -> str:
        return message_id_of(self.headers, self.stream_sequence)

    def ensure_owned(self) -> None:
        """Raise Fenced if this member may have lost the partition.

        A handler with side effects outside JetStream calls this right before committing
        them: a process frozen mid-handler (SIGSTOP, a long pause) wakes up after its lease
        expired and another member took the partition over; without this check the stale
        handler would commit alongside the new owner.
        """
        if not self.context.safe():
            raise Fenced(f"member {self.context.member_id} is fenced; not committing")


class _Delivered(Protocol):
    """What a DeliveredMessage reads lazily (natsclient.Delivery, or nats-py's Msg)."""

    data: bytes

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def subject(self) -> str: ...


class DeliveredMessage(Message):
    """A Message built by the member from what JetStream delivered: the same fields,
    with headers and subject read from `source` on first use."""

    __slots__ = ()

    def __init__(
        self,
        project_id: str,
        partition: int,
        source: _Delivered,
        stream_sequence: int,
        delivery_count: int,
        context: HandlerContext,
    ) -> None:
        self.project_id = project_id
        self.partition = partition
        self.data = source.data
        self._headers = None
        self.stream_sequence = stream_sequence
        self.delivery_count = delivery_count
        self._subject = None
        self.context = context
        self._source = source


Handler = Callable[[Message], Awaitable[None]]


def load_handler(
    spec: str,
    *,
    timeout: float = 0.0,
    connections: int = 100,
    ledger: bool = False,
    socket: str | None = None,
) -> Handler:
    """Import `module:function` (shoal.group.handlerref: the operator checks specs with the
    same code); every failure is one HandlerError line saying what is wrong.

    For a URL, the member's HTTP handler (shoal.consumer.httphandler): `timeout` is how
    long a request may take (handlerTimeoutSeconds; 0: no limit), `connections` the most
    it keeps open (at least maxConcurrency, so no message waits for one), `ledger` (the
    group's ledger is on): record each message the service answered 2xx in the ledger
    (`record_in_ledger`), which a service of its own cannot write, `socket` a Unix socket
    to connect to instead of the URL's host and port (spec.handlerSocket). A Python
    handler is returned as it is (`:ledger` records for itself); it has no use for a
    socket (the configuration refuses one)."""
    if is_url_handler(spec):
        # Here, not at the top: the module imports this one (Message, the errors).
        from shoal.consumer.httphandler import HttpHandler

        return HttpHandler(
            spec, timeout=timeout, connections=connections, ledger=ledger, socket=socket
        )
    handler: Handler = import_handler(spec)
    return handler


@dataclass(frozen=True)
class SimulatedWork:
    """What the built-in handlers pretend to do per message: `cpu_ms` of computing
    (CPU-bound work: it holds the event loop, as real CPU-bound handlers do), then
    `delay_ms` of waiting (I/O-bound work)."""

    cpu_ms: float = 0.0
    delay_ms: float = 0.0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SimulatedWork:
        """SHOAL_HANDLER_CPU_MS and SHOAL_HANDLER_DELAY_MS (unset or empty: none)."""
        return cls(
            cpu_ms=float(env.get("SHOAL_HANDLER_CPU_MS", "0") or 0),
            delay_ms=float(env.get("SHOAL_HANDLER_DELAY_MS", "0") or 0),
        )

    async def run(self) -> None:
        if self.cpu_ms > 0:
            spent = time.process_time()
            while time.process_time() - spent < self.cpu_ms / 1000:
                pass
        if self.delay_ms > 0:
            await asyncio.sleep(self.delay_ms / 1000)


@functools.cache
def simulated_work() -> SimulatedWork:
    """The process's simulated work, read from its environment once, at the first message:
    the variables are set when a member starts, and a handler should not pay for a test
    knob on every message."""
    return SimulatedWork.from_env(os.environ)


async def _simulated_work() -> None:
    await simulated_work().run()


async def noop(msg: Message) -> None:
    """Accept everything (plus simulated work: SHOAL_HANDLER_DELAY_MS, SHOAL_HANDLER_CPU_MS)."""
    work = simulated_work()
    if work.cpu_ms or work.delay_ms:  # no coroutine to build and await when there is none
        await work.run()


async def ledger(msg: Message) -> None:
    """Record that this member processed this message, to `<prefix>.ledger.<p>`
    (`record_in_ledger`), after the simulated work (SHOAL_HANDLER_DELAY_MS, ..._CPU_MS)."""
    started = time.time()
    await _simulated_work()
    await record_in_ledger(msg, started)


def ledger_record(msg: Message, started: float) -> bytes:
    """The ledger's record of `msg`, processed by this member from `started` to now."""
    record = {
        "project_id": msg.project_id,
        "message_id": msg.message_id,
        "seq": int(msg.headers[SEQ_HEADER]) if msg.headers.get(SEQ_HEADER, "").isdigit() else None,
        "partition": msg.partition,
        "member": msg.context.member_id,
        "delivery_count": msg.delivery_count,
        "stream_sequence": msg.stream_sequence,
        "started": started,
        "finished": time.time(),
    }
    return json.dumps(record, separators=(",", ":")).encode()


async def record_in_ledger(msg: Message, started: float) -> None:
    """Record that this member processed `msg` (from `started`, a time.time()), to
    `<prefix>.ledger.<p>`: the built-in `ledger` handler does it for itself, and the member
    for an HTTP handler whose group has the ledger on, once the service answered 2xx.

    The record is published (and acknowledged by JetStream) before the message is acked,
    so every acked message has at least one ledger entry: the ledger proves no loss, and
    counts duplicates and order. It deliberately carries no Nats-Msg-Id, so JetStream's
    de-duplication cannot hide a duplicate. A member that may have lost the partition
    (fenced) records nothing (Fenced), as it acks nothing.
    """
    record = ledger_record(msg, started)
    msg.ensure_owned()
    await msg.context.js.publish(ledger_subject(msg.context.subject_prefix, msg.partition), record)


async def fail(msg: Message) -> None:
    """Always fails (transiently): for exercising redelivery and dead-lettering."""
    raise RuntimeError(f"simulated failure for {msg.message_id}")


async def reject(msg: Message) -> None:
    """Always fails permanently: the message goes straight to the dead-letter subject."""
    raise PermanentError(f"rejected {msg.message_id}")
