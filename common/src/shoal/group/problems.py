"""A member's NATS refusal, or its wait for its handler, published in etcd while it lasts
(Keys.problem).

A member connects to NATS before it joins its group, so a member NATS refuses (a wrong
password, an unknown CA, an expired client certificate) has no member key: without this,
`shoal-consumer status` would not list it and the operator would only see fewer ready
replicas. While refused it writes problems/<member> = {"reason", "message", "since"}
on a lease of its own (the group's lease TTL, kept alive while the refusal lasts), and
revokes that lease once NATS accepts it or it exits; a crash lets the lease expire.

The same key says why a member with an HTTP handler and `spec.handlerReadyPath` has not
joined yet (reason HANDLER_NOT_READY, the ready probe's last answer as the message): it
joins only once its service answers, and without this the group would only show fewer
ready replicas, the reason in the pod's log. A joined member whose HTTP handler stops
accepting connections says the same there while it lasts (consumer reach.py; its
messages wait).

Best effort throughout: etcd errors are logged (once per 10 s) and retried, never raised,
so reporting a problem can never stop a member from starting.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from shoal.clients.backoff import QuietLog
from shoal.clients.etcd import Etcd, describe
from shoal.contracts.values import known_time, shown_time

log = logging.getLogger(__name__)

#: problems/<member>'s reason while the member waits for its handler to answer its ready
#: path before it joins (not a NATS refusal: shown apart from those).
HANDLER_NOT_READY = "HandlerNotReady"


class Reported(Protocol):
    """What a RefusalReporter reports: a reason and a message (a NatsRefusal, say)."""

    @property
    def reason(self) -> str: ...

    @property
    def message(self) -> str: ...


@dataclass(frozen=True)
class HandlerNotReady:
    """The member waits for its handler (message: the ready probe's last answer)."""

    message: str
    reason: str = HANDLER_NOT_READY


@dataclass(frozen=True)
class MemberProblem:
    """problems/<member>: why NATS refuses the member, since when (Unix time)."""

    reason: str  # NatsAuthFailed | NatsTLSFailed | HandlerNotReady
    message: str
    since: float

    @property
    def waits_for_handler(self) -> bool:
        return self.reason == HANDLER_NOT_READY

    def to_bytes(self) -> bytes:
        return json.dumps(
            {"reason": self.reason, "message": self.message, "since": round(self.since, 3)}
        ).encode()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MemberProblem | None:
        """None unless `data` has a non-empty string reason and message and a numeric
        since (a member of another version or a hand-edited key is not trusted). A since
        that is no time that can be shown (NaN, inf, 1e300, negative) reads as 0.0, an
        unknown time: the refusal itself still counts."""
        reason, message, since = data.get("reason"), data.get("message"), data.get("since")
        if not isinstance(reason, str) or not reason or not isinstance(message, str):
            return None
        if not isinstance(since, int | float) or isinstance(since, bool):
            return None
        try:
            when = known_time(float(since))
        except OverflowError:  # an int beyond any float
            when = 0.0
        return cls(reason, message, when)

    def describe_since(self) -> str:
        """Since when, for people: the time, or "an unknown time"."""
        return shown_time(self.since)


class RefusalReporter:
    """Keeps problems/<member> in step with the member's NATS refusal.

    `report` is called from nats connect's on_refusal callback (sync, once per attempt):
    it only records what is wanted; one task writes when that changes, so a refusal
    repeated at every retry is written once and then only kept alive.
    """

    def __init__(
        self, etcd: Etcd, key: str, ttl: int, keepalive: float, *, clock: Any = time.time
    ) -> None:
        self.etcd = etcd
        self.key = key
        self.ttl = ttl
        self.keepalive = keepalive
        self._clock = clock
        self._wanted: MemberProblem | None = None
        self._written: MemberProblem | None = None
        self._lease = 0
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._trouble = QuietLog(log)

    def report(self, why: Reported | None) -> None:
        """The refusal now (None: NATS accepts us). Cheap; never raises."""
        if why is None:
            wanted = None
        elif self._wanted is not None and (self._wanted.reason, self._wanted.message) == (
            why.reason,
            why.message,
        ):
            return  # the same refusal again (every retry): nothing to write
        else:
            # One episode keeps its start when the reason changes (TLS fixed, then auth).
            since = self._wanted.since if self._wanted is not None else self._clock()
            wanted = MemberProblem(why.reason, why.message, since)
        if wanted == self._wanted:
            return
        self._wanted = wanted
        self._changed.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="nats-refusal-report")

    async def _run(self) -> None:
        while True:
            self._changed.clear()
            try:
                await self._step()
                if self._trouble.failing:
                    log.info("NATS refusal reported in etcd again (%s)", self.key)
                    self._trouble.recovered()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Start afresh on a new lease: the old one, if etcd still has it, expires
                # on its own, and the key moves to the new one when it is written.
                self._lease, self._written = 0, None
                self._trouble.failed(
                    logging.WARNING,
                    "Could not report the NATS refusal in etcd (%s); retrying",
                    describe(exc),
                )
            if self._wanted is None and self._lease == 0:
                self._task = None  # nothing to keep alive: the next report starts again
                return
            try:
                async with asyncio.timeout(self.keepalive):
                    await self._changed.wait()
            except TimeoutError:
                pass

    async def _step(self) -> None:
        wanted = self._wanted
        if wanted is None:
            await self._revoke()
            return
        if self._lease and wanted == self._written:
            if await self.etcd.refresh_lease(self._lease) > 0:
                return
            # Expired (etcd away longer than the TTL): write it again on a new lease.
            self._lease, self._written = 0, None
        if not self._lease:
            self._lease = await self.etcd.grant_lease(self.ttl)
        await self.etcd.put(self.key, wanted.to_bytes(), lease=self._lease)
        self._written = wanted
        # (Not the reason again: the refusal itself is already one line of its own.)
        what = "the wait for the handler" if wanted.waits_for_handler else "the NATS refusal"
        log.info("Reported %s in etcd under %s", what, self.key)

    async def _revoke(self) -> None:
        lease, written = self._lease, self._written
        self._lease, self._written = 0, None
        if lease:
            await self.etcd.revoke_lease(lease)  # the key goes with it
            if written is not None and written.waits_for_handler:
                log.info("The handler is ready: the wait for it is gone from etcd")
            else:
                log.info("NATS accepts this member: its refusal is gone from etcd")

    async def close(self, timeout: float = 2.0) -> None:
        """Stop reporting and remove the key (the member exits). Bounded, best effort:
        if etcd does not answer, the lease expires within its TTL."""
        self._wanted = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        try:
            async with asyncio.timeout(timeout):
                await self._revoke()
        except Exception as exc:
            log.debug("Could not revoke the NATS refusal's lease: %s", describe(exc))
