"""`shoal-analytics`: export a group's assignment log, report on it, or generate one."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from pathlib import Path

import click

from shoal.logs import log_level_option, setup_logging

log = logging.getLogger(__name__)


def _progress(message: str) -> None:
    click.echo(message, err=True)


def _driver_memory(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--driver-memory checked here, so a bad size is one line rather than the JVM's."""
    from shoal.analytics.session import driver_memory_mib

    if value is None:
        return None
    try:
        driver_memory_mib(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    return value.strip()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@log_level_option
def main(log_level: str) -> None:
    """Shoal's assignment-log analytics.

    \b
    shoal-analytics export   copy a group's assignment log from JetStream to files
    shoal-analytics report   skew and churn report (PySpark) of such files
    shoal-analytics generate synthetic logs (sticky and modulo) for tests and scale runs
    """
    setup_logging(log_level, quiet=["py4j"])  # py4j logs every gateway command at INFO


@main.command()
@click.option(
    "--group", "-g", envvar="SHOAL_GROUP", required=True, help="Consumer group [env SHOAL_GROUP]."
)
@click.option(
    "--namespace",
    "-n",
    envvar="SHOAL_NAMESPACE",
    default="default",
    show_default=True,
    help="Namespace of the group [env SHOAL_NAMESPACE].",
)
@click.option(
    "--out",
    "-o",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Output folder; files go to OUT/date=YYYY-MM-DD/part-<ns>.<group>-<seq>.<format>.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "parquet"]),
    default="jsonl",
    show_default=True,
    help="jsonl copies every message verbatim (the report's input); parquet writes typed "
    "columns for other tools and leaves out messages that are not valid events.",
)
@click.option(
    "--since",
    metavar="TIME",
    help="Only messages stored at or after TIME: RFC 3339 (2026-11-21T10:00:00Z), a date "
    "(2026-11-21) or a duration back from now (30m, 24h, 7d).",
)
@click.option(
    "--nats",
    "--nats-url",
    "nats_url",
    envvar="NATS_URL",
    default="nats://127.0.0.1:4222",
    show_default=True,
    help="NATS server URL [env NATS_URL].",
)
@click.option(
    "--stream",
    envvar="SHOAL_STREAM",
    help="The group's stream if not the default shoal_<namespace>_<group>; the log is "
    "<stream>_log [env SHOAL_STREAM].",
)
@click.option(
    "--creds",
    envvar="NATS_CREDS_FILE",
    type=click.Path(exists=True, dir_okay=False),
    help="NATS credentials file [env NATS_CREDS_FILE].",
)
@click.option(
    "--connect-attempts",
    type=click.IntRange(1, 100),
    default=5,
    show_default=True,
    help="Connection attempts (with backoff) before giving up.",
)
def export(
    group: str,
    namespace: str,
    out: Path,
    fmt: str,
    since: str | None,
    nats_url: str,
    stream: str | None,
    creds: str | None,
    connect_attempts: int,
) -> None:
    """Copy a group's assignment log from JetStream to date-partitioned files.

    NATS TLS and credentials as for `shoal-consumer run`: NATS_CA_FILE, NATS_CERT_FILE,
    NATS_KEY_FILE, NATS_USER/NATS_PASSWORD, NATS_NKEY_SEED_FILE (and --creds).

    Prints one JSON line: the stream, how many messages, their sequence range and the files.
    """
    from shoal.analytics.export import ExportError, export_log, parse_since
    from shoal.group.config import nats_security_from_env

    try:
        start = parse_since(since) if since else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--since") from None
    try:
        result = asyncio.run(
            export_log(
                nats_url=nats_url,
                namespace=namespace,
                group=group,
                out=out,
                fmt=fmt,
                since=start,
                stream=stream,
                creds_file=creds,
                # TLS and the other credentials as a member takes them (NATS_*).
                security=nats_security_from_env(os.environ),
                connect_attempts=connect_attempts,
                progress=_progress,
            )
        )
    except ExportError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(result.as_dict()))


def _spark_failure(exc: Exception) -> str | None:
    """One line for a failure inside Spark (an unreadable input file, a path Spark cannot
    list), None for anything else."""
    try:
        from py4j.protocol import Py4JJavaError
        from pyspark.errors import PySparkException
    except ImportError:
        return None
    if isinstance(exc, PySparkException):
        message = exc.getMessage() or str(exc)
    elif isinstance(exc, Py4JJavaError):
        message = str(exc.java_exception.toString())
    else:
        return None
    first = message.strip().splitlines()[0] if message.strip() else type(exc).__name__
    return f"the report failed in Spark: {first}"


@main.command()
@click.option(
    "--input",
    "-i",
    "input_path",
    required=True,
    help="Folder of logs: every *.jsonl and every Parquet export (part-*.parquet) below it "
    "is read, except below --out. Or one file, whatever its name: Parquet if it ends in "
    ".parquet, else JSON lines.",
)
@click.option(
    "--out",
    "-o",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Output folder: summary.json, report.html, plots/, tables/.",
)
@click.option(
    "--master",
    envvar="SHOAL_SPARK_MASTER",
    help="Spark master URL (default local[*]; ignored under spark-submit, which sets it) "
    "[env SHOAL_SPARK_MASTER].",
)
@click.option(
    "--engine",
    type=click.Choice(["spark", "pandas"]),
    default="spark",
    show_default=True,
    help="spark is the report; pandas is its test oracle (small inputs, no Java needed).",
)
@click.option(
    "--driver-memory",
    metavar="SIZE",
    callback=_driver_memory,
    help="Spark driver memory (the JVM's heap, which holds the report's checkpoints) when "
    "the report starts its own JVM: a whole number and m, g or t (4g), at least 512m. "
    "Default: a quarter of this machine's memory (or of its container's limit), at least "
    "1g and at most 8g (10 million rows ran well from 4g on, not with 2g).",
)
@click.option(
    "--conf",
    "confs",
    multiple=True,
    metavar="KEY=VALUE",
    help="Extra Spark configuration (repeatable).",
)
def report(
    input_path: str,
    out: Path,
    master: str | None,
    engine: str,
    driver_memory: str | None,
    confs: tuple[str, ...],
) -> None:
    """Skew and churn report of assignment logs (PySpark, local[*] by default).

    Prints summary.json's headline as one JSON line on stdout; the full report is in OUT.
    At the end, on stderr, where the time went from the process's start on (also in
    summary.json, "timing").
    """
    from shoal.analytics.layout import InputError
    from shoal.analytics.session import JavaMissing
    from shoal.analytics.timing import Timeline

    timeline = Timeline(from_process_start=True)
    timeline.mark("start: Python, the command's imports")
    try:
        from shoal.analytics.report import run_report
    except ImportError as exc:
        raise click.ClickException(
            f"{exc}: the report needs the analytics extra (pip install 'shoal[analytics]')"
        ) from None
    timeline.mark("import the report (pandas, pyarrow)")
    conf: dict[str, str] = {}
    for item in confs:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--conf")
        conf[key] = value
    if "://" not in input_path and not Path(input_path).exists():
        raise click.ClickException(f"input {input_path} does not exist")
    try:
        summary = run_report(
            input_path,
            out,
            engine=engine,
            master=master,
            driver_memory=driver_memory,
            conf=conf,
            progress=_progress,
            timeline=timeline,
        )
    except (JavaMissing, InputError) as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:
        failed = _spark_failure(exc)
        if failed is None:
            raise
        raise click.ClickException(failed) from None
    headline = {
        "out": str(out),
        "empty": summary["empty"],
        "message": summary["message"],
        "input_stats": summary["input_stats"],
        "by_strategy": summary["by_strategy"],
    }
    click.echo(json.dumps(headline))


@main.command()
@click.option(
    "--out",
    "-o",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Output folder (date-partitioned JSON lines, like export).",
)
@click.option(
    "--groups",
    type=click.IntRange(1, 1000),
    default=2,
    show_default=True,
    help="Groups per strategy.",
)
@click.option(
    "--generations",
    type=click.IntRange(1),
    default=200,
    show_default=True,
    help="Generations per group.",
)
@click.option(
    "--strategy",
    type=click.Choice(["sticky", "modulo", "both"]),
    default="both",
    show_default=True,
)
@click.option("--partitions", "-p", type=click.IntRange(1, 4096), default=128, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--namespace", default="synthetic", show_default=True)
@click.option(
    "--empty/--no-empty",
    default=False,
    show_default=True,
    help="Let groups empty now and then (generations without members).",
)
@click.option("--malformed", type=click.IntRange(0), default=0, help="Bad lines per group.")
@click.option(
    "--unknown-schema", type=click.IntRange(0), default=0, help="Schema-2 lines per group."
)
@click.option(
    "--out-of-order", type=click.IntRange(0), default=0, help="Repeated earlier lines per group."
)
def generate(
    out: Path,
    groups: int,
    generations: int,
    strategy: str,
    partitions: int,
    seed: int,
    namespace: str,
    empty: bool,
    malformed: int,
    unknown_schema: int,
    out_of_order: int,
) -> None:
    """Write synthetic assignment logs: joins, leaves, crashes, scale steps, fail-overs and
    load rebalances, assigned by the real assignor under each strategy."""
    from shoal.analytics.generate import history, specs_for, write_history

    strategies = ("sticky", "modulo") if strategy == "both" else (strategy,)
    specs = specs_for(
        groups,
        generations,
        strategies=strategies,
        partitions=partitions,
        seed=seed,
        namespace=namespace,
        empty_weight=4 if empty else 0,
    )
    bad = {"malformed": malformed, "unknown_schema": unknown_schema, "out_of_order": out_of_order}
    started = time.monotonic()
    lines = 0
    files = 0
    for i, spec in enumerate(specs, start=1):
        n, written = write_history(
            history(spec),
            out,
            bad=bad if any(bad.values()) else None,
            seed=random.Random(spec.seed).randrange(2**31),
        )
        lines += n
        files += len(written)
        elapsed = time.monotonic() - started
        _progress(f"generate: {spec.group} {n} lines ({i}/{len(specs)}, {elapsed:.1f} s)")
    click.echo(json.dumps({"out": str(out), "groups": len(specs), "lines": lines, "files": files}))


if __name__ == "__main__":
    main()
