"""The report's input, read by Spark itself: JSON lines and Parquet, no Python per row.

JSON lines go through Spark's text source (splittable: a big file is read by as many
tasks as it has splits of ``spark.sql.files.maxPartitionBytes``) and Spark's JSON parser,
``from_json`` with the explicit schema :data:`EVENT_SCHEMA` and the corrupt-record column
:data:`CORRUPT`. That is the parser ``spark.read.json`` uses; we call it on text lines
rather than through ``spark.read.json`` because the JSON source drops blank lines, and a
problem must name its line (1-based, blank lines counted) exactly as the pandas engine
does. Parquet files written by ``shoal-analytics export --format parquet`` are read with
Spark's Parquet source.

Line numbers without a Python pass: every line gets ``monotonically_increasing_id()`` in
the scan (consecutive within a task, and a task reads its file splits one after the other)
and its split's start offset (``_metadata.file_block_start``). Per split, the first id and
the number of lines; per file, the lines of the splits before: the line number is the
lines before the split plus the distance to the split's first id, plus one.

What counts as a valid event is defined by :class:`shoal.contracts.events.AssignmentEvent`;
:data:`EVENT_SCHEMA` spells its fields in Spark types (``tests/test_analytics_schema.py``
proves that both agree) and :func:`_problems` its constraints as Spark expressions, field
by field in the model's order, so the first field named in a problem's ``detail`` is the
one pydantic names. Known differences, all about input our writers never produce: pydantic
accepts numbers written as strings (``"generation": "7"``) and Spark's parser does not;
Spark reads any JSON value into a string field (``"group": 5`` is the group ``"5"``), and
``null`` where a default exists (``"strategy": null``) counts as missing.

The rows have the layout of :data:`shoal.analytics.ingest.ROW_COLUMNS`, which the pandas
engine gets from :func:`shoal.analytics.ingest.parse_file`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from shoal.analytics.ingest import ROW_COLUMNS
from shoal.contracts.events import REASONS, SCHEMA_VERSION, STRATEGIES

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, DataFrameReader, SparkSession

__all__ = ["CORRUPT", "EVENT_FIELDS", "EVENT_SCHEMA", "read_rows"]

log = logging.getLogger(__name__)

CORRUPT = "_corrupt_record"

# The wire form of AssignmentEvent, field by field in the model's order. JSON object keys
# are strings, so the partition maps have string keys (cast to int by _rows). "schema" is
# read as text to tell schema 2 (unknown) from a broken line, "ts" as text to parse it with
# an expression (an unparsable time is a malformed line, not a failed job).
EVENT_FIELDS: dict[str, str] = {
    "schema": "string",
    "ts": "string",
    "namespace": "string",
    "group": "string",
    "generation": "bigint",
    "epoch": "bigint",
    "leader": "string",
    "reason": "string",
    "strategy": "string",
    "members": "array<string>",
    "assignment": "map<string,string>",
    "moved": "array<struct<partition:bigint,from:string,to:string>>",
    "handover_ms": "map<string,double>",
    "loads": "map<string,double>",
}
EVENT_SCHEMA = ", ".join(f"`{name}` {kind}" for name, kind in EVENT_FIELDS.items())

# What export --format parquet writes (shoal.analytics.export._parquet_encoder).
PARQUET_SCHEMA = (
    "`seq` bigint, `stored_at` timestamp, `schema` int, `ts` timestamp, `namespace` string, "
    "`group` string, `generation` bigint, `epoch` bigint, `leader` string, `reason` string, "
    "`strategy` string, `members` array<string>, `assignment` map<int,string>, "
    "`moved` array<struct<partition:int,from:string,to:string>>, "
    "`handover_ms` map<int,double>, `loads` map<int,double>"
)

_DETAIL_CHARS = 500


def _bad_partition_map(value: Column, bad_value: Callable[[Column], Column]) -> Column:
    """A map whose key is not a partition number, or with a value ``bad_value`` refuses."""
    from pyspark.sql import functions as F

    def bad(entry: Column) -> Column:
        key = entry["key"].try_cast("int")
        return key.isNull() | (key < 0) | bad_value(entry["value"])

    return value.isNotNull() & F.exists(F.map_entries(value), bad)


def _bad_amount(value: Column) -> Column:
    from pyspark.sql import functions as F

    return value.isNull() | F.isnan(value) | (F.abs(value) == float("inf")) | (value < 0)


def _problems(e: Column, ts: Column) -> list[tuple[str, Column]]:
    """(field, is it invalid) in the model's field order: pydantic reports the first."""
    from pyspark.sql import functions as F

    def text(name: str) -> Column:
        return e[name].isNull() | (F.length(e[name]) == 0)

    def whole(name: str) -> Column:
        return e[name].isNull() | (e[name] < 0)

    return [
        ("ts", ts.isNull()),
        ("namespace", text("namespace")),
        ("group", text("group")),
        ("generation", whole("generation")),
        ("epoch", whole("epoch")),
        ("leader", e["leader"].isNull()),
        ("reason", e["reason"].isNull() | ~e["reason"].isin(*REASONS)),
        ("strategy", e["strategy"].isNotNull() & ~e["strategy"].isin(*STRATEGIES)),
        ("members", e["members"].isNull() | F.exists(e["members"], lambda m: m.isNull())),
        (
            "assignment",
            e["assignment"].isNull()
            | _bad_partition_map(e["assignment"], lambda o: o.isNull() | (F.length(o) == 0)),
        ),
        (
            "moved",
            e["moved"].isNotNull()
            & F.exists(
                e["moved"],
                lambda m: (
                    m.isNull()
                    | m["partition"].isNull()
                    | (m["partition"] < 0)
                    | m["from"].isNull()
                    | (F.length(m["from"]) == 0)
                    | m["to"].isNull()
                    | (F.length(m["to"]) == 0)
                ),
            ),
        ),
        ("handover_ms", _bad_partition_map(e["handover_ms"], _bad_amount)),
        ("loads", _bad_partition_map(e["loads"], _bad_amount)),
    ]


def _classified(frame: DataFrame, raw: Column | None) -> DataFrame:
    """``kind`` and ``detail`` of each parsed line (``e``, ``ts``; ``raw`` the line's text
    if JSON, with :data:`CORRUPT` set by the parser when it was not a schema-1 object)."""
    from pyspark.sql import functions as F

    e, ts = F.col("e"), F.col("ts")
    version = e["schema"].cast("string")
    expected = str(SCHEMA_VERSION)
    unknown = version.isNotNull() & (version != expected)
    field_problem = F.coalesce(
        *[F.when(bad, F.lit(f"{name}: missing or invalid")) for name, bad in _problems(e, ts)]
    )
    kind = F.when(unknown, "unknown_schema").when(field_problem.isNotNull(), "malformed")
    detail = F.when(
        unknown, F.concat(F.lit("schema "), version, F.lit(f" (this reader knows {expected})"))
    ).otherwise(field_problem)
    if raw is not None:
        corrupt = e[CORRUPT].isNotNull()
        # Only the few corrupt lines pay for a second look: pydantic's order is "not JSON",
        # "not a JSON object", a schema other than 1, then the fields.
        whole_value = F.get_json_object(raw, "$")
        their_version = F.get_json_object(raw, "$.schema")
        is_object = F.ltrim(raw).startswith("{")
        corrupt_unknown = is_object & their_version.isNotNull() & (their_version != expected)
        kind = (
            F.when(corrupt & corrupt_unknown, "unknown_schema")
            .when(corrupt, "malformed")
            .otherwise(kind)
        )
        detail = (
            F.when(
                corrupt & corrupt_unknown,
                F.concat(
                    F.lit("schema "), their_version, F.lit(f" (this reader knows {expected})")
                ),
            )
            .when(corrupt & whole_value.isNull(), F.lit("not JSON"))
            .when(corrupt & ~is_object, F.lit("not a JSON object"))
            .when(corrupt, F.lit("event: a field has the wrong JSON type"))
            .otherwise(detail)
        )
    return frame.withColumn("kind", kind).withColumn(
        "detail", F.substring(detail, 1, _DETAIL_CHARS)
    )


def _event_columns() -> list[Column]:
    """The flat event columns of ROW_COLUMNS from ``e`` (valid rows; others get nulls)."""
    from pyspark.sql import functions as F

    e, ok = F.col("e"), F.col("kind").isNull()

    def int_keys(value: Column) -> Column:
        # Entries (partition, value) sorted by partition.
        return F.array_sort(
            F.transform(
                F.map_entries(value),
                # try_cast: a malformed row never gets here, but ANSI casts must not throw
                # should Spark evaluate this before the when() that guards it.
                lambda x: F.struct(x["key"].try_cast("int").alias("p"), x["value"].alias("v")),
            )
        )

    assigned = int_keys(e["assignment"])
    parts = F.transform(assigned, lambda x: x["p"])
    loads = int_keys(F.coalesce(e["loads"], F.create_map().cast("map<string,double>")))
    load_parts = F.transform(loads, lambda x: x["p"])
    # Loads usually name exactly the assigned partitions: then they line up as they are.
    # Otherwise a lookup per partition (0 for partitions without a load).
    load_map = F.map_from_entries(F.transform(loads, lambda x: F.struct(x["p"], x["v"])))
    aligned_loads = F.when(load_parts == parts, F.transform(loads, lambda x: x["v"])).otherwise(
        F.transform(parts, lambda p: F.coalesce(F.element_at(load_map, p), F.lit(0.0)))
    )
    handover = int_keys(F.coalesce(e["handover_ms"], F.create_map().cast("map<string,double>")))

    def when_ok(value: Column, name: str) -> Column:
        return F.when(ok, value).alias(name)

    return [
        when_ok(e["namespace"], "namespace"),
        when_ok(e["group"], "group"),
        when_ok(e["generation"], "generation"),
        when_ok(e["epoch"], "epoch"),
        when_ok(F.unix_micros(F.col("ts")), "ts_us"),
        when_ok(e["leader"], "leader"),
        when_ok(e["reason"], "reason"),
        when_ok(F.coalesce(e["strategy"], F.lit("sticky")), "strategy"),
        when_ok(F.array_sort(F.array_distinct(e["members"])), "members"),
        when_ok(parts, "parts"),
        when_ok(F.transform(assigned, lambda x: x["v"]), "owners"),
        when_ok(aligned_loads.cast("array<double>"), "loads"),
        when_ok(F.size(loads) > 0, "has_loads"),
        when_ok(F.transform(handover, lambda x: x["v"]).cast("array<double>"), "handover"),
        when_ok(F.size(F.coalesce(e["moved"], F.array())).cast("int"), "moved_recorded"),
    ]


def _root_prefix(spark: SparkSession, input_path: str) -> tuple[str, bool]:
    """The input folder's URI-encoded path without scheme and authority (``/tmp/logs/``), and
    whether the input is a single file (named by its base name, as the pandas engine
    does)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    path = jvm.org.apache.hadoop.fs.Path(input_path)
    fs = path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    qualified = fs.makeQualified(path)
    single = bool(fs.exists(qualified) and fs.getFileStatus(qualified).isFile())
    root = qualified.getParent() if single else qualified
    return str(root.toUri().getRawPath()).rstrip("/") + "/", single


def _relative(path: Column, prefix: str) -> Column:
    """``file`` of a row: its path relative to the input folder, decoded, ``/``-separated."""
    from pyspark.sql import functions as F

    # Spark writes file:/x where Hadoop's URI says file:///x: compare the paths alone.
    path = F.regexp_replace(path, r"^[A-Za-z][A-Za-z0-9+.-]*:(//[^/]*)?", "")
    inside = F.substring(path, len(prefix) + 1, 1 << 30)
    # The paths are URI-encoded; url_decode would turn a literal "+" into a space.
    decoded = F.try_url_decode(F.replace(inside, F.lit("+"), F.lit("%2B")))
    return F.when(path.startswith(prefix), F.coalesce(decoded, inside)).otherwise(path)


def _reader(spark: SparkSession, suffix: str) -> DataFrameReader:
    # recursiveFileLookup: every file below the folder, and no partition columns from the
    # date=... folders; hidden names (".x", "_x") are skipped as everywhere in Spark.
    return spark.read.option("recursiveFileLookup", "true").option("pathGlobFilter", f"*{suffix}")


def _json_lines(spark: SparkSession, input_path: str, prefix: str) -> DataFrame:
    from pyspark.sql import functions as F

    text = _reader(spark, ".jsonl").text(input_path)
    lines = text.select(
        F.col("_metadata.file_path").alias("path"),
        F.col("_metadata.file_block_start").alias("block"),
        # In the scan's own stage (nondeterministic expressions are never moved), so the
        # ids follow the lines as the task reads them.
        F.monotonically_increasing_id().alias("id"),
        F.col("value"),
    )
    parsed = lines.withColumn(
        "e",
        F.from_json(
            "value",
            f"{EVENT_SCHEMA}, `{CORRUPT}` string",
            {"columnNameOfCorruptRecord": CORRUPT},
        ),
    ).withColumn("ts", F.col("e.ts").try_cast("timestamp"))
    blank = F.trim(F.col("value")) == ""
    classified = _classified(parsed, F.col("value"))
    return classified.select(
        "path",
        "block",
        "id",
        F.when(blank, F.lit("blank")).otherwise(F.col("kind")).alias("kind"),
        "detail",
        *_event_columns(),
    )


def _parquet(spark: SparkSession, input_path: str) -> DataFrame:
    from pyspark.sql import functions as F

    table = _reader(spark, ".parquet").schema(PARQUET_SCHEMA).parquet(input_path)

    def string_keys(name: str) -> Column:
        return F.transform_keys(F.col(name), lambda k, _: k.cast("string"))

    e = F.struct(
        F.col("schema").cast("string").alias("schema"),
        F.lit(None).cast("string").alias("ts"),
        *[F.col(c) for c in ("namespace", "group", "generation", "epoch", "leader", "reason")],
        *[F.col(c) for c in ("strategy", "members")],
        string_keys("assignment").alias("assignment"),
        F.col("moved").cast("array<struct<partition:bigint,from:string,to:string>>").alias("moved"),
        string_keys("handover_ms").alias("handover_ms"),
        string_keys("loads").alias("loads"),
    )
    typed = table.select(
        F.col("_metadata.file_path").alias("path"),
        F.lit(0).cast("bigint").alias("block"),
        # A Parquet row's line is its 1-based place in the file.
        (F.col("_metadata.row_index") + 1).alias("id"),
        e.alias("e"),
        F.col("ts"),
    )
    return _classified(typed, None).select(
        "path", "block", "id", "kind", "detail", *_event_columns()
    )


def read_rows(
    spark: SparkSession, input_path: str, keep: Callable[[DataFrame], DataFrame]
) -> tuple[DataFrame, list[str]]:
    """Every line of every ``*.jsonl`` and row of every ``*.parquet`` below ``input_path``
    as one row of ROW_COLUMNS (blank lines left out), and the files read. ``keep``
    persists the parsed lines, which the line numbering reads twice."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    # Duplicate keys in a JSON object: the last one wins, as in Python (Spark's default is
    # to fail the job).
    spark.conf.set("spark.sql.mapKeyDedupPolicy", "LAST_WIN")
    prefix, single = _root_prefix(spark, input_path)
    json_rows = _json_lines(spark, input_path, prefix)
    parquet_rows = _parquet(spark, input_path)
    # Before persisting: a cached plan no longer lists its files.
    files = [*json_rows.inputFiles(), *parquet_rows.inputFiles()]
    json_rows = keep(json_rows)

    # Line numbers of JSON lines: lines per split, and the first id of each split.
    splits = json_rows.groupBy("path", "block").agg(
        F.count("*").alias("n"), F.min("id").alias("first")
    )
    before = Window.partitionBy("path").orderBy("block").rowsBetween(Window.unboundedPreceding, -1)
    splits = splits.withColumn("base", F.coalesce(F.sum("n").over(before), F.lit(0)))
    numbered = json_rows.join(F.broadcast(splits), ["path", "block"]).withColumn(
        "line", F.col("base") + F.col("id") - F.col("first") + 1
    )
    rows = numbered.drop("n", "first", "base", "id").unionByName(
        parquet_rows.withColumnRenamed("id", "line")
    )
    file = (
        F.element_at(F.split(F.col("path"), "/"), -1)
        if single
        else _relative(F.col("path"), prefix)
    )
    rows = rows.filter(F.col("kind").isNull() | (F.col("kind") != "blank")).withColumn("file", file)
    return rows.select(*ROW_COLUMNS), files
