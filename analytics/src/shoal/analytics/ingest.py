"""Lines of the log to flat rows: one row per line, either an event or a problem.

Both report engines read their input through :func:`parse_file` (the Spark job inside
``mapInArrow``, on the executors), so "what is a valid event" has one definition: the
pydantic model in :mod:`shoal.contracts.events`. A row keeps the line's place (``file``,
relative to the input folder, and 1-based ``line``), which fixes the log's order within a
group. Blank lines are skipped silently.

Event rows flatten the assignment into parallel arrays sorted by partition (``parts``,
``owners``, ``loads``), which the engines explode into one row per partition ownership.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from sys import intern
from typing import Any

from shoal.contracts.events import AssignmentEvent, EventError, parse_event

__all__ = ["PROBLEM_KINDS", "ROW_COLUMNS", "SPARK_ROW_SCHEMA", "event_row", "parse_file"]

PROBLEM_KINDS = ("malformed", "unknown_schema", "out_of_order")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICRO = timedelta(microseconds=1)

# Column -> Spark SQL type; the order is the row layout. kind is None for an event.
ROW_COLUMNS: dict[str, str] = {
    "file": "string",
    "line": "bigint",
    "kind": "string",
    "detail": "string",
    "namespace": "string",
    "group": "string",
    "generation": "bigint",
    "epoch": "bigint",
    "ts_us": "bigint",
    "leader": "string",
    "reason": "string",
    "strategy": "string",
    "members": "array<string>",
    "parts": "array<int>",
    "owners": "array<string>",
    "loads": "array<double>",
    "has_loads": "boolean",
    "handover": "array<double>",
    "moved_recorded": "int",
}
SPARK_ROW_SCHEMA = ", ".join(f"`{name}` {kind}" for name, kind in ROW_COLUMNS.items())


def ts_micros(value: datetime) -> int:
    return (value - _EPOCH) // _MICRO


def event_row(file: str, line: int, event: AssignmentEvent) -> dict[str, Any]:
    parts = sorted(event.assignment)
    loads = event.loads
    return {
        "file": file,
        "line": line,
        "kind": None,
        "detail": None,
        "namespace": event.namespace,
        "group": event.group,
        "generation": event.generation,
        "epoch": event.epoch,
        "ts_us": ts_micros(event.ts),
        "leader": event.leader,
        "reason": event.reason,
        "strategy": event.strategy,
        "members": sorted({intern(m) for m in event.members}),
        "parts": parts,
        # Interned: millions of rows name a handful of members.
        "owners": [intern(event.assignment[p]) for p in parts],
        "loads": [float(loads.get(p, 0.0)) for p in parts],
        "has_loads": bool(loads),
        "handover": [float(event.handover_ms[p]) for p in sorted(event.handover_ms)],
        "moved_recorded": len(event.moved),
    }


def problem_row(file: str, line: int, kind: str, detail: str) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_COLUMNS)
    row.update(file=file, line=line, kind=kind, detail=detail[:500])
    return row


def parse_file(name: str, data: bytes) -> Iterator[dict[str, Any]]:
    """One row per non-blank line of a JSON lines file (``\\n`` separated, ``\\r`` ignored)."""
    for number, raw in enumerate(data.split(b"\n"), start=1):
        line = raw.rstrip(b"\r")
        if not line.strip():
            continue
        try:
            event = parse_event(line)
        except EventError as exc:
            yield problem_row(name, number, exc.kind, exc.detail)
        else:
            yield event_row(name, number, event)
