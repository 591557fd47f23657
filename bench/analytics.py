"""The skew and churn report at scale: Spark (local[2]) beside its pandas oracle.

Generates synthetic assignment logs of ``--rows`` partition-ownership rows (default 10
million: about 78k generations of 128 partitions) over ``--groups`` groups per strategy
(sticky and modulo, with loads and hand-over times), then runs the same report with the
Spark engine and with the pandas engine on the same files.

Figures (one JSON line each on stdout; progress on stderr while it runs):

* ``generate_s``: writing the logs (not part of either engine's figure); rows, lines, MB.
* ``spark_startup_s``: starting the JVM and the session.
* ``spark_report_s``: the Spark report (read, parse, metrics, tables, summary, HTML) on a
  running session, once per ``--master`` (default ``local[2]`` then ``local[1]``);
  ``rows_per_s`` = ownership rows / that time; ``with_startup_s`` too. Target (issue 13):
  at most 45 s for 10M rows on ``local[2]``.
* ``pandas_report_s``: the same report with the pandas engine; ``rows_per_s``, peak RSS.
* ``spark_over_pandas``: pandas time / Spark time on the first master (target 1.5 at 2M
  rows and below, above 1 beyond).
* ``spark_report_warm_s``: the first master's report once more on the same session, its
  JVM's code compiled by the first (``--no-warm`` leaves it out), and
  ``spark_over_pandas_warm``: pandas time / that time. What a cold JVM costs the report
  is the difference; a user's first report pays it, which ``spark_report_s`` measures.
* ``core_speedup``: ``local[1]`` time / ``local[2]`` time when both ran (target 1.6).
  ``local[1]`` runs one task at a time, but its JVM's compilers and collector still use
  the second core (165 % CPU measured, session 9), so it is not a one-core run.
* ``core_speedup_one_cpu``: the ``local[1]`` report once more, its driver (JVM and
  Python) held to one CPU (``sched_setaffinity``: the JVM then sizes its compiler and
  collector threads for one), against ``local[2]``: what the second core gives the whole
  report. ``--no-one-cpu`` leaves it out.
* ``spark_jvm_cpu_s``: the CPU the JVM used during each report (from /proc, per thread),
  and its parts: ``tasks_s`` (executor task threads), ``jit_s`` (the C1 and C2 compiler
  threads), ``gc_s`` (the collector's threads), ``other_s`` (the driver: planning,
  Janino, Py4J, the scheduler). On 2 cores the JIT's share is what a cold JVM pays beside
  the work itself, and what ``local[1]`` runs on the second core.
* ``engines_agree``: both summaries give the same numbers (ok true/false).
* ``load_before`` / ``load_after``: the 1-minute load average, since other work on the
  machine skews every figure.
* ``churn_ratio``: moves / minimum per strategy, from the report (sticky ~1, modulo ~3).

The command as users run it (issue 30): a fresh process ``python -m shoal.analytics
report``, wall time from its start to its exit, with the command's own defaults (driver
memory included; only ``--master``, the first one, is given):

* ``generate_command_s``: ``shoal-analytics generate`` writing logs of the same size
  (``--groups`` per strategy, generations split evenly), one process; lines, files, MB.
* ``command_report_s``: the command on the bench's logs (``logs: bench``) and on those
  ``generate`` wrote (``logs: generate``), with ``--engine spark`` (``--master``) and
  ``--engine pandas``; ``phases``: where its time went, as it says (summary.json's
  ``timing``); ``exit_s``: the wall time after its last phase (the interpreter's exit);
  ``in_session_s`` (bench logs): the same report's in-session figure above, and
  ``over_in_session``: the command's time / that. ``class_archive``: what the Spark
  command's JVM did with its class-data archive (shoal.analytics.classarchive, in the
  user's cache as for any user): ``mapped``, or ``writing`` it as it exited (the first
  report on a machine: some 10 s more, once). After a ``writing`` run the Spark command
  runs again, and that run (what every later report meets) is the one compared.
* ``command_spark_over_pandas``: pandas time / Spark time through the command, per kind of
  logs. Target (issue 30): at least 1 (Spark no slower) at 10M rows and beyond.

``--command-logs`` chooses the logs (``both``, ``bench``, ``generate``, ``none``);
``--command-driver-memory`` gives the command a driver memory (default: the command's
own, a quarter of the machine's memory from 1g to 8g; ``driver_memory`` says what it was).
``--driver-memory`` is the in-session reports' (default: the same as the command's). Until
issue 30 the command's default was 2g and the bench's 4g: at 10M rows the report's
checkpoints, about 1 GB live in the heap, left a 2g driver some 50 full collections.

Run: ``python bench/analytics.py`` (``make bench`` runs it with the others). ``--rows``
smaller for a quick look; ``--keep`` keeps the logs and both reports; ``--command-only``
only the command on generate's logs (issue 30's figures).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.bench import emit, failed, note, thread_cpu, workdir
from shoal.analytics.generate import HistorySpec, history, specs_for, write_history

BENCH = "analytics"


@dataclass
class SparkRun:
    """A Spark report on a session of its own: its wall time and summary, and with
    ``--warm`` the wall time of the same report again on that session."""

    wall: float
    summary: dict[str, Any]
    warm_s: float | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000_000, help="ownership rows")
    parser.add_argument("--partitions", type=int, default=128)
    parser.add_argument("--groups", type=int, default=4, help="groups per strategy")
    parser.add_argument(
        "--master",
        action="append",
        help="Spark master, repeatable; each runs the same report on the same logs "
        "(default: local[2], then local[1])",
    )
    parser.add_argument(
        "--driver-memory",
        help="the in-session reports' driver memory (default: the report's own, as the command's)",
    )
    parser.add_argument(
        "--no-one-cpu",
        dest="one_cpu",
        action="store_false",
        help="leave out the local[1] run held to one CPU (core_speedup_one_cpu)",
    )
    parser.add_argument(
        "--no-warm",
        dest="warm",
        action="store_false",
        help="leave out the first master's second report on the same session (spark_report_warm_s)",
    )
    parser.add_argument("--skip-pandas", action="store_true", help="Spark only")
    parser.add_argument(
        "--command-logs",
        choices=["both", "bench", "generate", "none"],
        default="both",
        help="run the report command (a fresh process, as users do) on the bench's logs, "
        "on logs written by `shoal-analytics generate`, on both or on none",
    )
    parser.add_argument(
        "--command-driver-memory",
        help="--driver-memory for the report command (default: none given, the command's own)",
    )
    parser.add_argument(
        "--command-only",
        action="store_true",
        help="only the command on logs `shoal-analytics generate` writes (no in-session "
        "reports, no bench logs): issue 30's figures in a third of the time",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args(argv)
    args.master = args.master or ["local[2]", "local[1]"]
    if args.command_only:
        if args.command_logs not in ("both", "generate"):
            parser.error("--command-only runs the command on generate's logs only")
        args.command_logs = "generate"
    return args


def _write(spec: HistorySpec, out: Path) -> tuple[str, int, float]:
    started = time.monotonic()
    lines, _ = write_history(history(spec), out)
    return spec.group, lines, time.monotonic() - started


def generate(args: argparse.Namespace, logs: Path) -> int:
    generations = math.ceil(args.rows / args.partitions)
    specs = specs_for(args.groups, 1, partitions=args.partitions, seed=7)
    share, extra = divmod(generations, len(specs))
    specs = [replace(s, generations=share + (1 if i < extra else 0)) for i, s in enumerate(specs)]
    note(
        f"generating {generations} generations x {args.partitions} partitions "
        f"in {len(specs)} groups"
    )
    started = time.monotonic()
    lines = 0
    with ProcessPoolExecutor(max_workers=min(len(specs), os.cpu_count() or 2)) as pool:
        futures = [pool.submit(_write, spec, logs) for spec in specs]
        for done, future in enumerate(futures, start=1):
            group, count, seconds = future.result()
            lines += count
            note(f"generate: {group} {count} generations in {seconds:.1f} s ({done}/{len(specs)})")
    files = list(logs.rglob("*.jsonl"))
    emit(
        BENCH,
        "generate_s",
        time.monotonic() - started,
        rows=generations * args.partitions,
        lines=lines,
        files=len(files),
        mb=sum(p.stat().st_size for p in files) / 1e6,
        groups=len(specs),
    )
    return int(generations * args.partitions)


def _command(*args: str) -> list[str]:
    """``shoal-analytics`` as a fresh process of this Python (``python -m``)."""
    return [sys.executable, "-m", "shoal.analytics", *args]


def generate_with_command(args: argparse.Namespace, logs: Path) -> int:
    """Logs of about ``--rows`` rows written by ``shoal-analytics generate``, as a user
    writes them; returns the rows."""
    strategies = 2
    per_group = math.ceil(math.ceil(args.rows / args.partitions) / (strategies * args.groups))
    rows = int(per_group * strategies * args.groups * args.partitions)
    note(f"shoal-analytics generate: {args.groups} groups per strategy x {per_group} generations")
    started = time.monotonic()
    done = subprocess.run(
        _command(
            "generate",
            *("--out", str(logs), "--groups", str(args.groups)),
            *("--generations", str(per_group), "--partitions", str(args.partitions)),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        check=True,
    )
    wall = time.monotonic() - started
    said = json.loads(done.stdout.strip().splitlines()[-1])
    files = list(logs.rglob("*.jsonl"))
    emit(
        BENCH,
        "generate_command_s",
        wall,
        rows=rows,
        lines=said["lines"],
        files=len(files),
        mb=sum(p.stat().st_size for p in files) / 1e6,
        groups=said["groups"],
    )
    return rows


def command_report(
    args: argparse.Namespace,
    engine: str,
    logs: Path,
    out: Path,
    rows: int,
    kind: str,
    in_session: float | None,
) -> float:
    """``shoal-analytics report`` on ``logs`` in a fresh process (its progress on this
    stderr): the wall time from its start to its exit, beside the phases it reports."""
    master = args.master[0]
    memory = args.command_driver_memory
    chosen = ["--master", master] if engine == "spark" else ["--engine", "pandas"]
    if engine == "spark" and memory:
        chosen += ["--driver-memory", memory]
    note(f"command: shoal-analytics report --engine {engine} on the {kind} logs")
    started = time.monotonic()
    done = subprocess.run(
        _command("report", "--input", str(logs), "--out", str(out), *chosen),
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"shoal-analytics report --engine {engine} exited {done.returncode}")
    summary = json.loads((out / "summary.json").read_text())
    timing = summary["timing"]
    archive = summary.get("class_archive")
    emit(
        BENCH,
        "command_report_s",
        wall,
        engine=engine,
        **(
            {
                "master": master,
                "driver_memory": summary.get("driver_memory"),
                "class_archive": archive,
            }
            if engine == "spark"
            else {}
        ),
        logs=kind,
        rows=rows,
        rows_per_s=rows / wall,
        exit_s=wall - timing["total_s"],
        phases={phase["name"]: phase["s"] for phase in timing["phases"]},
        **(
            {"in_session_s": in_session, "over_in_session": wall / in_session} if in_session else {}
        ),
    )
    if archive == "writing":
        note("the Spark command wrote its JVM's class-data archive: once more, as later runs")
        return command_report(args, engine, logs, out, rows, kind, in_session)
    return wall


def commands(args: argparse.Namespace, root: Path, rows: int, in_session: dict[str, float]) -> None:
    """The report command with each engine on the logs ``--command-logs`` names."""
    kinds: list[tuple[str, Path, int]] = []
    if args.command_logs in ("both", "bench"):
        kinds.append(("bench", root / "logs", rows))
    if args.command_logs in ("both", "generate"):
        generated = root / "generated"
        kinds.append(("generate", generated, generate_with_command(args, generated)))
    engines = ["spark"] if args.skip_pandas else ["spark", "pandas"]
    for kind, logs, count in kinds:
        walls = {
            engine: command_report(
                args,
                engine,
                logs,
                root / f"command-{kind}-{engine}",
                count,
                kind,
                in_session.get(engine) if kind == "bench" else None,
            )
            for engine in engines
        }
        if "pandas" in walls:
            ratio = walls["pandas"] / walls["spark"]
            big = count >= 10_000_000
            emit(
                BENCH,
                "command_spark_over_pandas",
                ratio,
                rows=count,
                logs=kind,
                master=args.master[0],
                **({"target": 1.0, "ok": ratio >= 1.0} if big else {}),
            )


def _figures(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        strategy: {k: figures[k] for k in ("generations", "moves", "min_moves", "max_skew")}
        for strategy, figures in summary["by_strategy"].items()
    }


def _spark_run(
    args: argparse.Namespace,
    master: str,
    logs: Path,
    out: Path,
    rows: int,
    cpus: set[int] | None = None,
    warm: bool = False,
) -> SparkRun:
    """One report on a session of its own; with `cpus`, this process and the JVM it
    starts (which inherits the mask) run on those CPUs only."""
    if cpus is None:
        return _spark_report(args, master, logs, out, rows, warm=warm)
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return _spark_report(args, master, logs, out, rows, cpus=len(cpus))
    finally:
        os.sched_setaffinity(0, allowed)


def _jvm_pid() -> int | None:
    """The pid of the JVM pyspark started (its gateway's process), if it started one."""
    from pyspark import SparkContext

    proc = getattr(SparkContext._gateway, "proc", None)
    return getattr(proc, "pid", None)


def _jvm_cpu(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds between two :func:`thread_cpu` readings, by kind of thread."""
    kinds = {"tasks_s": 0.0, "jit_s": 0.0, "gc_s": 0.0, "other_s": 0.0}
    for name, seconds in after.items():
        used = seconds - before.get(name, 0.0)
        if "CompilerThre" in name:
            kinds["jit_s"] += used
        elif name.startswith("GC Thread"):
            kinds["gc_s"] += used
        elif name.startswith("Executor task"):
            kinds["tasks_s"] += used
        else:
            kinds["other_s"] += used
    return kinds


def _timed_report(
    spark: Any, logs: Path, out: Path, master: str, held: dict[str, int], warm: bool = False
) -> tuple[float, dict[str, Any]]:
    """One report on a running session, and the JVM's CPU meanwhile by kind of thread."""
    from shoal.analytics.report import run_report

    pid = _jvm_pid()
    cpu_before = thread_cpu(pid) if pid else {}
    started = time.monotonic()
    summary = run_report(str(logs), out, engine="spark", spark=spark, progress=note)
    wall = time.monotonic() - started
    if pid:
        kinds = _jvm_cpu(cpu_before, thread_cpu(pid))
        total = sum(kinds.values())
        emit(
            BENCH,
            "spark_jvm_cpu_s",
            total,
            master=master,
            **held,
            **({"warm": True} if warm else {}),
            **kinds,
            jit_share=kinds["jit_s"] / total if total else None,
            cores_busy=total / wall,
        )
    return wall, summary


def _spark_report(
    args: argparse.Namespace,
    master: str,
    logs: Path,
    out: Path,
    rows: int,
    cpus: int | None = None,
    warm: bool = False,
) -> SparkRun:
    """The report on a new session (a cold JVM, as a user's first report runs); with
    ``warm``, once more on the same session (``spark_report_warm_s``)."""
    from shoal.analytics.session import spark_session, stop_spark

    started = time.monotonic()
    spark = spark_session(master, driver_memory=args.driver_memory)
    startup = time.monotonic() - started
    held = {"cpus": cpus} if cpus else {}
    emit(BENCH, "spark_startup_s", startup, master=spark.sparkContext.master, **held)
    again: float | None = None
    try:
        wall, summary = _timed_report(spark, logs, out, master, held)
        if warm:
            again, _ = _timed_report(spark, logs, out / "warm", master, held, warm=True)
            emit(
                BENCH,
                "spark_report_warm_s",
                again,
                rows=rows,
                master=master,
                cold_s=wall,
                note="the same report again on the same session: its JVM's code compiled",
            )
    finally:
        stop_spark(spark)
    target = 45.0 if master == "local[2]" and rows >= 10_000_000 and not cpus else None
    emit(
        BENCH,
        "spark_report_s",
        wall,
        rows=rows,
        rows_per_s=rows / wall,
        with_startup_s=wall + startup,
        master=master,
        **held,
        generations=summary["input_stats"]["used"],
        **({"target": target, "ok": wall <= target} if target else {}),
    )
    return SparkRun(wall, summary, again)


def _load(figure: str) -> None:
    one, five, fifteen = os.getloadavg()
    emit(BENCH, figure, one, load_5m=five, load_15m=fifteen, cpus=os.cpu_count())


def run(args: argparse.Namespace, root: Path) -> None:
    from shoal.analytics.report import run_report

    if args.command_only:
        _load("load_before")
        commands(args, root, 0, {})
        _load("load_after")
        return
    logs = root / "logs"
    rows = generate(args, logs)
    _load("load_before")

    runs = [
        _spark_run(args, master, logs, root / f"spark-{i}", rows, warm=args.warm and i == 0)
        for i, master in enumerate(args.master)
    ]
    walls = {master: done.wall for master, done in zip(args.master, runs, strict=True)}
    in_session = {"spark": walls[args.master[0]]}
    from_spark, warm_s = runs[0].summary, runs[0].warm_s
    first = args.master[0]
    for strategy, figures in from_spark["by_strategy"].items():
        emit(
            BENCH,
            "churn_ratio",
            figures["churn_ratio"],
            strategy=strategy,
            **{
                k: figures[k]
                for k in ("generations", "moves", "min_moves", "max_skew", "mean_skew")
            },
        )
    if "local[1]" in walls and "local[2]" in walls:
        speedup = walls["local[1]"] / walls["local[2]"]
        emit(BENCH, "core_speedup", speedup, rows=rows, target=1.6, ok=speedup >= 1.6)
        if args.one_cpu and len(os.sched_getaffinity(0)) > 1:
            one = min(os.sched_getaffinity(0))
            wall = _spark_run(args, "local[1]", logs, root / "spark-one-cpu", rows, {one}).wall
            emit(
                BENCH,
                "core_speedup_one_cpu",
                wall / walls["local[2]"],
                rows=rows,
                local_1_one_cpu_s=wall,
                note="local[1] with its driver held to one CPU, against local[2]",
            )
    if not args.skip_pandas:
        started = time.monotonic()
        from_pandas = run_report(str(logs), root / "pandas", engine="pandas", progress=note)
        wall = time.monotonic() - started
        in_session["pandas"] = wall
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        emit(BENCH, "pandas_report_s", wall, rows=rows, rows_per_s=rows / wall, peak_rss_mb=peak_mb)
        ratio = wall / walls[first]
        target = 1.5 if rows <= 2_000_000 else 1.0
        emit(
            BENCH,
            "spark_over_pandas",
            ratio,
            rows=rows,
            master=first,
            target=target,
            ok=ratio >= target if rows <= 2_000_000 else ratio > target,
        )
        if warm_s:
            emit(
                BENCH,
                "spark_over_pandas_warm",
                wall / warm_s,
                rows=rows,
                master=first,
                note="pandas time / the warm Spark report's (spark_report_warm_s)",
            )
        same = _figures(from_spark) == _figures(from_pandas) and (
            from_spark["input_stats"] == from_pandas["input_stats"]
        )
        emit(BENCH, "engines_agree", int(same), ok=same, spark=_figures(from_spark))
    if args.command_logs != "none":
        commands(args, root, rows, in_session)
    _load("load_after")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with workdir("shoal-bench-analytics-", args.keep) as root:
        run(args, root)
    note(f"wall time {time.monotonic() - started:.1f} s")
    missed = failed()
    if missed:
        note(f"figures that missed their target: {', '.join(missed)}")
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
