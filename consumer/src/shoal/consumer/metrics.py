"""Prometheus metrics of one consumer process, on a registry of its own.

A registry per process object (not the global default) so that several runtimes in one
interpreter, as in tests and benchmarks, do not collide.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

_HANDOVER_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.processed = Counter(
            "shoal_messages_processed", "Messages handled, by outcome", ["outcome"], registry=r
        )
        self.handler_seconds = Histogram(
            "shoal_handler_seconds", "Time spent in the message handler", registry=r
        )
        self.partitions_owned = Gauge(
            "shoal_partitions_owned", "Partitions this member consumes now", registry=r
        )
        self.is_leader = Gauge("shoal_is_leader", "1 while this member leads the group", registry=r)
        self.rebalances = Counter(
            "shoal_rebalances", "Assignment generations written by this member", registry=r
        )
        self.handover_seconds = Histogram(
            "shoal_handover_seconds",
            "From the leader's write of a new owner to that owner's first message",
            buckets=_HANDOVER_BUCKETS,
            registry=r,
        )
        self.lag = Gauge(
            "shoal_lag_messages",
            "Pending plus unacknowledged messages over the partitions this member owns",
            registry=r,
        )

    def watch_fencing(self, fenced: Callable[[], bool]) -> None:
        """Export ``shoal_fenced``, read from `fenced` at every scrape (once per process).

        A gauge read at scrape time rather than set on each change: the member fences
        itself on the monotonic clock (membership.safe()), even while no loop runs, so
        there is no event to count; asking at scrape time sees exactly that.
        """
        gauge = Gauge(
            "shoal_fenced",
            "1 while this member has stopped consuming because it cannot prove its lease",
            registry=self.registry,
        )
        gauge.set_function(lambda: 1.0 if fenced() else 0.0)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics; port 0 picks a free one. Returns the port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        bound = int(server.server_address[1])
        log.info("Serving metrics on %s:%d/metrics", addr, bound)
        return bound
