"""``shoal-analytics report``: run an engine, write the tables, summary.json and report.html.

Output in ``--out``::

    summary.json             input counts, problems, by_strategy.<strategy>, per-group figures
    report.html, plots/*.png the same with plots; static files, readable without Spark
    tables/<name>/*.parquet  every table of shoal.analytics.tables
    tables/<name>.csv        the small ones (generations, groups, reasons, by_strategy,
                             problems) also as CSV

The Spark engine (default) is the report; the pandas engine is its test oracle, also handy
for small logs on a machine without Java.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from shoal.analytics.ingest import PROBLEM_KINDS
from shoal.analytics.tables import (
    BIG_TABLES,
    COLUMNS,
    ReportData,
    normalize,
)
from shoal.analytics.timing import Timeline
from shoal.contracts.events import format_ts

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["ENGINES", "build_summary", "run_report"]

log = logging.getLogger(__name__)

ENGINES = ("spark", "pandas")
Progress = Callable[[str], None]

HEATMAP_GENERATIONS = 160
HEATMAP_MEMBERS = 32
HANDOVER_SAMPLE = 200_000
LISTED_PROBLEMS = 1000
# Driver threads that submit the Spark report's steps after its checkpoints (_spark_data).
STEP_THREADS = 3


def plain(value: Any) -> Any:
    """A JSON-ready value: numpy scalars to Python, NaN/NaT to None, times to RFC 3339."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if value is None or value is pd.NaT:
        return None
    if isinstance(value, pd.Timestamp | datetime):
        return format_ts(value.to_pydatetime() if isinstance(value, pd.Timestamp) else value)
    if hasattr(value, "item"):  # numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    try:
        if pd.isna(value):
            return None
    except (TypeError, ValueError):
        pass
    return value


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [plain(r) for r in frame.to_dict("records")]


def _heatmap_selection(generations: pd.DataFrame) -> pd.DataFrame:
    """(namespace, group, generation) of the heat map: per strategy, the group with the most
    generations, at most HEATMAP_GENERATIONS of its generations evenly spread."""
    picked: list[pd.DataFrame] = []
    if generations.empty:
        return pd.DataFrame(columns=["namespace", "group", "generation"])
    sizes = generations.groupby(["strategy", "namespace", "group"]).size().reset_index(name="n")
    for _, best in sizes.sort_values(["strategy", "n"], ascending=[True, False]).groupby(
        "strategy"
    ):
        ns, group = best.iloc[0]["namespace"], best.iloc[0]["group"]
        rows = generations[(generations["namespace"] == ns) & (generations["group"] == group)]
        step = max(1, math.ceil(len(rows) / HEATMAP_GENERATIONS))
        picked.append(rows.iloc[::step][["namespace", "group", "generation"]])
    return pd.concat(picked).drop_duplicates().reset_index(drop=True)


def _member_totals(churn: pd.DataFrame) -> pd.DataFrame:
    cols = ["namespace", "group", "member", "gained", "lost", "moves"]
    if churn.empty:
        return pd.DataFrame(columns=cols)
    totals = churn.groupby(["namespace", "group", "member"], as_index=False)[
        ["gained", "lost"]
    ].sum()
    totals["moves"] = totals["gained"] + totals["lost"]
    return totals.sort_values("moves", ascending=False, kind="stable")[cols].reset_index(drop=True)


def _write_parquet(frame: pd.DataFrame, out: Path, name: str) -> None:
    folder = out / "tables" / name
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.parquet"):
        stale.unlink()
    frame.to_parquet(folder / "part-00000.parquet", index=False)


def _write_csv(frame: pd.DataFrame, out: Path, name: str) -> None:
    """A small table also as ``tables/<name>.csv``."""
    frame.to_csv(out / "tables" / f"{name}.csv", index=False)


def _pandas_data(input_path: Path, out: Path, progress: Progress, timeline: Timeline) -> ReportData:
    from shoal.analytics.oracle import compute_path

    computed = compute_path(input_path, progress, exclude=out)
    timeline.mark("read, parse and compute (one pass)")
    tables = {name: normalize(frame, name) for name, frame in computed.tables.items()}
    timeline.mark("normalize the tables")
    for name, frame in tables.items():
        _write_parquet(frame, out, name)
    timeline.mark("write tables (parquet)")
    for name, frame in tables.items():
        if name not in BIG_TABLES:
            _write_csv(frame, out, name)
    timeline.mark("small tables as CSV")
    selection = _heatmap_selection(tables["generations"])
    heatmap = tables["member_counts"].merge(selection, on=["namespace", "group", "generation"])
    handover = computed.handover
    if len(handover) > HANDOVER_SAMPLE:
        handover = handover.sample(HANDOVER_SAMPLE, random_state=1)
    data = ReportData(
        tables={n: f for n, f in tables.items() if n not in BIG_TABLES},
        stats=computed.stats,
        heatmap=heatmap,
        handover_sample=handover[["strategy", "handover_ms"]].reset_index(drop=True),
        member_totals=_member_totals(tables["member_churn"]),
        engine="pandas",
    )
    timeline.mark("the plots' data")
    return data


def _spark_data(
    input_path: str,
    out: Path,
    progress: Progress,
    spark: SparkSession,
    timeline: Timeline,
) -> ReportData:
    from pyspark.sql import functions as F

    from shoal.analytics.html_report import draw_generation_plots
    from shoal.analytics.progress import StageProgress, Steps
    from shoal.analytics.session import class_archive_state
    from shoal.analytics.spark_job import compute, input_stats, to_pandas, write_table

    steps = Steps()
    started = time.monotonic()
    early_plots: Future[dict[str, bool]] | None = None

    def step(what: str) -> None:
        progress(f"spark: {what} ({time.monotonic() - started:.1f} s)")

    with StageProgress(spark.sparkContext, progress):
        report = compute(spark, input_path, progress, exclude=str(out))
        read = timeline.mark("read, parse and checkpoint", report.kept_s)
        # What the checkpoints' jobs leave: listing the files, planning, Python.
        timeline.phases[-1].steps.append(
            ("driver: listing and planning", read - sum(s for _, s in report.kept_s))
        )
        small: dict[str, pd.DataFrame] = {}
        got: dict[str, Any] = {}

        def run(name: str, work: Callable[[], None], *after: Future[None]) -> Future[None]:
            def timed() -> None:
                for before in after:
                    before.result()
                # Each step's jobs carry its name in Spark's UI and event log (a local
                # property of this thread, which pyspark pins to a JVM thread of its own).
                spark.sparkContext.setJobDescription(f"shoal: {name}")
                try:
                    with steps.step(name):
                        work()
                finally:
                    spark.sparkContext.setJobDescription(None)  # type: ignore[arg-type]
                step(f"{name} done")

            return pool.submit(timed)

        def write(name: str) -> Callable[[], None]:
            return lambda: write_table(report, name, str(out), progress)

        def collect(name: str) -> None:
            small[name] = to_pandas(report.tables[name], name)
            # Written here, while Spark works on the other steps (the small tables' CSV
            # files, the generations' 20 MB most of it, took 1.6-2.4 s at 10M rows once
            # Spark was done).
            _write_parquet(small[name], out, name)
            _write_csv(small[name], out, name)

        def generations() -> None:
            nonlocal early_plots
            collect("generations")
            # Its plots are drawn while Spark works on the rest (the driver's Python mostly
            # waits on the JVM meanwhile): 2.5 s at 10M rows.
            plotter = ThreadPoolExecutor(1, thread_name_prefix="plots")
            early_plots = plotter.submit(draw_generation_plots, small["generations"], out)
            plotter.shutdown(wait=False)

        def problems_and_counts() -> None:
            small["problems"] = to_pandas(
                report.tables["problems"].orderBy("file", "line").limit(LISTED_PROBLEMS),
                "problems",
            )
            _write_csv(small["problems"], out, "problems")
            got["stats"] = input_stats(report)

        def plots_data() -> None:
            selection = _heatmap_selection(small["generations"])
            got["heatmap"] = pd.DataFrame(columns=COLUMNS["member_counts"])
            if not selection.empty:
                chosen = spark.createDataFrame(selection)
                got["heatmap"] = to_pandas(
                    report.tables["member_counts"].join(
                        F.broadcast(chosen), ["namespace", "group", "generation"]
                    ),
                    "member_counts",
                )
            total = int(small["generations"]["handovers"].sum())
            sample = report.handover.select("strategy", "handover_ms")
            if total > HANDOVER_SAMPLE:
                sample = sample.sample(False, HANDOVER_SAMPLE / total, seed=1)
            got["handover"] = (
                sample.toPandas() if total else pd.DataFrame(columns=["strategy", "handover_ms"])
            )
            got["totals"] = (
                report.tables["member_churn"]
                .groupBy("namespace", "group", "member")
                .agg(F.sum("gained").alias("gained"), F.sum("lost").alias("lost"))
                .toPandas()
            )

        # The steps after the checkpoints are separate Spark jobs, and all small but the
        # writes. A few driver threads submit them at once: Spark runs concurrent jobs, their
        # tasks taking the free cores in submission order, and one job's planning, Arrow
        # transfer and pandas work overlap another's tasks. The big tables are written by
        # Spark (the ownership, longest, first: the groups read it back); the others are
        # collected, written with pandas and drawn. A step waits for the steps it reads,
        # submitted before it, so the pool never waits on work queued behind it.
        pool = ThreadPoolExecutor(STEP_THREADS, thread_name_prefix="spark-step")
        try:
            ownership = run("write ownership", write("ownership"))
            churn = run("write member_churn", write("member_churn"))
            gens = run("collect generations", generations)
            futures = [
                ownership,
                churn,
                gens,
                run("write member_counts", write("member_counts")),
                run("write problems", write("problems")),
                run("collect reasons", lambda: collect("reasons")),
                run("collect by_strategy", lambda: collect("by_strategy")),
                run("collect problems, count the input", problems_and_counts),
                run("collect groups", lambda: collect("groups"), ownership),
                run("collect the plots' data", plots_data, gens, churn),
            ]
            for future in futures:
                future.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            report.unpersist()
    timeline.mark(f"steps after the checkpoints ({STEP_THREADS} threads)", steps.times)
    stats, heatmap, handover, totals = (
        got["stats"],
        got["heatmap"],
        got["handover"],
        got["totals"],
    )
    return ReportData(
        tables=small,
        stats=stats,
        heatmap=heatmap,
        handover_sample=handover,
        member_totals=_member_totals(totals),
        engine="spark",
        extra={
            "master": spark.sparkContext.master,
            "spark": spark.version,
            # What the driver's JVM has (1g is Spark's default when nothing set it).
            "driver_memory": spark.sparkContext.getConf().get("spark.driver.memory", "1g"),
            "class_archive": class_archive_state(),
        },
        early_plots=early_plots,
    )


def build_summary(data: ReportData, *, input_path: str, elapsed_s: float) -> dict[str, Any]:
    """The content of summary.json."""
    stats = data.stats
    problems = data.tables["problems"]
    empty = stats.get("used", 0) == 0
    if empty:
        message = (
            f"empty report: no usable assignment events in {input_path} "
            f"({stats.get('files', 0)} files, {stats.get('lines', 0)} lines)"
        )
    else:
        message = (
            f"{stats['used']} generations of {len(data.tables['groups'])} groups from "
            f"{stats.get('files', 0)} files"
        )
    by_strategy = {
        row["strategy"]: {k: v for k, v in row.items() if k != "strategy"}
        for row in _records(data.tables["by_strategy"])
    }
    groups = {
        f"{row['namespace']}/{row['group']}": {
            k: v for k, v in row.items() if k not in ("namespace", "group")
        }
        for row in _records(data.tables["groups"])
    }
    return {
        "schema": 1,
        "generated_at": format_ts(datetime.now(UTC)),
        "engine": data.engine,
        **{k: v for k, v in data.extra.items() if isinstance(v, str)},
        "input": input_path,
        "elapsed_s": round(elapsed_s, 3),
        "empty": empty,
        "message": message,
        "input_stats": dict(stats),
        "problems": {
            "count": sum(stats.get(kind, 0) for kind in PROBLEM_KINDS),
            "by_kind": {kind: stats.get(kind, 0) for kind in PROBLEM_KINDS},
            "first": _records(problems.head(50)),
        },
        "by_strategy": by_strategy,
        "groups": groups,
    }


def run_report(
    input_path: str,
    out: Path,
    *,
    engine: str = "spark",
    master: str | None = None,
    driver_memory: str | None = None,
    conf: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    spark: SparkSession | None = None,
    timeline: Timeline | None = None,
) -> dict[str, Any]:
    """Compute the report of the logs below ``input_path`` into ``out``; returns the summary.

    The Spark engine uses ``spark`` if given (and leaves it running), else starts a session
    (``master``, ``driver_memory``, by default a share of the machine's memory as
    :func:`shoal.analytics.session.default_driver_memory` says, ``conf``) and stops it,
    JVM included, when done.

    Where the time went is said at the end (one block, :mod:`shoal.analytics.timing`) and
    is summary.json's ``timing``: the phases of ``timeline`` if given (the command's, which
    starts at the process's start), else from this call on.
    """
    say: Progress = progress or (lambda message: log.info("%s", message))
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    timeline = timeline or Timeline()
    # A failed report removes the output folder if it made it (nothing else: a folder that
    # was there may hold a previous report).
    created: Path | None = None
    if not out.exists():
        created = out
        while not created.parent.exists():
            created = created.parent
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _run_report(
            input_path, out, engine, master, driver_memory, conf, say, spark, timeline
        )
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


def _run_report(
    input_path: str,
    out: Path,
    engine: str,
    master: str | None,
    driver_memory: str | None,
    conf: Mapping[str, str] | None,
    say: Progress,
    spark: SparkSession | None,
    timeline: Timeline,
) -> dict[str, Any]:
    from shoal.analytics.html_report import write_html

    started = time.monotonic()
    stopping: threading.Thread | None = None
    if engine == "pandas":
        data = _pandas_data(Path(input_path), out, say, timeline)
    elif spark is not None:
        data = _spark_data(input_path, out, say, spark, timeline)
    else:
        from shoal.analytics.session import spark_session, stop_spark

        session = spark_session(master, driver_memory=driver_memory, conf=conf)
        timeline.mark("Spark session (the JVM's start)")
        memory = session.sparkContext.getConf().get("spark.driver.memory", "1g")
        say(f"spark: session up, master {session.sparkContext.master}, driver memory {memory}")
        try:
            data = _spark_data(input_path, out, say, session, timeline)
        except BaseException:
            stop_spark(session)
            raise
        # What follows needs only the pandas tables, so the JVM stops (most of a second,
        # most of it waiting for it to exit) while the HTML is written.
        stopping = threading.Thread(target=stop_spark, args=(session,), name="stop-spark")
        stopping.start()
    summary = build_summary(data, input_path=input_path, elapsed_s=time.monotonic() - started)
    write_html(data, summary, out)
    timeline.mark("plots and report.html")
    if stopping is not None:
        if data.extra.get("class_archive") == "writing":
            say(
                "spark: the JVM writes its class-data archive as it exits (once; later "
                "reports start faster)"
            )
        stopping.join()
        timeline.mark(
            "stop Spark (the JVM's exit, writing its class-data archive)"
            if data.extra.get("class_archive") == "writing"
            else "stop Spark (the JVM's exit; beside the HTML)"
        )
    # Written last, so that it holds the timing of everything before.
    summary["timing"] = timeline.as_dict()
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for line in timeline.lines():
        say(f"report: {line}")
    say(f"report: {summary['message']} -> {os.path.join(out, 'report.html')}")
    return summary
