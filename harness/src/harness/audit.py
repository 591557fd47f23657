"""The fault suite's audit of a group's ledger, beyond `shoal.consumer.ledger.audit`.

`shoal.consumer.ledger.audit` finds lost, duplicated, out-of-order and overlapping
records. A fault scenario also needs time: how long partitions went unconsumed, how long
after a given moment they were consumed again, and by whom. Everything here is a pure
function of the ledger records (processing times are the members' wall clocks, which on
one machine are the harness's clock too) and of what the producer knows.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise

from shoal.consumer.ledger import LedgerRecord, audit
from shoal.consumer.producer import Outgoing

__all__ = [
    "FaultAudit",
    "audit_faults",
    "longest_gap",
    "message_ids",
    "resumed_after",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultAudit:
    """The figures every scenario asserts on and reports."""

    published: int  # publish attempts
    acked: int  # publishes JetStream acknowledged: these must all be processed
    processed: int  # ledger records
    lost: list[str]  # acked, never processed
    duplicates: int  # message ids processed more than once
    overlaps: list[tuple[int, str, str]]  # (partition, member, member) at overlapping times
    order_inversions: int  # within a project, an older message processed after a newer one
    longest_gap_s: float  # longest time any partition went without processing
    longest_gap_partition: int | None
    max_latency_s: float  # longest wait of an acked message from publish to processing

    def figures(self) -> dict[str, object]:
        return {
            "published": self.published,
            "acked": self.acked,
            "processed": self.processed,
            "lost": len(self.lost),
            "duplicates": self.duplicates,
            "overlaps": len(self.overlaps),
            "order_inversions": self.order_inversions,
            "longest_gap_s": round(self.longest_gap_s, 2),
            "longest_gap_partition": self.longest_gap_partition,
            "max_latency_s": round(self.max_latency_s, 2),
        }


def message_ids(items: Iterable[Outgoing]) -> list[str]:
    """The message ids of what was published, to audit the ledger against. Each item must
    carry its own id: without one the producer makes one up, which no audit can know."""
    ids = [item.message_id for item in items]
    known = [i for i in ids if i is not None]
    if len(known) < len(ids):
        raise ValueError(f"{len(ids) - len(known)} of {len(ids)} messages have no message_id")
    return known


def longest_gap(
    records: Iterable[LedgerRecord], start: float, end: float
) -> tuple[float, int | None]:
    """The longest time, within [start, end], any partition processed nothing.

    Under a steady producer every partition always has work, so a gap is a stall. A
    partition's gap runs from one processing start to the next (from `start` before the
    first, to `end` after the last).
    """
    starts: dict[int, list[float]] = defaultdict(list)
    for record in records:
        if start <= record.started <= end:
            starts[record.partition].append(record.started)
    worst, worst_p = 0.0, None
    for p, times in starts.items():
        times.sort()
        edges = [start, *times, end]
        gap = max(b - a for a, b in pairwise(edges))
        if gap > worst:
            worst, worst_p = gap, p
    return worst, worst_p


def resumed_after(
    records: Iterable[LedgerRecord],
    moment: float,
    partitions: Collection[int],
    *,
    not_by: str | None = None,
) -> tuple[float, dict[int, float]]:
    """How long after `moment` each partition was processed again (by anyone but `not_by`).

    Returns the worst delay and the delay per partition; a partition never processed
    again counts as infinitely late.
    """
    first: dict[int, float] = {}
    wanted = set(partitions)
    for record in records:
        if record.partition not in wanted or record.started < moment:
            continue
        if not_by is not None and record.member == not_by:
            continue
        if record.partition not in first or record.started < first[record.partition]:
            first[record.partition] = record.started
    delays = {p: (first[p] - moment if p in first else float("inf")) for p in wanted}
    return max(delays.values(), default=0.0), delays


def audit_faults(
    records: list[LedgerRecord],
    published: int,
    acked: Mapping[str, float],
    *,
    window: tuple[float, float],
) -> FaultAudit:
    """Audit against the acked message ids (id -> publish time) and the production window."""
    base = audit(records, acked.keys())
    first_started: dict[str, float] = {}
    for record in records:
        seen = first_started.get(record.message_id)
        if seen is None or record.started < seen:
            first_started[record.message_id] = record.started
    latency = max(
        (first_started[mid] - sent for mid, sent in acked.items() if mid in first_started),
        default=0.0,
    )
    gap, gap_p = longest_gap(records, *window)
    return FaultAudit(
        published=published,
        acked=len(acked),
        processed=len(records),
        lost=base.lost,
        duplicates=len(base.duplicates),
        overlaps=base.overlaps,
        order_inversions=len(base.out_of_order),
        longest_gap_s=gap,
        longest_gap_partition=gap_p,
        max_latency_s=latency,
    )
