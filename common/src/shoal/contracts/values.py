"""The JSON values in etcd that one process writes and another reads: one schema each.

- :class:`TargetValue`, ``partitions/<p>``: who should own the partition, written by the
  leader (election.py), read by every member's view and by the operator;
- :class:`ScaleRecord`, ``scale``: the autoscaler's last action, written by the leader's
  autoscaler, read by the next leader (its cooldown) and by the operator (Events, status);
- :class:`PauseRecord`, ``paused``: who paused the group, when and why, written by the
  operator (spec.paused) or ``shoal-consumer pause``, read by every member's view;
- :class:`MemberStats`, ``members/<member>``: what a member reports about itself every
  stats interval, written by the member (runtime.py with worker.py's part), read by the
  leader (eligibility, loads, stalls, the autoscaler), ``shoal-consumer status`` and the
  operator (stalled partitions).

Each parses what today's and earlier writers wrote (tests/test_contract_values.py keeps
values written by the code before these models), ignores keys it does not know (a newer
writer may add some), and refuses anything else with a reason fit for the "Ignored etcd
key" log line: garbage in etcd is logged and ignored, never fatal.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
)

from shoal.contracts.names import decimal, format_time

__all__ = [
    "MAX_CPU_PERCENT",
    "MemberStats",
    "PauseRecord",
    "ScaleRecord",
    "TargetValue",
    "ValueRefused",
]

# A member's cpu is a percent of its CPU limit; above this (100 cores' worth over a
# one-core limit) the reading is a broken clock, not load.
MAX_CPU_PERCENT = 10_000.0


class ValueRefused(ValueError):
    """A value that is not what its key holds; the message says what is wrong."""


def _why(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "the value"
    return f"{where}: {first['msg']}"


class TargetValue(BaseModel):
    """``partitions/<p>``: the owner the leader assigned, in which generation, by which
    leader's epoch, when (the leader's wall clock; absent in values from before ts)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    owner: Annotated[str, Field(min_length=1)]
    generation: StrictInt
    epoch: StrictInt
    ts: float | None = None

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def parse(cls, raw: bytes) -> TargetValue:
        """The value; ValueRefused says why it is none."""
        try:
            value = cls.model_validate_json(raw)
        except ValidationError as exc:
            raise ValueRefused(_why(exc)) from None
        if value.ts is not None and not math.isfinite(value.ts):
            return value.model_copy(update={"ts": None})
        return value


class ScaleRecord(BaseModel):
    """``scale``: the autoscaler's last action. ``time`` is the writer's wall clock; the
    JSON keys are ``time``, ``from``, ``to``, ``reason``, ``dryRun`` and ``epoch``."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    time: float
    from_replicas: int = Field(alias="from")
    to_replicas: int = Field(alias="to")
    reason: str
    dry_run: StrictBool = Field(default=False, alias="dryRun")
    epoch: int = 0

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()

    @classmethod
    def parse(cls, raw: bytes) -> ScaleRecord | None:
        """The record, or None for anything else (garbage in etcd is ignored)."""
        try:
            return cls.model_validate_json(raw)
        except ValidationError:
            return None


#: 10000-01-01T00:00:00Z: no Unix time a writer's clock gives is at or beyond it (nor can
#: TIME_FORMAT's four-digit year, or every platform's gmtime, show it).
TIME_LIMIT = 253_402_300_800.0


def known_time(t: float) -> float:
    """`t` if it is a Unix time that can be shown (finite, 0 < t < TIME_LIMIT); else 0.0,
    which the records read as an unknown time (NaN, inf, 1e300 or a negative time in etcd
    would otherwise break format_time, and a NaN every JSON reader)."""
    return t if math.isfinite(t) and 0.0 < t < TIME_LIMIT else 0.0


def shown_time(t: float) -> str:
    """`t` for people: the time (format_time), or "an unknown time"."""
    return format_time(t) if known_time(t) else "an unknown time"


class PauseRecord(BaseModel):
    """``paused``: the group is paused while the key exists; its value says by whom
    (``by``: the Kubernetes field manager that set spec.paused, or the user of
    ``shoal-consumer pause``), when (``time``, the writer's wall clock) and through what
    (``source``: ``spec.paused`` or ``cli``), with an optional ``reason``.

    The key's existence is what pauses: a value that does not parse still pauses the
    group (the members log it and read it as :meth:`unknown`)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    by: str = ""
    time: float = 0.0
    source: str = ""
    reason: str = ""

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def unknown(cls) -> PauseRecord:
        return cls(by="(unreadable pause record)")

    @classmethod
    def parse(cls, raw: bytes) -> PauseRecord:
        """The record; ValueRefused says why the bytes are none (the group is paused
        all the same)."""
        try:
            value = cls.model_validate_json(raw)
        except ValidationError as exc:
            raise ValueRefused(_why(exc)) from None
        if known_time(value.time) != value.time:
            # Out of range (or NaN, inf): an unknown time; the group is paused all the same.
            return value.model_copy(update={"time": 0.0})
        return value

    def describe(self) -> str:
        """`by <who> at <when> (<source>): <reason>`, for logs and the CLI."""
        text = f"by {self.by or 'someone'} at {shown_time(self.time)}"
        if self.source:
            text += f" ({self.source})"
        if self.reason:
            text += f": {self.reason}"
        return text


# Strict: JSON true is no number and "5" no count; NaN and infinities are no measurement.
_Count = Annotated[int, Strict(), Field(ge=0)]
_Amount = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]


def _partition_numbers(raw: object) -> list[int]:
    """The entries of a list that are partition numbers (true is an int to Python, but no
    partition); anything else is dropped: the readers check the range for their group."""
    if not isinstance(raw, list | tuple):
        return []
    return [p for p in raw if isinstance(p, int) and not isinstance(p, bool) and p >= 0]


class MemberStats(BaseModel):
    """``members/<member>``: a member's report about itself.

    The readers need different parts, and one bad field must not cost a member the
    others: a member whose cpu reading is broken still reports its stalls and its NATS
    reachability, and still owns partitions (owning needs only the key). So
    :meth:`parse` refuses only a value that is not a JSON object; a field that breaks its
    rule is left at its default and its reason kept in :attr:`problems` (logged by the
    view, and the autoscaler ignores a member whose scaling fields have one).

    The autoscaler's fields: ``cpu`` (percent of the member's CPU limit, 0..10,000),
    ``ts`` (the writer's wall clock, positive epoch seconds), ``active_projects`` and
    ``lag`` (counts): required for scaling (absent reads as 0, and the autoscaler
    ignores the member); ``rate`` (settled
    messages per second), ``owned`` (partitions it runs), ``inflight`` (handlers
    running). The leader's: ``nats_ok`` (false: it cannot reach NATS, give it nothing),
    ``handler_ok`` (false: its HTTP handler accepts no connection, give it nothing),
    ``partition_rates`` (messages per second per owned partition: the loads of a
    load-aware assignment), ``stalled`` (partitions with work and no progress: move
    them). ``paused``: the partitions whose runner has finished pausing (handlers done
    and acked, the rest given back, no pull open), what `shoal-consumer reset` waits
    for before it touches the durables. Informative: ``buffered``, ``rss_mb``,
    ``pid``. Unknown keys are ignored (a newer writer may add some); entries of
    ``stalled``, ``paused`` and ``partition_rates`` that are no partition numbers or
    rates are dropped one by one, as the readers did before this model.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    # (Absent reads as 0 here; scaling_problem() tells absent from zero: model_fields_set.)
    cpu: Annotated[float, Strict(), Field(ge=0, le=MAX_CPU_PERCENT, allow_inf_nan=False)] = 0.0
    ts: Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)] = 0.0
    active_projects: _Count = 0
    lag: _Count = 0
    rate: _Amount = 0.0
    owned: tuple[_Count, ...] = ()
    inflight: _Count = 0
    buffered: _Count = 0
    nats_ok: StrictBool = True
    # (None when not written, read as true: only members with an HTTP handler write it.)
    handler_ok: StrictBool | None = None
    partition_rates: dict[int, float] = Field(default_factory=dict)
    stalled: tuple[int, ...] = ()
    # (None when not written: stats of earlier members write back byte for byte.)
    paused: tuple[int, ...] | None = None
    rss_mb: _Amount | None = None
    pid: _Count | None = None

    _problems: dict[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("owned", mode="before")
    @classmethod
    def _owned_is_a_list(cls, raw: object) -> object:
        # A string is a sequence too; "0,1" is no list of partitions.
        if not isinstance(raw, list | tuple):
            raise ValueError("is not a list of partitions")
        return raw

    @field_validator("owned", mode="after")
    @classmethod
    def _owned_as_a_set(cls, owned: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted(set(owned)))

    @field_validator("stalled", "paused", mode="before")
    @classmethod
    def _stalled_partitions(cls, raw: object) -> list[int]:
        return _partition_numbers(raw)

    @field_validator("partition_rates", mode="before")
    @classmethod
    def _rates(cls, raw: object) -> dict[int, float]:
        if not isinstance(raw, Mapping):
            return {}
        rates: dict[int, float] = {}
        for key, value in raw.items():
            number = None if isinstance(key, bool) else decimal(str(key))
            if number is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value) and value >= 0:
                rates[number] = float(value)
        return rates

    @property
    def problems(self) -> Mapping[str, str]:
        """field -> why its value was not used (it reads as its default)."""
        return self._problems

    def scaling_problem(self) -> str | None:
        """Why the autoscaler cannot use these stats, or None when it can."""
        for key in ("cpu", "ts", "active_projects", "lag", "rate", "owned", "inflight"):
            if key in self._problems:
                return self._problems[key]
        for key in ("cpu", "ts", "active_projects", "lag"):
            if key not in self.model_fields_set:
                return f"no {key!r}"
        return None

    def as_dict(self) -> dict[str, Any]:
        """The stats as JSON types (absent informative fields are left out)."""
        return self.model_dump(mode="json", exclude_none=True)

    def to_json(self) -> bytes:
        """The member key's value (sorted keys)."""
        return json.dumps(self.as_dict(), sort_keys=True).encode()

    @classmethod
    def parse(cls, raw: bytes | str | Mapping[str, Any]) -> MemberStats:
        """The stats in `raw` (the key's bytes, or its decoded JSON); ValueRefused when it
        is not a JSON object. Fields that break their rule read as their default, and
        :attr:`problems` says why."""
        if isinstance(raw, bytes | str):
            try:
                raw = json.loads(raw)
            except (ValueError, UnicodeDecodeError, RecursionError):
                raise ValueRefused("is not JSON") from None
        if not isinstance(raw, Mapping):
            raise ValueRefused(f"is not a JSON object ({type(raw).__name__})")
        data = dict(raw)
        problems: dict[str, str] = {}
        while True:
            try:
                stats = cls.model_validate(data)
                break
            except ValidationError as exc:
                # Drop each field that broke its rule and try again: every field has a
                # default, so this ends (at the latest with an empty value).
                for error in exc.errors():
                    field = str(error["loc"][0]) if error["loc"] else ""
                    if field not in data:
                        raise ValueRefused(_why(exc)) from None
                    problems.setdefault(field, f"{field} {data.pop(field)!r}: {error['msg']}")
        stats._problems = problems
        return stats
