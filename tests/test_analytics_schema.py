"""The Spark job's explicit JSON schema says what the pydantic event model says.

The model (:class:`shoal.contracts.events.AssignmentEvent`) defines the format; the Spark
job reads JSON lines with its own parser and :data:`shoal.analytics.spark_input.EVENT_SCHEMA`.
This test derives the expected Spark type of every field from the model's annotations and
compares: same wire names, same order, same types. No JVM needed.
"""

from __future__ import annotations

import types
import typing
from datetime import datetime
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from shoal.analytics.spark_input import EVENT_FIELDS
from shoal.contracts.events import AssignmentEvent, Move


def wire_name(name: str, info: FieldInfo) -> str:
    return info.alias or name


def spark_type(annotation: Any) -> str:
    """The Spark SQL type that reads a JSON value of this Python type."""
    origin = get_origin(annotation)
    if origin is Literal:
        values = get_args(annotation)
        if all(isinstance(v, str) for v in values):
            return "string"
        # The schema version: read as text, so that "schema": 2 is told from a broken line.
        assert all(isinstance(v, int) for v in values), annotation
        return "string"
    if annotation is str:
        return "string"
    if annotation is int:
        return "bigint"
    if annotation is float:
        return "double"
    if annotation is datetime:
        # RFC 3339 text, parsed by an expression so that a bad time is a malformed line.
        return "string"
    if origin is list:
        (item,) = get_args(annotation)
        return f"array<{spark_type(item)}>"
    if origin is dict:
        key, value = get_args(annotation)
        # JSON object keys are always strings; the job casts them to partition numbers.
        assert key is int, annotation
        return f"map<string,{spark_type(value)}>"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        fields = ",".join(
            f"{wire_name(n, f)}:{spark_type(f.annotation)}"
            for n, f in annotation.model_fields.items()
        )
        return f"struct<{fields}>"
    if origin in (typing.Union, types.UnionType):
        raise AssertionError(f"no Spark type for the union {annotation}")
    raise AssertionError(f"no Spark type for {annotation!r}")


def test_the_spark_schema_is_the_models() -> None:
    expected = {
        wire_name(name, info): spark_type(info.annotation)
        for name, info in AssignmentEvent.model_fields.items()
    }
    assert list(EVENT_FIELDS) == list(expected)
    assert EVENT_FIELDS == expected


def test_moves_and_maps_are_spelled_as_on_the_wire() -> None:
    # The nested model by its wire names ("from", not the attribute from_).
    assert spark_type(Move) == "struct<partition:bigint,from:string,to:string>"
    assert EVENT_FIELDS["assignment"] == "map<string,string>"
    assert EVENT_FIELDS["loads"] == EVENT_FIELDS["handover_ms"] == "map<string,double>"
