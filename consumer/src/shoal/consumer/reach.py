"""Whether the member's HTTP handler can be reached: its service accepts connections.

A POST that cannot even connect (refused, no such name, TLS refused, no Unix socket)
never reached the service: the message is tried again without counting an attempt
(handlers.HandlerUnreachable). Counting it, as every other failure, dead-lettered the
head message of every active project once the service had been away for maxDeliver
backoffs, about 10 s with the defaults: a sidecar restarting, or in CrashLoopBackOff,
sent good messages to the dead-letter stream by the hundred.

So that a wait which may last for good is never silent, this module keeps the
member's one episode of unreachability: it logs its start (with the reason), every
LOG_EVERY seconds while it lasts, and its end (how long), and tells `on_change` (the
runtime: `shoal_handler_reachable`, readiness, problems/<member> in etcd, and
`handler_ok` in the member's stats, by which the leader gives the member's partitions
to members whose handler answers). While it lasts the worker sends no message to the
handler; a probe (HttpHandler) asks every PROBE_EVERY seconds whether the service is
back (its ready path answers 2xx, or it accepts a connection), and only the probe ends
the episode: an answer on a pooled connection says nothing of new ones.

Pure bookkeeping: no I/O here but logging and the callback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["LOG_EVERY", "PROBE_EVERY", "Reach"]

log = logging.getLogger(__name__)

# While the handler stays unreachable, how often the member says so again.
LOG_EVERY = 30.0
# How often the member asks whether an unreachable handler is back.
PROBE_EVERY = 1.0


class Reach:
    """The member's handler reachability, as its requests and probes find it."""

    def __init__(
        self,
        on_change: Callable[[str | None], None] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Called with the reason when an episode starts or its reason changes, and with
        # None when it ends. Must not raise (it is called from the message path).
        self.on_change = on_change
        self._clock = clock
        self.since: float | None = None  # when the episode began; None: reachable
        self.why = ""
        self.waits = 0  # messages that could not be sent in this episode
        self._logged_at = 0.0

    @property
    def ok(self) -> bool:
        return self.since is None

    def refused(self, why: str, *, message: bool = True) -> bool:
        """A connection could not be made (`message`: count a message's wait here; the
        worker counts its own). Returns whether this began an episode."""
        now = self._clock()
        if message:
            self.waits += 1
        if self.since is None:
            self.since, self.why, self._logged_at = now, why, now
            log.warning(
                "Cannot reach the handler (%s): its messages wait, without counting as "
                "attempts, and are tried again until it accepts connections; the leader "
                "gives this member's partitions to members whose handler answers",
                why,
            )
            self._changed(why)
            return True
        if why != self.why:
            self.why = why
            self._changed(why)
        if now - self._logged_at >= LOG_EVERY:
            self._logged_at = now
            log.warning(
                "Still cannot reach the handler, for %.0f s (%s); %d message tries waited",
                now - self.since,
                why,
                self.waits,
            )
        return False

    def reached(self) -> None:
        """The probe found the service back (its ready path answered 2xx, or it accepted
        a new connection): the episode, if any, is over."""
        since = self.since
        if since is None:
            return
        self.since, self.why = None, ""
        log.info(
            "The handler accepts connections again, after %.1f s unreachable (%d message "
            "tries waited)",
            self._clock() - since,
            self.waits,
        )
        self.waits = 0
        self._changed(None)

    def _changed(self, why: str | None) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(why)
        except Exception:  # the message path must not fail for a report
            log.exception("Reporting the handler's reachability failed")
