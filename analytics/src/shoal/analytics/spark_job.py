"""The skew and churn report as a PySpark job.

    spark-submit --master spark://host:7077 analytics/src/shoal/analytics/spark_job.py \
        --input DIR --out DIR

or ``shoal-analytics report`` (``local[*]`` unless ``--master``). Only the driver runs
Python (it needs ``shoal`` installed); executors run Spark's own readers and SQL functions.
On a cluster the input and output paths must be visible to every executor (a shared mount,
NFS, ...).

The pipeline, in Spark terms (metric definitions: :mod:`shoal.analytics.metrics`):

1. :func:`shoal.analytics.spark_input.parsed_lines`: the text source reads every
   ``*.jsonl`` in splits, ``from_json`` parses each line with the explicit schema, SQL
   expressions classify bad lines; ``*.parquet`` comes from the Parquet source. Each line
   keeps where it is (path, split, id in the task); line numbers are computed only for
   the problems (:func:`shoal.analytics.spark_input.numbered`).
2. :func:`_paired`: one window per group in read order, over every line (one hash shuffle
   of the wide rows on the group): out of order or not, the index, and the previous used
   event's time, partitions and owners beside each event. This is the only checkpoint of
   the input: the parse runs once, in this job.
3. :func:`_pairs` explodes each event into one row per ownership with its previous owner
   (:func:`_prev_owners`) and aggregates them per (previous owner, owner) inside the task
   that holds the event: the ownership rows are never shuffled or kept.
4. Member counts, generations, churn: aggregations, joins and windows over frames that
   all stay hash-partitioned by group (:data:`SQL_CONF`), so they sort but never shuffle.
   Stints (:func:`_ownership`): only the positions of each event whose owner changed are
   exploded, and one ``lead`` per (group, partition) over those starts, the drops and the
   last generation closes each stint; sorted by the table's keys, written without a
   checkpoint.
5. The big tables are written as Parquet by the executors, the small ones collected. These
   steps, after the checkpoints, are submitted from three driver threads at once
   (:func:`shoal.analytics.report._spark_data`): Spark runs the jobs' tasks in submission
   order on the same cores, and one job's planning, Arrow transfer and pandas work overlap
   another's tasks. The plots drawn from the generations table alone are drawn in a
   thread of their own as soon as it is collected.

Intermediate frames are eager *local checkpoints* (:class:`_Keeper`), not ``persist()``:
a checkpoint is a scan of stored rows without lineage, so the actions after it plan a few
operators instead of the whole input parse. (On a cluster a lost executor loses its
checkpoint blocks and fails the job, where a persisted frame would be recomputed; a
report is cheap to rerun.)

The measurements behind these choices, what paid and what did not, session by session:
the analytics report entries of ``docs/journal/``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shoal.analytics.cli import main as cli
from shoal.analytics.ingest import PROBLEM_KINDS
from shoal.analytics.spark_input import line_splits, numbered, parsed_lines
from shoal.analytics.tables import COLUMNS, KEYS, normalize

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = ["SparkReport", "compute", "main"]

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
# Memory first, as JVM objects (pyspark's MEMORY_AND_DISK is the serialized kind: every
# checkpoint paid for Java serialization and LZ4 of each row), disk when memory runs out.
KEPT_ARGS = (True, True, False, True)
GEN_KEYS = ["namespace", "group", "generation"]
# Set on the session by compute(). Everything after the pairing of events is partitioned
# by group, and should stay so, with sorts but no shuffles:
# - without adaptive execution a checkpoint keeps its plan's partitioning (with it, the
#   plan is not final when checkpointed, and the partitioning is lost: every aggregation
#   and join over a checkpoint shuffled again);
# - joins on (group, generation) of two sides hashed on the group need no shuffle.
# Adaptive execution would also re-plan each of the report's some 60 stages, for little
# gain at this size: the row counts after the parse are known and small.
#
# HotSpot does not JIT-compile a method of over 8000 bytes of bytecode (its
# DontCompileHugeMethods), and the whole-stage code of the parse (from_json, a dozen checks
# per line, the flattening) is bigger: it ran interpreted. With the limit at 8000, Spark
# falls back to code per operator, in methods the JIT compiles: the classification of 2M
# parsed lines 2.7 s -> 1.2 s warm, 3.4 s -> 2.0 s cold.
SQL_CONF = {
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.requireAllClusterKeysForCoPartition": "false",
    "spark.sql.codegen.hugeMethodLimit": "8000",
}
GROUP_KEYS = ["namespace", "group"]
PARTITIONS_PER_CORE = 16


def _ratio(moves: Column, minimum: Column) -> Column:
    from pyspark.sql import functions as F

    return (
        F.when(minimum == 0, F.when(moves == 0, F.lit(1.0)))
        .otherwise(moves.cast("double") / minimum.cast("double"))
        .alias("churn_ratio")
    )


def _percentile(ordered: Column, q: float) -> Column:
    """The exact percentile of a sorted array, interpolated between the closest ranks as
    Spark's ``percentile`` and :func:`shoal.analytics.metrics.percentile` do; null for an
    empty array. Per generation this replaces an aggregation over the exploded values."""
    from pyspark.sql import functions as F

    n = F.size(ordered)
    position = F.lit(q) * (n - 1)
    low = F.floor(position).cast("int")
    high = F.least(low + 1, n - 1)
    below = F.try_element_at(ordered, low + 1)
    above = F.try_element_at(ordered, high + 1)
    return F.when(n > 0, below + (above - below) * (position - low))


@dataclass
class SparkReport:
    """Lazy DataFrames of every table (see :mod:`shoal.analytics.tables`), plus what the
    HTML report samples from and the input counts read from."""

    tables: dict[str, DataFrame]
    files: list[str]
    lines: DataFrame
    handover: DataFrame
    cached: list[DataFrame]
    # The groups table over a given stints frame (the ownership table once written).
    groups_of: Callable[[DataFrame], DataFrame]
    # Wall time of each checkpoint, in the order taken.
    kept_s: list[tuple[str, float]] = field(default_factory=list)

    def written(self, name: str, frame: DataFrame) -> None:
        """``frame`` reads table ``name`` back from where it was written. The stints are
        not kept (millions of rows under modulo: storing them cost as much as computing
        them); the groups' stint figures read the written columns instead. The member
        totals of the plots read the written churn (not its window again)."""
        self.tables[name] = frame.select(*COLUMNS[name])
        if name == "ownership":
            self.tables["groups"] = self.groups_of(frame).select(*COLUMNS["groups"])

    def unpersist(self) -> None:
        # Local checkpoints are RDD blocks of their own; dropping them frees the memory
        # at once instead of whenever the context cleaner notices.
        for frame in self.cached:
            frame.rdd.unpersist()


class _Keeper:
    """Eager local checkpoints, timed. Not ``persist()``: the frame that comes back is a
    scan of stored rows with no lineage. With persist() every later action planned the
    whole input parse again, once per cached plan it was matched against: a third of the
    report's time at 2M rows went to planning, not to running. A checkpoint keeps its
    plan's partitioning, so frames partitioned by group stay so without a shuffle."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self.cached: list[DataFrame] = []
        self.times: list[tuple[str, float]] = []

    def __call__(self, frame: DataFrame, name: str) -> DataFrame:
        from pyspark import StorageLevel

        started = time.monotonic()
        # Named in Spark's UI and event log (this thread's jobs), as the report's steps are;
        # cleared after, so that later jobs on a caller's session are not named after it.
        sc = frame.sparkSession.sparkContext
        sc.setJobDescription(f"shoal: keep {name}")
        try:
            kept = frame.localCheckpoint(eager=True, storageLevel=StorageLevel(*KEPT_ARGS))
        finally:
            sc.setJobDescription(None)  # type: ignore[arg-type]
        self.cached.append(kept)
        self.times.append((name, time.monotonic() - started))
        if self.progress is not None:
            self.progress(f"spark: kept {name} ({self.times[-1][1]:.1f} s)")
        return kept


def _spread(lines: DataFrame) -> DataFrame:
    """The lines hashed on their group into many more partitions than cores. Every step
    after the pairing runs in these partitions, a group in one task: with as many
    partitions as groups, hashing put the bench's 8 groups 4+2+1+1 (one task did half of
    every step, the second core idled); with 16 per core they rarely share one."""
    spark = lines.sparkSession
    cores = spark.sparkContext.defaultParallelism
    configured = int(spark.conf.get("spark.sql.shuffle.partitions") or 0)
    return lines.repartition(max(configured, PARTITIONS_PER_CORE * cores), *GROUP_KEYS)


def _paired(lines: DataFrame) -> DataFrame:
    """Every line (rows of ``parsed_lines``) with, for the valid events, from one pass over
    their group in read order (one shuffle of the wide rows, hashed on the group): ``late``
    (out of order: not above every earlier generation), and for the events used:
    ``index``, ``prev_generation``, ``prev_ts_us``, the previous used event's ``prev_parts``
    and ``prev_owners``, ``is_last`` and the group's last used time ``group_last_us``.

    Used events have increasing generations in read order, so the previous used event is
    the last earlier one not late, and its generation is the highest earlier one. Other
    lines have no group: they share a window partition of their own, whose figures mean
    nothing. They come along so that this is the only frame kept of the input: the parse
    runs once, in this job, and its wide rows are materialized once."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    col = F.col
    read = Window.partitionBy(*GROUP_KEYS).orderBy("file", "block", "id")
    earlier = read.rowsBetween(Window.unboundedPreceding, -1)
    so_far = read.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    whole = read.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
    prior = F.max("generation").over(earlier)
    out_of_order = F.coalesce(col("generation") <= col("prev_generation"), F.lit(False))
    flagged = (
        _spread(lines)
        .withColumn("prev_generation", prior)
        .withColumn("late", col("kind").isNull() & out_of_order)
    )
    used = ~col("late")

    def previous(name: str) -> Column:
        return F.last(F.when(used, col(name)), ignorenulls=True).over(earlier)

    return flagged.select(
        "*",
        F.count(F.when(used, 1)).over(so_far).alias("index"),
        previous("ts_us").alias("prev_ts_us"),
        previous("parts").alias("prev_parts"),
        previous("owners").alias("prev_owners"),
        (used & (col("generation") == F.max("generation").over(whole))).alias("is_last"),
        F.last(F.when(used, col("ts_us")), ignorenulls=True).over(whole).alias("group_last_us"),
    )


def _facts(ev: DataFrame) -> DataFrame:
    """Per used event, everything but the ownership arrays."""
    from pyspark.sql import functions as F

    col = F.col
    # Sorted once in a projection of its own: inlined, each of the dozen references in the
    # percentiles sorted again (1.3 s of a 2M-row report, where the rest takes 0.1 s).
    ev = ev.withColumn("handover", F.sort_array("handover"))
    ordered = col("handover")
    return ev.select(
        *GEN_KEYS,
        col("index").cast("long").alias("index"),
        "ts_us",
        "prev_generation",
        "prev_ts_us",
        "epoch",
        "leader",
        "reason",
        "strategy",
        "members",
        F.size("members").alias("n"),
        F.size("parts").alias("P"),
        "has_loads",
        "moved_recorded",
        F.size("handover").cast("long").alias("handovers"),
        *[_percentile(ordered, q).alias(f"handover_p{round(q * 100)}") for q in (0.5, 0.9, 0.99)],
        F.array_max("handover").alias("handover_max"),
        "is_last",
        "group_last_us",
    )


def _prev_owners(ev: DataFrame) -> Column:
    """Per used event, the owner in the previous used event of each of its partitions
    (null where the partition is new; empty for a group's first event). Writers list the
    same partitions in every generation: then the previous owners line up with this
    generation's partitions as they are; otherwise (rare) a lookup per partition."""
    from pyspark.sql import functions as F

    col = F.col
    looked_up = F.transform(
        col("parts"),
        lambda p: F.try_element_at(F.map_from_arrays(col("prev_parts"), col("prev_owners")), p),
    )
    return (
        F.when(col("prev_parts").isNull(), F.array().cast("array<string>"))
        .when(col("prev_parts") == col("parts"), col("prev_owners"))
        .otherwise(looked_up)
    )


def _pairs(ev: DataFrame) -> DataFrame:
    """Partitions and their load per (previous owner, owner) pair and used event: owner
    counts, loads, moves, holdings and churn all follow from these few rows. Each event is
    exploded into one row per ownership and aggregated inside the task that holds it (the
    frame is partitioned by group): the ownership rows are never shuffled or kept."""
    from pyspark.sql import functions as F

    col = F.col
    owned = ev.select(
        *GEN_KEYS,
        F.inline(
            F.arrays_zip(
                col("owners").alias("owner"),
                col("loads").alias("load"),
                col("prev_owner").alias("prev_owner"),
            )
        ),
    )
    return owned.groupBy(*GEN_KEYS, "owner", "prev_owner").agg(
        F.count("*").alias("count"), F.sum("load").alias("load_sum")
    )


def _ownership(ev: DataFrame) -> DataFrame:
    """Stints. One starts wherever a partition is new or moved (only those positions of
    each event are exploded: under sticky a few per generation). A stint ends where the
    next row of its partition, in group order, says so: the next start if a move (the
    stint's last generation is the one before), a drop (the partition left in the next
    generation), or the group's last generation (still open). One window per (group,
    partition) with ``lead`` over the starts and those ends; the moves' ends are the
    starts themselves, so the window sorts about one row per stint."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    col = F.col
    changed = F.filter(
        F.arrays_zip(
            col("parts").alias("partition"),
            col("owners").alias("member"),
            col("prev_owner").alias("before"),
        ),
        lambda x: x["before"].isNull() | (x["before"] != x["member"]),
    )
    starts = ev.select(
        *GROUP_KEYS,
        "generation",
        "index",
        "ts_us",
        "prev_generation",
        F.inline(changed),
    ).select(
        *GROUP_KEYS,
        "partition",
        col("index").alias("at"),
        F.lit(0).alias("side"),
        "member",
        col("generation").alias("first_generation"),
        col("ts_us").alias("start_us"),
        # What this row ends: the partition's stint before a move.
        F.when(col("before").isNotNull(), col("prev_generation")).alias("end_generation"),
        (col("index") - 1).alias("end_at"),
        col("ts_us").alias("end_us"),
    )
    dropped = ev.filter(col("prev_parts").isNotNull() & (col("prev_parts") != col("parts")))
    dropped = dropped.select(
        *GROUP_KEYS,
        F.explode(F.array_except("prev_parts", "parts")).alias("partition"),
        (col("index") - 1).alias("at"),
        col("prev_generation").alias("end_generation"),
        col("ts_us").alias("end_us"),
    )
    last = ev.filter("is_last").select(
        *GROUP_KEYS,
        F.explode("parts").alias("partition"),
        col("index").alias("at"),
        col("generation").alias("end_generation"),
        col("ts_us").alias("end_us"),
    )

    def ends(frame: DataFrame, ended: bool) -> DataFrame:
        return frame.select(
            *GROUP_KEYS,
            "partition",
            "at",
            F.lit(1).alias("side"),
            F.lit(None).cast("string").alias("member"),
            # Where the row sorts: the generation of its index.
            col("end_generation").alias("first_generation"),
            F.lit(None).cast("long").alias("start_us"),
            "end_generation",
            col("at").alias("end_at"),
            "end_us",
            F.lit(ended).alias("ends_stint"),
        )

    bounds = (
        starts.withColumn("ends_stint", F.lit(True))
        .unionByName(ends(dropped, True))
        .unionByName(ends(last, False))
    )
    # Generations increase with the index in a group, so this is the order of ``at``. Sorted
    # by the table's keys (KEYS): the write needs no sort of its own.
    along = Window.partitionBy(*GROUP_KEYS, "partition").orderBy("first_generation", "side")

    def following(name: str) -> Column:
        return F.lead(name).over(along)

    stints = bounds.select(
        *GROUP_KEYS,
        "partition",
        "member",
        "first_generation",
        "at",
        "start_us",
        following("end_generation").alias("last_generation"),
        following("end_at").alias("last_at"),
        following("end_us").alias("end_us"),
        following("ends_stint").alias("ended"),
        "side",
    ).filter(col("side") == 0)
    return stints.select(
        *GROUP_KEYS,
        "partition",
        "member",
        "first_generation",
        "last_generation",
        (col("last_at") - col("at") + 1).cast("long").alias("generations"),
        F.timestamp_micros("start_us").alias("start"),
        F.timestamp_micros("end_us").alias("end"),
        ((col("end_us") - col("start_us")) / 1e6).alias("duration_s"),
        "ended",
    )


def _member_counts(pairs: DataFrame, facts: DataFrame) -> DataFrame:
    """Owner counts and loads per member and non-member owner."""
    from pyspark.sql import functions as F

    col = F.col
    owned = pairs.groupBy(*GEN_KEYS, col("owner").alias("member")).agg(
        F.sum("count").alias("owned"), F.sum("load_sum").alias("load_sum")
    )
    members = facts.select(*GEN_KEYS, F.explode("members").alias("member"))
    members = members.withColumn("is_member", F.lit(True))
    loads = facts.select(*GEN_KEYS, col("has_loads").alias("loaded"))
    return (
        owned.join(members, [*GEN_KEYS, "member"], "full_outer")
        .join(loads, GEN_KEYS)
        .select(
            *GEN_KEYS,
            "member",
            F.coalesce(col("owned"), F.lit(0)).cast("long").alias("partitions"),
            F.when(col("loaded"), F.coalesce(col("load_sum"), F.lit(0.0))).alias("load"),
            F.coalesce(col("is_member"), F.lit(False)).alias("is_member"),
        )
    )


def _minimum_parts(pairs: DataFrame, facts: DataFrame) -> DataFrame:
    """Per generation: partitions orphaned (held before by a non-member) and the members'
    excess over their quotas; the minimum moves is their sum. One pass over the holdings:
    members rank first (by holding, then name), so a member's row number is its rank
    among the members."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    col = F.col
    members = facts.select(*GEN_KEYS, F.explode("members").alias("member"))
    members = members.withColumn("is_member", F.lit(True))
    held = (
        pairs.filter(col("prev_owner").isNotNull())
        .groupBy(*GEN_KEYS, col("prev_owner").alias("member"))
        .agg(F.sum("count").alias("held"))
        .join(members, [*GEN_KEYS, "member"], "left")
        .join(facts.select(*GEN_KEYS, "n", "P"), GEN_KEYS)
    )
    ranked = Window.partitionBy(*GEN_KEYS).orderBy(
        col("is_member").desc_nulls_last(), col("held").desc(), col("member").asc()
    )
    rank = F.row_number().over(ranked)
    # Only for members: without any, n is 0.
    quota = F.when(
        col("is_member"),
        F.floor(col("P") / col("n")).cast("long")
        + F.when(rank <= F.pmod(col("P"), col("n")), 1).otherwise(0),
    )
    return (
        held.withColumn("quota", quota)
        .groupBy(*GEN_KEYS)
        .agg(
            F.sum(F.when(col("is_member").isNull(), col("held"))).alias("orphaned"),
            F.sum(F.when(col("is_member"), F.greatest(col("held") - col("quota"), F.lit(0)))).alias(
                "excess"
            ),
        )
    )


def _generations(facts: DataFrame, pairs: DataFrame, member_counts: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    col = F.col
    count_stats = member_counts.groupBy(*GEN_KEYS).agg(
        F.min("partitions").alias("min_count"),
        F.max("partitions").alias("max_count"),
        F.avg("partitions").alias("mean_count"),
        F.stddev_pop("partitions").alias("stddev_count"),
        F.max("load").alias("load_max"),
        F.avg("load").alias("load_mean"),
    )
    moved = col("prev_owner").isNotNull() & (col("prev_owner") != col("owner"))
    moves = pairs.filter(moved).groupBy(*GEN_KEYS).agg(F.sum("count").alias("moves"))
    minimum = _minimum_parts(pairs, facts)
    positive = col("mean_count") > 0
    min_moves = F.when(
        col("prev_generation").isNull() | (col("n") == 0), F.lit(0).cast("long")
    ).otherwise(F.coalesce(col("orphaned"), F.lit(0)) + F.coalesce(col("excess"), F.lit(0)))
    return (
        facts.join(count_stats, GEN_KEYS, "left")
        .join(moves, GEN_KEYS, "left")
        .join(minimum, GEN_KEYS, "left")
        .withColumn("moves", F.coalesce(col("moves"), F.lit(0)).cast("long"))
        .withColumn("min_moves", min_moves.cast("long"))
        .select(
            *GEN_KEYS,
            "index",
            F.timestamp_micros("ts_us").alias("ts"),
            "epoch",
            "leader",
            "reason",
            "strategy",
            col("n").cast("long").alias("members"),
            col("P").cast("long").alias("partitions"),
            "min_count",
            "max_count",
            "mean_count",
            "stddev_count",
            F.when(positive, col("max_count") / col("mean_count")).alias("max_over_mean"),
            F.coalesce(col("max_count") - col("min_count"), F.lit(0)).alias("skew"),
            "load_max",
            "load_mean",
            F.when(col("load_mean") > 0, col("load_max") / col("load_mean")).alias("load_skew"),
            "moves",
            col("moved_recorded").cast("long").alias("moves_recorded"),
            "min_moves",
            _ratio(col("moves"), col("min_moves")),
            "handovers",
            "handover_p50",
            "handover_p90",
            "handover_p99",
            "handover_max",
            ((col("ts_us") - col("prev_ts_us")) / 1e6).alias("interval_s"),
        )
    )


def _member_churn(pairs: DataFrame) -> DataFrame:
    """Partitions gained and lost per generation and member, and the running totals."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    col = F.col
    moved_pairs = pairs.filter(col("prev_owner").isNotNull() & (col("prev_owner") != col("owner")))
    changes = moved_pairs.select(
        *GEN_KEYS, col("owner").alias("member"), col("count").alias("g"), F.lit(0).alias("l")
    ).unionByName(
        moved_pairs.select(
            *GEN_KEYS,
            col("prev_owner").alias("member"),
            F.lit(0).alias("g"),
            col("count").alias("l"),
        )
    )
    running = (
        Window.partitionBy(*GROUP_KEYS, "member")
        .orderBy("generation")
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    return (
        changes.groupBy(*GEN_KEYS, "member")
        .agg(F.sum("g").cast("long").alias("gained"), F.sum("l").cast("long").alias("lost"))
        .withColumn("cum_gained", F.sum("gained").over(running))
        .withColumn("cum_lost", F.sum("lost").over(running))
        .withColumn("cum_moves", col("cum_gained") + col("cum_lost"))
    )


def _merged(arrays: str) -> Column:
    """The sorted union (duplicates kept) of a column of arrays, as an aggregate."""
    from pyspark.sql import functions as F

    return F.sort_array(F.flatten(F.collect_list(arrays)))


def _handover(ev: DataFrame) -> DataFrame:
    """Hand-over times per (group, strategy), sorted, in one row each: the exact
    percentiles per group and per strategy are read off sorted arrays (``percentile``
    counted millions of boxed doubles in hash maps, twice, and shuffled the maps). The
    rows are few; each is built inside the task that holds its group."""

    return ev.groupBy(*GROUP_KEYS, "strategy").agg(_merged("handover").alias("handover"))


def _groups(
    generations: DataFrame, member_counts: DataFrame, ownership: DataFrame, handover: DataFrame
) -> DataFrame:
    from pyspark.sql import functions as F

    col = F.col
    gen_ts = generations.withColumn("ts_us", F.unix_micros("ts"))
    span = (col("last_us") - col("first_us")) / 1e6
    seen = (
        member_counts.filter(col("is_member"))
        .groupBy(*GROUP_KEYS)
        .agg(F.countDistinct("member").alias("members_seen"))
    )
    group_handover = handover.groupBy(*GROUP_KEYS).agg(_merged("handover").alias("handover"))
    group_handover = group_handover.select(
        *GROUP_KEYS,
        F.array(*[_percentile(col("handover"), q) for q in (0.5, 0.99)]).alias("gq"),
    )
    stint_stats = ownership.groupBy(*GROUP_KEYS).agg(
        F.count("*").alias("stints"),
        F.avg(F.when(col("ended"), col("generations"))).alias("ownership_mean_generations"),
        F.avg(F.when(col("ended"), col("duration_s"))).alias("ownership_mean_s"),
    )
    return (
        gen_ts.groupBy(*GROUP_KEYS)
        .agg(
            F.concat_ws(",", F.array_sort(F.collect_set("strategy"))).alias("strategies"),
            F.count("*").alias("generations"),
            F.min("ts_us").alias("first_us"),
            F.max("ts_us").alias("last_us"),
            F.avg("interval_s").alias("interval_mean_s"),
            F.percentile("interval_s", 0.5).alias("interval_p50_s"),
            F.max("skew").alias("max_skew"),
            F.avg("skew").alias("mean_skew"),
            F.sum("moves").alias("moves"),
            F.sum("min_moves").alias("min_moves"),
        )
        .join(seen, GROUP_KEYS, "left")
        .join(group_handover, GROUP_KEYS, "left")
        .join(stint_stats, GROUP_KEYS, "left")
        .select(
            *GROUP_KEYS,
            "strategies",
            "generations",
            F.coalesce(col("members_seen"), F.lit(0)).alias("members_seen"),
            F.timestamp_micros("first_us").alias("first_ts"),
            F.timestamp_micros("last_us").alias("last_ts"),
            span.alias("span_s"),
            F.when(span > 0, (col("generations") - 1) / (span / 3600)).alias("per_hour"),
            "interval_mean_s",
            "interval_p50_s",
            "max_skew",
            "mean_skew",
            "moves",
            "min_moves",
            _ratio(col("moves"), col("min_moves")),
            col("gq")[0].alias("handover_p50"),
            col("gq")[1].alias("handover_p99"),
            F.coalesce(col("stints"), F.lit(0)).alias("stints"),
            "ownership_mean_generations",
            "ownership_mean_s",
        )
    )


def _reasons(generations: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    return generations.groupBy(*GROUP_KEYS, "reason").agg(
        F.count("*").alias("generations"),
        F.sum("moves").alias("moves"),
        F.sum("min_moves").alias("min_moves"),
    )


def _by_strategy(generations: DataFrame, handover: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    col = F.col
    strategy_handover = handover.groupBy("strategy").agg(_merged("handover").alias("handover"))
    strategy_handover = strategy_handover.select(
        "strategy",
        F.array(*[_percentile(col("handover"), q) for q in (0.5, 0.99)]).alias("sq"),
    )
    return (
        generations.groupBy("strategy")
        .agg(
            F.countDistinct("namespace", "group").alias("groups"),
            F.count("*").alias("generations"),
            F.max("skew").alias("max_skew"),
            F.avg("skew").alias("mean_skew"),
            F.sum("moves").alias("moves"),
            F.sum("min_moves").alias("min_moves"),
        )
        .join(strategy_handover, "strategy", "left")
        .select(
            "strategy",
            "groups",
            "generations",
            "max_skew",
            "mean_skew",
            "moves",
            "min_moves",
            _ratio(col("moves"), col("min_moves")),
            col("sq")[0].alias("handover_p50"),
            col("sq")[1].alias("handover_p99"),
        )
    )


def _problems(paired: DataFrame, splits: DataFrame) -> DataFrame:
    """Bad lines (blank ones aside) and events out of order, with their line numbers."""
    from pyspark.sql import functions as F

    col = F.col
    bad = paired.filter(col("kind").isNotNull() & (col("kind") != "blank"))
    late = paired.filter("late").select(
        "path",
        "block",
        "id",
        "file",
        F.lit("out_of_order").alias("kind"),
        F.concat(
            F.lit("generation "),
            col("generation").cast("string"),
            F.lit(" after "),
            col("prev_generation").cast("string"),
        ).alias("detail"),
        *GEN_KEYS,
    )
    both = bad.select(*late.columns).unionByName(late)
    return numbered(both, splits).select(*COLUMNS["problems"])


def compute(
    spark: SparkSession,
    input_path: str,
    progress: Progress | None = None,
    exclude: str | None = None,
) -> SparkReport:
    """Build the report's DataFrames over the input files below ``input_path`` (not below
    ``exclude``, the report's output folder; :func:`parsed_lines`). The intermediate frames
    are computed here (checkpoints); ``progress`` hears how long each took."""
    from pyspark.sql import functions as F

    col = F.col
    for key, value in SQL_CONF.items():
        spark.conf.set(key, value)
    keep = _Keeper(progress)
    lines, files = parsed_lines(spark, input_path, exclude)
    paired = keep(_paired(lines), "parsed lines, events beside their predecessors")
    splits = keep(line_splits(paired), "line splits")
    ev = paired.filter(col("kind").isNull() & ~col("late"))
    # A valid event's hand-over times hold no null, but the parsed type allows them, and
    # sort_array sorts such an array as boxed objects with a comparator. array_compact
    # (a lambda per value, dropping nothing here) gives the type without nulls: every
    # sort of hand-over times after it, per event and merged per group and strategy, is
    # a sort of a double[].
    ev = ev.withColumn("handover", F.array_compact("handover"))
    facts = _facts(ev)
    ev = ev.withColumn("prev_owner", _prev_owners(ev))
    pairs = keep(_pairs(ev), "owner pairs")
    member_counts = keep(_member_counts(pairs, facts), "member counts")
    generations = keep(_generations(facts, pairs, member_counts), "generations")
    ownership = _ownership(ev)
    sorted_handover = keep(_handover(ev), "hand-over times")
    handover = ev.select(*GEN_KEYS, "strategy", F.explode("handover").alias("handover_ms"))
    tables = {
        "generations": generations,
        "member_counts": member_counts,
        "member_churn": _member_churn(pairs),
        "ownership": ownership,
        "groups": _groups(generations, member_counts, ownership, sorted_handover),
        "reasons": _reasons(generations),
        "by_strategy": _by_strategy(generations, sorted_handover),
        "problems": _problems(paired, splits),
    }
    tables = {name: frame.select(*COLUMNS[name]) for name, frame in tables.items()}

    def groups_of(stints: DataFrame) -> DataFrame:
        return _groups(generations, member_counts, stints, sorted_handover)

    return SparkReport(tables, files, paired, handover, keep.cached, groups_of, keep.times)


def input_stats(report: SparkReport) -> dict[str, int]:
    """Files, lines, events, used, and one count per problem kind (one small job over the
    kept lines: the events out of order are the lines flagged ``late``)."""
    from pyspark.sql import functions as F

    col = F.col
    parsed = [k for k in PROBLEM_KINDS if k != "out_of_order"]
    counts = (
        report.lines.filter(col("kind").isNull() | (col("kind") != "blank"))
        .agg(
            F.count("*").alias("lines"),
            F.count(F.when(col("kind").isNull(), 1)).alias("events"),
            F.count(F.when(col("late"), 1)).alias("out_of_order"),
            *[F.count(F.when(col("kind") == k, 1)).alias(k) for k in parsed],
        )
        .first()
    )
    late = int(counts["out_of_order"]) if counts else 0
    stats = {
        "files": len(report.files),
        "lines": int(counts["lines"]) if counts else 0,
        "events": int(counts["events"]) if counts else 0,
    }
    stats["used"] = stats["events"] - late
    for kind in parsed:
        stats[kind] = int(counts[kind]) if counts else 0
    stats["out_of_order"] = late
    return stats


def to_pandas(frame: DataFrame, name: str) -> pd.DataFrame:
    """A Spark table as pandas, sorted like :data:`shoal.analytics.tables.KEYS`, with the
    timestamps UTC-aware."""
    return normalize(frame.toPandas(), name)


def write_table(report: SparkReport, name: str, out: str, progress: Progress) -> None:
    """One table as Parquet files under ``out/tables/<name>/``."""
    started = time.monotonic()
    frame = report.tables[name]
    target = os.path.join(out, "tables", name)
    frame.sortWithinPartitions(*KEYS[name]).write.mode("overwrite").parquet(target)
    if name in ("ownership", "member_churn"):
        # With the schema given, no job of its own to read it from a file's footer.
        report.written(name, frame.sparkSession.read.schema(frame.schema).parquet(target))
    progress(f"spark: wrote {name} ({time.monotonic() - started:.1f} s)")


def main(argv: list[str] | None = None) -> None:
    """``spark-submit spark_job.py --input DIR --out DIR [...]``: ``shoal-analytics report``
    under spark-submit (exits with its status)."""
    args = sys.argv[1:] if argv is None else argv
    cli.main(args=["report", "--engine", "spark", *args], prog_name="spark_job.py")


if __name__ == "__main__":
    main()
