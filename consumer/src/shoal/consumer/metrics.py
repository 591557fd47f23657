"""Prometheus metrics of one consumer process, on a registry of its own.

A registry per process object (not the global default) so that several runtimes in one
interpreter, as in tests and benchmarks, do not collide.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

_HANDOVER_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OUTCOMES = ("ok", "retry", "dead_letter")


class MessageTally(Collector):
    """``shoal_messages_processed_total{outcome}`` and ``shoal_handler_seconds``, counted
    per message into plain integers and turned into Prometheus families at scrape time.

    prometheus_client's Counter.inc and Histogram.observe take a lock each, and observe
    walks the buckets in Python: together 3-4 % of a noop member's CPU, once per message.
    Here the event loop only adds to ints and a list (no lock: it is their only writer, and
    a scrape reads them from its thread at any moment, as it would a Counter); the families
    exposed are the same as a Counter's and a Histogram's (with their ``_created`` samples),
    and every outcome is exported from the start, at 0 (ShoalDeadLetters' increase()
    needs the step from 0).
    """

    BUCKETS = Histogram.DEFAULT_BUCKETS  # ends with +Inf

    def __init__(self) -> None:
        self.created = time.time()
        self.ok = 0
        self.retry = 0
        self.dead_letter = 0
        # Observations per bucket (not cumulative): index i counts v <= BUCKETS[i] and
        # v > BUCKETS[i - 1]; bisect_left finds it as Histogram.observe's loop does.
        self._bounds = list(self.BUCKETS)
        self._counts = [0] * len(self._bounds)
        self.handler_sum = 0.0

    def observe_handler(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self.handler_sum += seconds

    def collect(self) -> Iterator[Metric]:
        processed = CounterMetricFamily(
            "shoal_messages_processed", "Messages handled, by outcome", labels=["outcome"]
        )
        for outcome in OUTCOMES:
            # Every outcome from the start, at 0 too: a series that first appears at n
            # has no step for increase() to see, and ShoalDeadLetters missed a member's
            # first dead letters (one poison message, or a burst within a scrape).
            processed.add_metric([outcome], getattr(self, outcome), created=self.created)
        yield processed
        counts = list(self._counts)  # one consistent copy: the loop keeps adding
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip(self.BUCKETS, counts, strict=True):
            cumulative += count
            buckets.append((_bound_label(bound), float(cumulative)))
        handler = HistogramMetricFamily(
            "shoal_handler_seconds", "Time spent in the message handler"
        )
        handler.add_metric([], buckets, self.handler_sum)
        handler.add_sample("shoal_handler_seconds_created", {}, self.created)
        yield handler


def _bound_label(bound: float) -> str:
    """A bucket's ``le`` as prometheus_client writes it (floatToGoString)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # shoal_messages_processed_total{outcome} and shoal_handler_seconds.
        self.messages = MessageTally()
        r.register(self.messages)
        self.partitions_owned = Gauge(
            "shoal_partitions_owned", "Partitions this member consumes now", registry=r
        )
        # The group's partition count, from the member's own config: what
        # ShoalPartitionsUnclaimed compares the members' sum of owned partitions with.
        # (A recent maximum of that sum stood for it, and one evaluation that caught a
        # hand-over on both sides of the scrapes' offsets raised it for an hour.)
        self.group_partitions = Gauge(
            "shoal_group_partitions", "Partitions of this member's group", registry=r
        )
        self.partitions_stalled = Gauge(
            "shoal_partitions_stalled",
            "Owned partitions with work and no progress for stallAfterSeconds",
            registry=r,
        )
        self.oldest_held = Gauge(
            "shoal_oldest_held_seconds",
            "Age of the oldest message this member holds unsettled, since it was delivered "
            "here (0 when it holds none): a project whose head cannot finish shows here "
            "while its partition's other projects move on",
            registry=r,
        )
        self.handler_reachable = Gauge(
            "shoal_handler_reachable",
            "0 while this member's HTTP handler accepts no connection (its messages wait, "
            "not counted as attempts); 1 otherwise",
            registry=r,
        )
        self.handler_reachable.set(1)
        self.redeliveries_resettled = Counter(
            "shoal_redeliveries_resettled",
            "Redelivered messages this member had settled already (the server applied the "
            "ack late, or lost it): acked again, not handled again",
            registry=r,
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
        self.takeover_wait_seconds = Histogram(
            "shoal_takeover_wait_seconds",
            "How long a partition taken over with earlier deliveries outstanding held newer "
            "messages back until those came back (orderAfterFailure: Strict)",
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
