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

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from sys import intern
from typing import Any

from shoal.analytics.layout import InputError
from shoal.contracts.events import AssignmentEvent, EventError, format_ts, parse_event

__all__ = [
    "PROBLEM_KINDS",
    "ROW_COLUMNS",
    "SPARK_ROW_SCHEMA",
    "event_row",
    "parse_file",
    "parse_parquet",
]

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


def _row(name: str, number: int, line: bytes) -> dict[str, Any]:
    try:
        event = parse_event(line)
    except EventError as exc:
        return problem_row(name, number, exc.kind, exc.detail)
    return event_row(name, number, event)


def parse_file(name: str, data: bytes) -> Iterator[dict[str, Any]]:
    """One row per non-blank line of a JSON lines file (``\\n`` separated, ``\\r`` ignored)."""
    for number, raw in enumerate(data.split(b"\n"), start=1):
        line = raw.rstrip(b"\r")
        if not line.strip():
            continue
        yield _row(name, number, line)


# The columns of export --format parquet that are the event's fields (the others, seq and
# stored_at, are where the message was in the stream).
_PARQUET_FIELDS = (
    "schema",
    "ts",
    "namespace",
    "group",
    "generation",
    "epoch",
    "leader",
    "reason",
    "strategy",
    "members",
    "assignment",
    "moved",
    "handover_ms",
    "loads",
)
_PARQUET_MAPS = ("assignment", "handover_ms", "loads")


def _wire(row: dict[str, Any]) -> bytes:
    """A Parquet export's row as the event's JSON line; a null is a missing field."""
    value: dict[str, Any] = {}
    for field in _PARQUET_FIELDS:
        item = row.get(field)
        if item is None:
            continue
        if field == "ts":
            item = format_ts(item)
        elif field in _PARQUET_MAPS:
            item = {str(k): v for k, v in item}
        value[field] = item
    return json.dumps(value, separators=(",", ":")).encode()


def parse_parquet(name: str, path: Path) -> Iterator[dict[str, Any]]:
    """One row per row of a Parquet file as ``export --format parquet`` writes it, its
    line the 1-based row number (as the Spark engine numbers them). A column it lacks is
    a missing field; a file pyarrow cannot read is an :class:`InputError`."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several kinds; any is "unreadable"
        raise InputError(f"{name}: not a readable Parquet file ({exc})") from None
    present = [c for c in _PARQUET_FIELDS if c in table.column_names]
    for number, row in enumerate(table.select(present).to_pylist(), start=1):
        yield _row(name, number, _wire(row))
