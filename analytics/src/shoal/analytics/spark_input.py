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
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shoal.analytics.ingest import ROW_COLUMNS
from shoal.analytics.layout import PARQUET_PATTERN, SUFFIX, InputError, is_parquet
from shoal.contracts.events import REASONS, SCHEMA_VERSION, STRATEGIES

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, DataFrameReader, SparkSession

__all__ = [
    "CORRUPT",
    "EVENT_FIELDS",
    "EVENT_SCHEMA",
    "line_splits",
    "numbered",
    "parsed_lines",
    "read_rows",
]

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
# What Python's bytes.strip() strips (ingest.parse_file's blank lines), \n aside.
_WHITESPACE = " \t\r\x0b\x0c"


def _has_null(values: Column) -> Column:
    """Whether the array holds a null. Not ``array_compact``: that is a ``filter`` with a
    lambda, interpreted per element; an ascending sort puts the nulls first, in code."""
    from pyspark.sql import functions as F

    first = F.try_element_at(F.sort_array(values), F.lit(1))
    return F.coalesce(first.isNull() & (F.size(values) > 0), F.lit(False))


def _has_null_or(values: Column, bad: Column | float | str) -> Column:
    """Whether the array holds a null or the value ``bad`` (false for a null array), where
    ``bad`` is refused anyway: one pass in code, no sort. ``arrays_overlap`` with
    ``[bad]`` is true where ``bad`` is in the array, null where it is not but a null is.
    (:func:`_has_null` sorted every array of 128 strings or numbers per line: sorts were
    a tenth of the parse's samples.)"""
    from pyspark.sql import Column
    from pyspark.sql import functions as F

    sentinel = bad if isinstance(bad, Column) else F.lit(bad)
    return F.coalesce(F.arrays_overlap(values, F.array(sentinel)), values.isNotNull())


def _bad_keys(keys: Column) -> Column:
    """Partition keys (already cast to int, null where not a number) that pydantic refuses."""
    from pyspark.sql import functions as F

    return _has_null_or(keys, -1) | (F.coalesce(F.array_min(keys), F.lit(0)) < 0)


def _bad_amounts(values: Column) -> Column:
    """Hand-over times or loads that are not all finite and >= 0 (NaN sorts above all)."""
    from pyspark.sql import functions as F

    top = F.array_max(values)
    return (
        _has_null_or(values, -1.0)
        | F.isnan(top)
        | (top == float("inf"))
        | (F.coalesce(F.array_min(values), F.lit(0.0)) < 0)
    )


def _empty_text(values: Column) -> Column:
    return _has_null_or(values, "")


def _bad_moves(moved: Column) -> Column:
    from pyspark.sql import functions as F

    # A move of partition -1 is refused anyway.
    refused = F.struct(
        F.lit(-1).cast("bigint").alias("partition"),
        F.lit("").alias("from"),
        F.lit("").alias("to"),
    )
    return moved.isNotNull() & (
        _has_null_or(moved, refused)
        | _bad_keys(moved["partition"])
        | _empty_text(moved["from"])
        | _empty_text(moved["to"])
    )


# Only built-in array functions below: Spark's lambdas (transform, exists, array_sort with
# a comparator) are interpreted row by row and made the first version 10x slower.
def _map_columns(e: Column) -> dict[str, Column]:
    """The flat nested columns (see :func:`_problems`) of a parsed event ``e`` whose maps
    and moves are typed: map keys cast to partition numbers, values, moves."""
    from pyspark.sql import functions as F

    columns = {}
    for name, prefix in (("assignment", "a"), ("handover_ms", "h"), ("loads", "l")):
        columns[f"{prefix}_keys"] = F.map_keys(e[name]).try_cast("array<int>")
        columns[f"{prefix}_values"] = F.map_values(e[name])
    columns["moved_n"] = F.size(e["moved"]).cast("int")
    columns["moved_bad"] = _bad_moves(e["moved"])
    return columns


def _problems(e: Column, ts: Column) -> list[tuple[str, Column]]:
    """(field, is it invalid) in the model's field order: pydantic reports the first.
    ``e`` holds the scalar fields; the nested ones are the flat columns ``a_keys`` and
    ``a_values`` (assignment), ``h_...`` (hand-over times), ``l_...`` (loads), null where
    the field is missing, and ``moved_bad``."""
    from pyspark.sql import functions as F

    col = F.col

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
        ("members", e["members"].isNull() | _has_null(e["members"])),
        (
            "assignment",
            col("a_keys").isNull() | _bad_keys(col("a_keys")) | _empty_text(col("a_values")),
        ),
        ("moved", col("moved_bad")),
        (
            "handover_ms",
            col("h_keys").isNotNull() & (_bad_keys(col("h_keys")) | _bad_amounts(col("h_values"))),
        ),
        (
            "loads",
            col("l_keys").isNotNull() & (_bad_keys(col("l_keys")) | _bad_amounts(col("l_values"))),
        ),
    ]


def _classified(frame: DataFrame, raw: Column | None) -> DataFrame:
    """``kind`` and ``detail`` of each parsed line (``e``, ``ts`` and the flat nested columns
    of :func:`_problems`; ``raw`` the line's text if JSON, with ``corrupt`` true where the
    parser found no schema-1 object)."""
    from pyspark.sql import functions as F

    e, ts = F.col("e"), F.col("ts")
    version = e["schema"].cast("string")
    expected = str(SCHEMA_VERSION)
    unknown = version.isNotNull() & (version != expected)
    field_problem = F.coalesce(
        *[F.when(bad, F.lit(f"{name}: missing or invalid")) for name, bad in _problems(e, ts)]
    )
    frame = frame.withColumn("problem", field_problem)
    problem = F.col("problem")
    kind = F.when(unknown, "unknown_schema").when(problem.isNotNull(), "malformed")
    detail = F.when(
        unknown, F.concat(F.lit("schema "), version, F.lit(f" (this reader knows {expected})"))
    ).otherwise(problem)
    if raw is not None:
        corrupt = F.col("corrupt")
        # Only the few corrupt lines pay for a second look: pydantic's order is "not JSON",
        # "not a JSON object", a schema other than 1, then the fields.
        # Guarded by corrupt even where only used under it: their_version is used twice,
        # so Spark computes it once for every row (subexpression elimination) unless
        # the expression itself is conditional; unguarded it was a second parse of
        # every line.
        whole_value = F.when(corrupt, F.get_json_object(raw, "$"))
        their_version = F.when(corrupt, F.get_json_object(raw, "$.schema"))
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


def _sorted_pairs(keys: Column, values: Column) -> tuple[Column, Column]:
    """Keys sorted, and the values in their order. Writers sort the maps already: then a
    sort of the keys alone (integers) shows it, and the values stay as they are; sorting
    (key, value) structs costs far more."""
    from pyspark.sql import functions as F

    ordered = F.sort_array(keys)
    pairs = F.sort_array(F.arrays_zip(keys.alias("k"), values.alias("v")))
    return ordered, F.when(keys == ordered, values).otherwise(pairs["v"])


def _event_columns(frame: DataFrame) -> DataFrame:
    """The flat event columns of ROW_COLUMNS (valid rows; others get nulls)."""
    from pyspark.sql import functions as F

    col, e, ok = F.col, F.col("e"), F.col("kind").isNull()
    parts, owners = _sorted_pairs(col("a_keys"), col("a_values"))
    l_parts, l_values = _sorted_pairs(col("l_keys"), col("l_values"))
    frame = frame.withColumns(
        {"parts": parts, "owners": owners, "l_parts": l_parts, "l_sorted": l_values}
    )
    # Loads usually name exactly the assigned partitions: then they line up as they are.
    # Otherwise (rare) a lookup per partition, 0 for partitions without a load.
    lookup = F.transform(
        col("parts"),
        lambda p: F.coalesce(
            F.element_at(F.map_from_arrays(col("l_parts"), col("l_sorted")), p),
            F.lit(0.0),
        ),
    )
    has_loads = F.coalesce(F.size(col("l_keys")), F.lit(0)) > 0
    loads = (
        F.when(~has_loads, F.array_repeat(F.lit(0.0), F.size(col("parts"))))
        .when(col("l_parts") == col("parts"), col("l_sorted"))
        .otherwise(lookup)
    )

    def when_ok(value: Column, name: str) -> Column:
        return F.when(ok, value).alias(name)

    return frame.select(
        "path",
        "block",
        "id",
        "kind",
        "detail",
        when_ok(e["namespace"], "namespace"),
        when_ok(e["group"], "group"),
        when_ok(e["generation"], "generation"),
        when_ok(e["epoch"], "epoch"),
        when_ok(F.unix_micros(F.col("ts")), "ts_us"),
        when_ok(e["leader"], "leader"),
        when_ok(e["reason"], "reason"),
        when_ok(F.coalesce(e["strategy"], F.lit("sticky")), "strategy"),
        when_ok(F.sort_array(F.array_distinct(e["members"])), "members"),
        when_ok(col("parts"), "parts"),
        when_ok(col("owners"), "owners"),
        when_ok(loads.cast("array<double>"), "loads"),
        when_ok(has_loads, "has_loads"),
        when_ok(F.coalesce(col("h_values"), F.array().cast("array<double>")), "handover"),
        when_ok(F.coalesce(col("moved_n"), F.lit(0)), "moved_recorded"),
    )


def _qualified(spark: SparkSession, path: str) -> tuple[Any, Any]:
    """Hadoop's file system of ``path`` and the path qualified (scheme, authority)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    fs = hadoop_path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    return fs, fs.makeQualified(hadoop_path)


def _root_prefix(spark: SparkSession, input_path: str) -> tuple[str, bool]:
    """The input folder's URI-encoded path without scheme and authority (``/tmp/logs/``), and
    whether the input is a single file (named by its base name, as the pandas engine
    does). An input that does not exist is an :class:`InputError`."""
    fs, qualified = _qualified(spark, input_path)
    if not fs.exists(qualified):
        raise InputError(f"input {input_path} does not exist")
    single = bool(fs.getFileStatus(qualified).isFile())
    root = qualified.getParent() if single else qualified
    return str(root.toUri().getRawPath()).rstrip("/") + "/", single


def _below(spark: SparkSession, input_path: str, folder: str) -> str | None:
    """``folder``'s URI-encoded path without scheme and authority (``/tmp/logs/report/``)
    if it lies below the input folder on the same file system, else None."""
    _, root = _qualified(spark, input_path)
    _, inner = _qualified(spark, folder)
    root_uri, inner_uri = root.toUri(), inner.toUri()
    same = (root_uri.getScheme(), root_uri.getAuthority()) == (
        inner_uri.getScheme(),
        inner_uri.getAuthority(),
    )
    root_path = str(root_uri.getRawPath()).rstrip("/") + "/"
    inner_path = str(inner_uri.getRawPath()).rstrip("/") + "/"
    return inner_path if same and inner_path.startswith(root_path) else None


def _glob_escaped(path: str) -> str:
    """``path`` with Hadoop's glob characters escaped: Spark globs the paths it reads, so a
    folder named ``logs [prod]`` was "not found"."""
    return "".join("\\" + c if c in "\\[]{}*?" else c for c in path)


def _without_scheme(path: Column) -> Column:
    """A file's URI path alone: Spark writes file:/x where Hadoop's URI says file:///x."""
    from pyspark.sql import functions as F

    return F.regexp_replace(path, r"^[A-Za-z][A-Za-z0-9+.-]*:(//[^/]*)?", "")


def _path_of(uri: str) -> str:
    """What :func:`_without_scheme` keeps of a URI, in Python."""
    return re.sub(r"^[A-Za-z][A-Za-z0-9+.-]*:(//[^/]*)?", "", uri)


def _decoded(path: Column) -> Column:
    """A URI-encoded path (or part of one) decoded; as it is where it does not decode."""
    from pyspark.sql import functions as F

    # url_decode would turn a literal "+" into a space.
    decoded = F.try_url_decode(F.replace(path, F.lit("+"), F.lit("%2B")))
    return F.coalesce(decoded, path)


def _relative(path: Column, prefix: str) -> Column:
    """``file`` of a row: its path relative to the input folder, decoded, ``/``-separated."""
    from pyspark.sql import functions as F

    path = _without_scheme(path)
    inside = F.substring(path, len(prefix) + 1, 1 << 30)
    return F.when(path.startswith(prefix), _decoded(inside)).otherwise(path)


def _reader(spark: SparkSession, pattern: str | None) -> DataFrameReader:
    # recursiveFileLookup: every file below the folder, and no partition columns from the
    # date=... folders; hidden names (".x", "_x") are skipped as everywhere in Spark.
    # pathGlobFilter applies to a single file too: None for a file given as the input.
    reader = spark.read.option("recursiveFileLookup", "true")
    return reader if pattern is None else reader.option("pathGlobFilter", pattern)


def _json_lines(spark: SparkSession, input_path: str, pattern: str | None) -> DataFrame:
    from pyspark.sql import functions as F

    # Lines end at \n only (Spark's default also splits at a lone \r), as in
    # ingest.parse_file, which also drops a \r before the \n.
    text = _reader(spark, pattern).option("lineSep", "\n").text(_glob_escaped(input_path))
    lines = text.select(
        F.col("_metadata.file_path").alias("path"),
        F.col("_metadata.file_block_start").alias("block"),
        # In the scan's own stage (nondeterministic expressions are never moved), so the
        # ids follow the lines as the task reads them.
        F.monotonically_increasing_id().alias("id"),
        F.rtrim("value", F.lit("\r")).alias("value"),
    )
    schema = f"{EVENT_SCHEMA}, `{CORRUPT}` string"
    e = F.from_json("value", schema, {"columnNameOfCorruptRecord": CORRUPT})
    parsed = lines.withColumn("e", e)
    parsed = parsed.withColumns(
        {
            **_map_columns(F.col("e")),
            "ts": F.col("e.ts").try_cast("timestamp"),
            "corrupt": F.col("e")[CORRUPT].isNotNull(),
        }
    )
    # Blank as Python's bytes.strip() sees it: any ASCII whitespace, not only spaces.
    blank = F.trim(F.col("value"), F.lit(_WHITESPACE)) == ""
    classified = _classified(parsed, F.col("value"))
    classified = classified.withColumn(
        "kind", F.when(blank, F.lit("blank")).otherwise(F.col("kind"))
    )
    return _event_columns(classified)


def _parquet_table(spark: SparkSession, input_path: str, pattern: str | None) -> DataFrame:
    reader = _reader(spark, pattern).schema(PARQUET_SCHEMA)
    return reader.parquet(_glob_escaped(input_path))


def _parquet(table: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

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
    typed = typed.withColumns(_map_columns(F.col("e")))
    return _event_columns(_classified(typed, None))


def parsed_lines(
    spark: SparkSession, input_path: str, exclude: str | None = None
) -> tuple[DataFrame, list[str]]:
    """Every line of every ``*.jsonl`` and row of every Parquet export (``part-*.parquet``)
    below ``input_path`` but not below ``exclude`` (the report's output folder), or of the
    file ``input_path`` (Parquet if named ``*.parquet``, else JSON lines), blank lines
    included (``kind`` "blank"), as the columns of ROW_COLUMNS without ``line`` plus where
    the line is (``path``, ``block``: its split, ``id``: its place in the split's task),
    and the files read. ``(file, block, id)`` sorts the lines in read order;
    :func:`numbered` gives them their line numbers."""
    from pyspark.sql import functions as F

    # Duplicate keys in a JSON object: the last one wins, as in Python (Spark's default is
    # to fail the job).
    spark.conf.set("spark.sql.mapKeyDedupPolicy", "LAST_WIN")
    prefix, single = _root_prefix(spark, input_path)
    parquet_input = single and is_parquet(input_path.rstrip("/"))
    # The output folder's files (a previous report's tables are part-*.parquet too) are
    # left out of the listing: Spark prunes files by a filter on _metadata.file_path.
    skip = None if single or exclude is None else _below(spark, input_path, exclude)
    json_rows: DataFrame | None = None
    files: list[str] = []
    if not parquet_input:
        json_rows = _json_lines(spark, input_path, None if single else f"*{SUFFIX}")
        files += json_rows.inputFiles()
    if single and not parquet_input:
        parquet_files: list[str] = []
    else:
        parquet_table = _parquet_table(spark, input_path, None if single else PARQUET_PATTERN)
        # Before persisting: a cached plan no longer lists its files.
        parquet_files = parquet_table.inputFiles()
        if skip is not None:
            parquet_table = parquet_table.filter(
                ~_without_scheme(F.col("_metadata.file_path")).startswith(skip)
            )
            parquet_files = [f for f in parquet_files if not _path_of(f).startswith(skip)]
        files += parquet_files
    file = (
        _decoded(F.element_at(F.split(F.col("path"), "/"), -1))
        if single
        else _relative(F.col("path"), prefix)
    )
    if parquet_files or json_rows is None:
        # A Parquet file is one "split" whose ids are its 1-based row numbers.
        parquet_rows = _parquet(parquet_table)
        json_rows = parquet_rows if json_rows is None else json_rows.unionByName(parquet_rows)
    # Without Parquet files, no Parquet branch: its expressions took 0.8 s to build over
    # Py4J, and every later step analyzed them again.
    lines = json_rows.withColumn("file", file)
    columns = [c for c in ROW_COLUMNS if c != "line"]
    return lines.select("path", "block", "id", *columns), files


def line_splits(lines: DataFrame) -> DataFrame:
    """Per split (``path``, ``block``) of :func:`parsed_lines`: its first id and the lines
    of the file's splits before it (a few rows per file)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    splits = lines.groupBy("path", "block").agg(F.count("*").alias("n"), F.min("id").alias("first"))
    before = Window.partitionBy("path").orderBy("block").rowsBetween(Window.unboundedPreceding, -1)
    base = F.coalesce(F.sum("n").over(before), F.lit(0))
    return splits.select("path", "block", "first", base.alias("base"))


def numbered(frame: DataFrame, splits: DataFrame) -> DataFrame:
    """``frame`` (rows of :func:`parsed_lines`) with its 1-based ``line``: the lines before
    its split plus the distance to the split's first id (ids are consecutive within a task,
    and a task reads its splits one after the other)."""
    from pyspark.sql import functions as F

    joined = frame.join(F.broadcast(splits), ["path", "block"])
    line = F.col("base") + F.col("id") - F.col("first") + 1
    return joined.withColumn("line", line).drop("first", "base")


def read_rows(
    spark: SparkSession,
    input_path: str,
    keep: Callable[[DataFrame], DataFrame],
) -> tuple[DataFrame, list[str]]:
    """Every line of every ``*.jsonl`` and row of every ``*.parquet`` below ``input_path``
    as one row of ROW_COLUMNS (blank lines left out), and the files read. ``keep``
    persists the parsed lines, which the line numbering reads twice."""
    from pyspark.sql import functions as F

    lines, files = parsed_lines(spark, input_path)
    lines = keep(lines)
    rows = numbered(lines, line_splits(lines))
    rows = rows.filter(F.col("kind").isNull() | (F.col("kind") != "blank"))
    return rows.select(*ROW_COLUMNS), files
