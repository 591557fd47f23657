"""The assignment log's event: one JSON object per assignment generation.

The leader publishes one :class:`AssignmentEvent` per generation it writes on
``<subjectPrefix>.log.assignments`` (a stream of its own, ``<stream>_log``); ``shoal-analytics
export`` copies them to JSON lines and the report reads those. Other tools may write the same
lines. This module is imported by the consumer runtime, so it needs only pydantic and the
standard library.

Wire format, schema 1 (one object per line)::

    {"schema": 1, "ts": "2026-11-21T18:41:08.123Z", "namespace": "prod", "group": "orders",
     "generation": 7, "epoch": 4211, "leader": "orders-0", "reason": "join",
     "strategy": "sticky", "members": ["orders-0", "orders-1"],
     "assignment": {"0": "orders-0", "1": "orders-1", ...},
     "moved": [{"partition": 1, "from": "orders-0", "to": "orders-1"}, ...],
     "handover_ms": {"1": 41.5, ...}, "loads": {"0": 120.0, ...}}

``handover_ms`` (partition -> milliseconds from the target change to the new owner's claim)
and ``loads`` (partition -> messages per second) may be empty or missing. Readers ignore
fields they do not know; a change that old readers would misread gets a new ``schema``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
)

__all__ = [
    "REASONS",
    "SCHEMA_VERSION",
    "STRATEGIES",
    "AssignmentEvent",
    "EventError",
    "Move",
    "format_ts",
    "parse_event",
]

SCHEMA_VERSION: Literal[1] = 1
REASONS = ("initial", "join", "leave", "scale", "failover", "rebalance")
STRATEGIES = ("sticky", "modulo")

Reason = Literal["initial", "join", "leave", "scale", "failover", "rebalance"]
Strategy = Literal["sticky", "modulo"]


def format_ts(value: datetime) -> str:
    """RFC 3339 in UTC with milliseconds and a ``Z``: ``2026-11-21T18:41:08.123Z``."""
    utc = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    return utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"


class Move(BaseModel):
    """One partition whose owner changed: ``{"partition", "from", "to"}`` on the wire."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="ignore")

    partition: int = Field(ge=0)
    from_: str = Field(alias="from", min_length=1)
    to: str = Field(min_length=1)


def _finite_non_negative(values: dict[int, float], what: str) -> dict[int, float]:
    for partition, value in values.items():
        if partition < 0:
            raise ValueError(f"{what}: partition {partition} is negative")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{what} of partition {partition} must be finite and >= 0")
    return values


class AssignmentEvent(BaseModel):
    """One assignment generation of one group, as the leader wrote it to etcd."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="ignore")

    # "schema" would shadow BaseModel.schema(): the attribute is schema_version.
    schema_version: Literal[1] = Field(SCHEMA_VERSION, alias="schema")
    ts: datetime
    namespace: str = Field(min_length=1)
    group: str = Field(min_length=1)
    generation: int = Field(ge=0)
    epoch: int = Field(ge=0)
    leader: str
    reason: Reason
    strategy: Strategy = "sticky"
    members: list[str]
    assignment: dict[int, str]
    moved: list[Move] = Field(default_factory=list)
    handover_ms: dict[int, float] = Field(default_factory=dict)
    loads: dict[int, float] = Field(default_factory=dict)

    @field_validator("ts")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        # RFC 3339 requires an offset; a naive time is taken as UTC rather than refused.
        return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)

    @field_validator("assignment")
    @classmethod
    def _partitions(cls, value: dict[int, str]) -> dict[int, str]:
        for partition, owner in value.items():
            if partition < 0:
                raise ValueError(f"assignment: partition {partition} is negative")
            if not owner:
                raise ValueError(f"assignment: partition {partition} has an empty owner")
        return value

    @field_validator("handover_ms")
    @classmethod
    def _handover(cls, value: dict[int, float]) -> dict[int, float]:
        return _finite_non_negative(value, "handover_ms")

    @field_validator("loads")
    @classmethod
    def _loads(cls, value: dict[int, float]) -> dict[int, float]:
        return _finite_non_negative(value, "loads")

    @field_serializer("ts")
    def _ts_out(self, value: datetime) -> str:
        return format_ts(value)

    @classmethod
    def of(
        cls,
        *,
        ts: float | datetime,
        namespace: str,
        group: str,
        generation: int,
        epoch: int,
        leader: str,
        reason: str,
        members: Iterable[str],
        assignment: Mapping[int, str],
        moved: Iterable[tuple[int, str, str]] = (),
        handover_ms: Mapping[int, float] | None = None,
        loads: Mapping[int, float] | None = None,
        strategy: str = "sticky",
    ) -> AssignmentEvent:
        """Build (and validate) an event from the runtime's own types.

        ``ts`` is Unix seconds (``time.time()``) or an aware datetime; ``moved`` holds
        ``(partition, from, to)`` tuples as :func:`shoal.assignor.moved` returns
        them. Raises :class:`pydantic.ValidationError` on a value the schema refuses.
        """
        when = ts if isinstance(ts, datetime) else datetime.fromtimestamp(ts, UTC)
        return cls.model_validate(
            {
                "schema": SCHEMA_VERSION,
                "ts": when,
                "namespace": namespace,
                "group": group,
                "generation": generation,
                "epoch": epoch,
                "leader": leader,
                "reason": reason,
                "strategy": strategy,
                "members": sorted(members),
                "assignment": dict(sorted(assignment.items())),
                "moved": [{"partition": p, "from": a, "to": b} for p, a, b in moved],
                "handover_ms": dict(sorted((handover_ms or {}).items())),
                "loads": dict(sorted((loads or {}).items())),
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """The wire form: JSON-compatible, ``schema``/``from`` spelled as on the wire."""
        return self.model_dump(mode="json", by_alias=True)

    def to_json(self) -> str:
        """One line of JSON (no newline), the form published and exported."""
        return self.model_dump_json(by_alias=True)

    def to_bytes(self) -> bytes:
        return self.to_json().encode("utf-8")


class EventError(ValueError):
    """A line that is not a usable event. ``kind`` is ``malformed`` (not JSON, not an
    object, or a schema-1 object with missing or invalid fields) or ``unknown_schema``."""

    def __init__(self, kind: Literal["malformed", "unknown_schema"], detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in err["loc"]) or "event"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {err['msg']}{more}"


def parse_event(line: str | bytes) -> AssignmentEvent:
    """Parse one line of the log. Raises :class:`EventError` saying why it is unusable."""
    try:
        return AssignmentEvent.model_validate_json(line)
    except ValidationError as exc:
        first = exc
    # Slow path, only for bad lines: say what kind of bad.
    try:
        value = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise EventError("malformed", f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise EventError("malformed", f"not a JSON object ({type(value).__name__})")
    if "schema" not in value:
        raise EventError("malformed", "no 'schema' field")
    version = value["schema"]
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise EventError("unknown_schema", f"schema {version!r} (this reader knows 1)")
    raise EventError("malformed", _first_error(first))
