"""Read the ledger stream and audit it: lost, duplicated, out-of-order, overlapping.

The ledger handler records every processed message; this module turns the records
into the figures the tests and the demo report.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import nats.js.errors
from nats.js import api

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LedgerRecord:
    project_id: str
    message_id: str
    seq: int | None
    partition: int
    member: str
    delivery_count: int
    stream_sequence: int
    started: float
    finished: float

    @classmethod
    def parse(cls, data: bytes) -> LedgerRecord:
        raw = json.loads(data)
        return cls(
            project_id=raw["project_id"],
            message_id=raw["message_id"],
            seq=raw.get("seq"),
            partition=int(raw["partition"]),
            member=raw["member"],
            delivery_count=int(raw["delivery_count"]),
            stream_sequence=int(raw["stream_sequence"]),
            started=float(raw["started"]),
            finished=float(raw["finished"]),
        )


async def read_ledger(
    js: Any, stream: str, *, batch: int = 2000, patience: float = 30.0
) -> list[LedgerRecord]:
    """All records in ledger order, through an ephemeral pull consumer.

    In a NATS cluster that just lost a node the stream's or the meta leader may be in an
    election: requests time out for a few seconds. Those are retried for up to
    `patience` seconds without progress, and reading stops early only then (with a
    warning): a silently short read would make an audit report losses that are not.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    while True:
        try:
            info = await js.stream_info(stream)
            total = int(info.state.messages)
            if total == 0:
                return []
            consumer = await js.add_consumer(
                stream,
                config=api.ConsumerConfig(
                    ack_policy=api.AckPolicy.NONE,
                    deliver_policy=api.DeliverPolicy.ALL,
                    inactive_threshold=30.0,
                    num_replicas=1,
                    mem_storage=True,
                ),
            )
            break
        except (TimeoutError, nats.js.errors.ServiceUnavailableError):
            if loop.time() >= deadline:
                raise
            await asyncio.sleep(0.5)
    sub = await js.pull_subscribe_bind(stream=stream, consumer=consumer.name)
    records: list[LedgerRecord] = []
    deadline = loop.time() + patience
    try:
        while len(records) < total:
            try:
                msgs = await sub.fetch(min(batch, total - len(records)), timeout=2)
            except (TimeoutError, nats.js.errors.ServiceUnavailableError):
                if loop.time() >= deadline:
                    log.warning(
                        "Read %d of %d ledger records; nothing more came in %.0f s",
                        len(records),
                        total,
                        patience,
                    )
                    break
                continue
            deadline = loop.time() + patience
            for msg in msgs:
                try:
                    records.append(LedgerRecord.parse(msg.data))
                except (ValueError, KeyError) as exc:
                    log.warning("Skipped a malformed ledger record: %r", exc)
    finally:
        await sub.unsubscribe()
    return records


@dataclass
class Audit:
    expected: int
    processed: int
    lost: list[str] = field(default_factory=list)
    duplicates: dict[str, list[LedgerRecord]] = field(default_factory=dict)
    out_of_order: list[tuple[str, int, int]] = field(default_factory=list)
    overlaps: list[tuple[int, str, str]] = field(default_factory=list)

    def summary(self) -> dict[str, int]:
        return {
            "expected": self.expected,
            "processed": self.processed,
            "lost": len(self.lost),
            "duplicates": len(self.duplicates),
            "out_of_order": len(self.out_of_order),
            "overlaps": len(self.overlaps),
        }


def audit(records: Iterable[LedgerRecord], expected_ids: Iterable[str]) -> Audit:
    """Compare the ledger with the message ids that were published.

    - lost: published, never recorded;
    - duplicates: recorded more than once (message id -> all its records);
    - out_of_order: within a project, a message processed after one with a higher stream
      sequence (ignoring redeliveries of the same message), or started before the one
      recorded before it had finished (a project's messages run one at a time);
    - overlaps: two members processing the same partition at overlapping times.
    """
    records = list(records)
    expected = set(expected_ids)
    by_id: dict[str, list[LedgerRecord]] = defaultdict(list)
    for record in records:
        by_id[record.message_id].append(record)
    result = Audit(expected=len(expected), processed=len(records))
    result.lost = sorted(expected - by_id.keys())
    result.duplicates = {mid: recs for mid, recs in by_id.items() if len(recs) > 1}

    last_seq: dict[str, int] = {}
    last_record: dict[str, LedgerRecord] = {}
    for record in records:
        if record.message_id in result.duplicates and record is not by_id[record.message_id][0]:
            continue
        prev = last_seq.get(record.project_id, 0)
        if record.stream_sequence < prev:
            result.out_of_order.append((record.project_id, prev, record.stream_sequence))
        last_seq[record.project_id] = max(prev, record.stream_sequence)
        previous = last_record.get(record.project_id)
        if previous is not None and record.started < previous.finished:
            result.out_of_order.append(
                (record.project_id, previous.stream_sequence, record.stream_sequence)
            )
        last_record[record.project_id] = record

    # Per partition, the processing intervals of different members must not intersect.
    by_partition: dict[int, list[LedgerRecord]] = defaultdict(list)
    for record in records:
        by_partition[record.partition].append(record)
    for partition, recs in by_partition.items():
        recs.sort(key=lambda r: r.started)
        spans: list[tuple[str, float, float]] = []  # consecutive runs per member
        for r in recs:
            if spans and spans[-1][0] == r.member:
                member, start, end = spans[-1]
                spans[-1] = (member, start, max(end, r.finished))
            else:
                spans.append((r.member, r.started, r.finished))
        for (m1, _s1, e1), (m2, s2, _e2) in pairwise(spans):
            if s2 < e1:
                result.overlaps.append((partition, m1, m2))
    return result
