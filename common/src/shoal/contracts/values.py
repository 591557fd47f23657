"""The JSON values in etcd that one process writes and another reads: one schema each.

- :class:`TargetValue`, ``partitions/<p>``: who should own the partition, written by the
  leader (election.py), read by every member's view and by the operator;
- :class:`ScaleRecord`, ``scale``: the autoscaler's last action, written by the leader's
  autoscaler, read by the next leader (its cooldown) and by the operator (Events, status).

Each parses what today's and earlier writers wrote (tests/test_contract_values.py keeps
values written by the code before these models), ignores keys it does not know (a newer
writer may add some), and refuses anything else with a reason fit for the "Ignored etcd
key" log line: garbage in etcd is logged and ignored, never fatal.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

__all__ = ["ScaleRecord", "TargetValue", "ValueRefused"]


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
