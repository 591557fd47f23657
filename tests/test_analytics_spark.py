"""The PySpark report against its pandas oracle: the same tables, row for row.

One JVM for the session (``local[2]``), stopped at the end. The input mixes generated
histories under both strategies (loads, hand-over times, empty groups, bad lines of every
kind) with the hand-written corner cases of ``shoal.analytics.generate.edge_cases``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pytest
from pandas.api.types import is_float_dtype

from shoal.analytics.generate import history, specs_for, write_edge_cases, write_history
from shoal.analytics.oracle import Computed, compute_path
from shoal.analytics.report import run_report
from shoal.analytics.session import JavaMissing, find_java, spark_session, stop_spark
from shoal.analytics.tables import COLUMNS, normalize

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One JVM for the whole test session, stopped (JVM included) at its end."""
    session = spark_session("local[2]", driver_memory="1g")
    try:
        yield session
    finally:
        stop_spark(session)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("logs")
    write_edge_cases(root / "edge")
    # Seven malformed lines per group: one of each kind corrupt() writes.
    bad = {"malformed": 7, "unknown_schema": 2, "out_of_order": 3}
    for i, spec in enumerate(specs_for(2, 120, seed=5, empty_weight=3)):
        write_history(history(spec), root / "synthetic", bad=bad, seed=i, max_lines=50)
    return root


@pytest.fixture(scope="module")
def oracle(logs: Path) -> Computed:
    return compute_path(logs)


@pytest.fixture(scope="module")
def spark_out(
    spark: SparkSession, logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("spark-report")
    summary = run_report(str(logs), out, engine="spark", spark=spark)
    return out, summary


def assert_same_table(name: str, got: pd.DataFrame, want: pd.DataFrame) -> None:
    got, want = normalize(got, name), normalize(want, name)
    assert len(got) == len(want), f"{name}: {len(got)} rows from Spark, {len(want)} from pandas"
    for column in COLUMNS[name]:
        a, b = got[column], want[column]
        where = f"{name}.{column}"
        if is_float_dtype(a) or is_float_dtype(b):
            np.testing.assert_allclose(
                a.astype(float),
                b.astype(float),
                rtol=1e-9,
                atol=1e-9,
                equal_nan=True,
                err_msg=where,
            )
        else:
            plain_a = [None if pd.isna(v) else v for v in a]
            plain_b = [None if pd.isna(v) else v for v in b]
            mismatch = [i for i, (x, y) in enumerate(zip(plain_a, plain_b, strict=True)) if x != y]
            assert not mismatch, f"{where}: first difference at row {mismatch[0]}: " + repr(
                (got.iloc[mismatch[0]].to_dict(), want.iloc[mismatch[0]].to_dict())
            )


def what_is_malformed(frame: pd.DataFrame) -> pd.DataFrame:
    """Problems with the detail of malformed lines cut to what it names first: "not JSON",
    "not a JSON object", or the first invalid field. The wording after that is pydantic's
    in the oracle and Spark's in the job; the rest of a problem row must be the same."""
    frame = frame.copy()
    malformed = frame["kind"] == "malformed"
    frame.loc[malformed, "detail"] = [
        str(d).split(":")[0].split(" (")[0].split(".")[0] for d in frame.loc[malformed, "detail"]
    ]
    return frame


@pytest.mark.parametrize("name", list(COLUMNS))
def test_spark_tables_match_the_oracle(
    name: str, spark_out: tuple[Path, dict[str, Any]], oracle: Computed
) -> None:
    out, _ = spark_out
    got, want = pd.read_parquet(out / "tables" / name), oracle.tables[name]
    if name == "problems":
        got, want = what_is_malformed(got), what_is_malformed(want)
        assert {"not JSON", "not a JSON object", "members", "ts", "reason"} <= set(
            want.loc[want["kind"] == "malformed", "detail"]
        )
    assert_same_table(name, got, want)


def test_the_input_is_rich_enough(oracle: Computed) -> None:
    gens = oracle.tables["generations"]
    assert set(gens["strategy"]) == {"sticky", "modulo"}
    assert (gens["members"] == 0).any() and (gens["members"] == 1).any()
    assert gens["load_skew"].notna().any() and gens["handovers"].gt(0).any()
    assert (gens["moves"] > gens["min_moves"]).any()
    assert oracle.stats["malformed"] >= 16 and oracle.stats["unknown_schema"] >= 8
    assert oracle.stats["out_of_order"] >= 12


def test_summaries_agree(
    spark_out: tuple[Path, dict[str, Any]], logs: Path, tmp_path: Path
) -> None:
    _, from_spark = spark_out
    from_pandas = run_report(str(logs), tmp_path, engine="pandas")
    for key in ("input_stats", "empty", "message"):
        assert from_spark[key] == from_pandas[key], key
    assert from_spark["problems"]["by_kind"] == from_pandas["problems"]["by_kind"]
    for section in ("by_strategy", "groups"):
        assert from_spark[section].keys() == from_pandas[section].keys()
        for key, figures in from_spark[section].items():
            for figure, value in figures.items():
                other = from_pandas[section][key][figure]
                if isinstance(value, float) or isinstance(other, float):
                    assert value == pytest.approx(other, rel=1e-9, abs=1e-9), (key, figure)
                else:
                    assert value == other, (key, figure)
    sticky = from_spark["by_strategy"]["sticky"]
    modulo = from_spark["by_strategy"]["modulo"]
    # Sticky moves the minimum except for load rebalances; modulo reshuffles far more.
    assert 1.0 <= sticky["churn_ratio"] < 1.2 < modulo["churn_ratio"]


def test_spark_report_files(spark_out: tuple[Path, dict[str, Any]]) -> None:
    out, summary = spark_out
    assert summary["engine"] == "spark" and summary["master"] == "local[2]"
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["by_strategy"] == json.loads(json.dumps(summary["by_strategy"]))
    html = (out / "report.html").read_text()
    for png in ("skew.png", "moves.png", "heatmap.png", "handover.png"):
        assert (out / "plots" / png).stat().st_size > 5000
        assert f"plots/{png}" in html
    assert "out_of_order" in html and "unknown_schema" in html


def test_spark_jobs_are_named_after_the_report_steps(
    spark: SparkSession, spark_out: tuple[Path, dict[str, Any]]
) -> None:
    """In Spark's UI and event log (here its status store, which both read), every job of
    the report carries the step it ran for: on a cluster that is how one finds where a
    slow report spends its time."""
    jobs = spark.sparkContext._jsc.sc().statusStore().jobsList(None)
    descriptions = [jobs.apply(i).description() for i in range(jobs.size())]
    named = {str(d.get()) for d in descriptions if d.isDefined()}
    for step in (
        "keep parsed lines, events beside their predecessors",
        "keep owner pairs",
        "write ownership",
        "collect generations",
        "collect groups",
    ):
        assert f"shoal: {step}" in named, sorted(named)


def test_a_second_report_reuses_the_compiled_classes(
    spark: SparkSession, logs: Path, spark_out: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A report compiles some 230 classes of generated code. With Spark's default cache of
    100 a second report on the same session (a notebook, a long-lived driver, these tests)
    compiled them all again, and the JIT compiled the new classes again."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    compiles = jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME()
    before = compiles.getCount()
    summary = run_report(str(logs), tmp_path, engine="spark", spark=spark)
    again = compiles.getCount() - before
    assert summary["by_strategy"] == spark_out[1]["by_strategy"]
    assert again <= 25, f"the same report compiled {again} classes again"


def test_empty_input_gives_an_empty_report(spark: SparkSession, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "bad.jsonl").write_text('nonsense\n{"schema": 9}\n')
    (logs / "blank.jsonl").write_text("\n")
    summary = run_report(str(logs), tmp_path / "out", engine="spark", spark=spark)
    assert summary["empty"] is True
    assert summary["message"].startswith("empty report: no usable assignment events")
    assert summary["input_stats"] == {
        "files": 2,
        "lines": 2,
        "events": 0,
        "used": 0,
        "malformed": 1,
        "unknown_schema": 1,
        "out_of_order": 0,
    }
    assert summary["by_strategy"] == {} and summary["groups"] == {}
    assert "empty report" in (tmp_path / "out" / "report.html").read_text()

    nothing = tmp_path / "nothing"
    nothing.mkdir()
    summary = run_report(str(nothing), tmp_path / "out2", engine="spark", spark=spark)
    assert summary["empty"] is True and summary["input_stats"]["files"] == 0


def test_missing_java_is_one_clear_line(tmp_path: Path) -> None:
    empty_path = tmp_path / "bin"
    empty_path.mkdir()
    with pytest.raises(JavaMissing, match="no Java runtime"):
        find_java({"PATH": str(empty_path)})
    with pytest.raises(JavaMissing, match="has no bin/java"):
        find_java({"JAVA_HOME": str(tmp_path), "PATH": os.environ.get("PATH", "")})
    (tmp_path / "logs").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(empty_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal.analytics.cli",
            "report",
            "-i",
            str(tmp_path / "logs"),
            "-o",
            str(tmp_path / "out"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "Error: no Java runtime: the report runs on Spark, which needs Java 17+ (install e.g. "
        "openjdk-17-jre-headless, or set JAVA_HOME)"
    ]


def test_the_command_says_where_its_time_went(
    logs: Path, tmp_path: Path, timed_report: Callable[..., tuple[list[str], dict[str, Any]]]
) -> None:
    """The Spark report through the command (its own JVM): the block names the JVM's start
    and stop, the checkpoints and the steps after them."""
    out = tmp_path / "out"
    args = ("--master", "local[1]", "--driver-memory", "1g", "-i", str(logs), "-o", str(out))
    names, summary = timed_report(*args)
    # The first report of an installation writes its JVM's class-data archive as it
    # exits (shoal.analytics.classarchive), and says so; the others map it.
    assert summary["class_archive"] in ("writing", "mapped")
    writing = summary["class_archive"] == "writing"
    assert names[2:] == [
        "Spark session (the JVM's start)",
        "read, parse and checkpoint",
        "steps after the checkpoints (3 threads)",
        "plots and report.html",
        "stop Spark (the JVM's exit, writing its class-data archive)"
        if writing
        else "stop Spark (the JVM's exit; beside the HTML)",
    ]
    phases = {phase["name"]: phase for phase in summary["timing"]["phases"]}
    kept = [step["name"] for step in phases["read, parse and checkpoint"]["steps"]]
    assert kept[0] == "parsed lines, events beside their predecessors"
    assert kept[-1] == "driver: listing and planning"
    steps = {step["name"] for step in phases["steps after the checkpoints (3 threads)"]["steps"]}
    assert {"write ownership", "collect generations", "collect groups"} <= steps
    # The small tables' CSV files, written as each table is collected, hold the tables.
    for name in ("generations", "groups", "reasons", "by_strategy", "problems"):
        written = pd.read_csv(out / "tables" / f"{name}.csv")
        table = pd.read_parquet(out / "tables" / name)
        assert len(written) == len(table) and list(written.columns) == list(table.columns), name
    assert len(pd.read_csv(out / "tables" / "generations.csv")) == summary["input_stats"]["used"]


def _tricky_lines() -> str:
    """Valid and invalid lines with what a reader of the nested fields could get wrong."""
    base = {
        "schema": 1,
        "ts": "2026-11-21T18:41:08.123Z",
        "namespace": "t",
        "group": "tricky",
        "epoch": 1,
        "leader": "m-0",
        "reason": "join",
        "strategy": "sticky",
        "members": ["m-0", 'm"1'],
    }
    variants: list[dict[str, Any]] = [
        {"assignment": {"0": "m-0", "1": 'm"1'}},  # an escape: full parse
        {"assignment": {"1": "m-0", "0": "m-0", "1": "m-0"}},  # noqa: F601 (unsorted)
        {"assignment": '{"0":"m-0"}'},  # a string holding an object: malformed
        {"assignment": {"0": "m-0"}, "loads": {"0": 12345678.5, "1": 1e-7}},  # Java spells
        {"assignment": {"0": "m-0"}, "moved": [{"to": "m-0", "from": "m-1", "partition": 0}]},
        {"assignment": {"0": "m-0"}, "moved": [{"partition": 0, "from": "", "to": "m-0"}]},
        {"assignment": {"0": "m-0"}, "handover_ms": {"0": -1.0}},
        {"assignment": {}, "handover_ms": {}, "loads": {}, "moved": []},
        {"assignment": {"0": "m-0", "x": "m-0"}},
        # Nulls inside the arrays and maps, found without sorting them (spark_input).
        {"assignment": {"0": "m-0", "1": None}},
        {"assignment": {"0": "m-0", "1": ""}},
        {"assignment": {"0": "m-0"}, "handover_ms": {"0": None}},
        {"assignment": {"0": "m-0"}, "loads": {"0": 1.5, "1": None}},
        {"assignment": {"0": "m-0"}, "moved": [None]},
        {"assignment": {"0": "m-0"}, "moved": [{"partition": -1, "from": "m-1", "to": "m-0"}]},
        {"assignment": {"0": "m-0"}, "members": ["m-0", None]},
    ]
    lines = [
        json.dumps({**base, "generation": i + 1, **variant}, separators=(",", ":"))
        for i, variant in enumerate(variants)
    ]
    lines.append(json.dumps({**base, "generation": 99, "assignment": {"0": "m-0"}}))  # spaces
    return "\n".join(lines) + "\n"


def test_spark_reads_tricky_lines_as_the_model_does(spark: SparkSession, tmp_path: Path) -> None:
    """Escapes, unsorted and duplicate keys, strings holding objects, Java's spelling of
    numbers, bad moves and loads: Spark's reader (spark_input) gives each line the row the
    pandas engine gets from the pydantic model (ingest.parse_file). Left out: the known
    differences spark_input's docstring lists (numbers written as strings, any JSON value
    read into a text field)."""
    from shoal.analytics.ingest import ROW_COLUMNS, parse_file
    from shoal.analytics.spark_input import read_rows

    text = _tricky_lines()
    (tmp_path / "tricky.jsonl").write_text(text)
    rows, _ = read_rows(spark, str(tmp_path), lambda frame: frame)
    got = rows.toPandas().sort_values("line").reset_index(drop=True)
    want = pd.DataFrame(list(parse_file("tricky.jsonl", text.encode())), columns=list(ROW_COLUMNS))
    assert len(got) == len(want) == len(text.splitlines())
    assert (got["kind"] == "malformed").sum() >= 3
    got, want = what_is_malformed(got), what_is_malformed(want)
    # A value of the wrong JSON type fails Spark's parse of the whole line, which then
    # cannot name the field ("event: a field has the wrong JSON type").
    unnamed = got["detail"] == "event"
    assert unnamed.sum() == 1
    want.loc[unnamed, "detail"] = "event"
    for column in ROW_COLUMNS:
        mine = [None if _missing(v) else _plain_value(v) for v in got[column]]
        theirs = [None if _missing(v) else _plain_value(v) for v in want[column]]
        assert mine == theirs, column


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and np.isnan(value)) or value is pd.NaT


def _plain_value(value: Any) -> Any:
    if isinstance(value, np.ndarray | list | tuple):
        return [_plain_value(v) for v in value]
    return value.item() if hasattr(value, "item") else value


def test_parquet_input_gives_the_same_tables_as_json_lines(
    spark: SparkSession, tmp_path: Path
) -> None:
    """`export --format parquet` writes typed columns that the job reads with Spark's own
    Parquet source: its report must be the oracle's on the same events as JSON lines."""
    from shoal.analytics.export import _parquet_encoder

    jsonl, parquet = tmp_path / "jsonl", tmp_path / "parquet"
    parquet.mkdir()
    for i, spec in enumerate(specs_for(2, 40, seed=11)):
        events = list(history(spec))
        write_history(events, jsonl)
        framed = [f"{seq} {seq * 1000} ".encode() + e.to_bytes() for seq, e in enumerate(events, 1)]
        rejected: list[int] = []
        with (parquet / f"part-{i}.parquet").open("wb") as out:
            _parquet_encoder(rejected)(framed, out)
        assert not rejected
    want = compute_path(jsonl)
    assert want.stats["used"] > 100 and set(want.tables["generations"]["strategy"]) == {
        "sticky",
        "modulo",
    }
    summary = run_report(str(parquet), tmp_path / "out", engine="spark", spark=spark)
    assert summary["input_stats"]["used"] == want.stats["used"]
    for name in COLUMNS:
        if name == "problems":
            continue
        got = pd.read_parquet(tmp_path / "out" / "tables" / name)
        assert_same_table(name, got, want.tables[name])


def _events(n: int = 4) -> list[bytes]:
    spec = specs_for(1, n, strategies=("sticky",), partitions=4, seed=3)[0]
    return [e.to_bytes() for e in history(spec)]


def _parsed_stats(spark: SparkSession, path: Path) -> dict[str, int]:
    """What Spark's reader (spark_input.read_rows) makes of the input, counted as the
    oracle counts its input (no report around it: one small job)."""
    from shoal.analytics.spark_input import read_rows

    rows, files = read_rows(spark, str(path), lambda frame: frame)
    kinds = rows.groupBy("kind").count().toPandas()
    counts = {
        k if isinstance(k, str) else "events": int(n)
        for k, n in zip(kinds["kind"], kinds["count"], strict=True)
    }
    return {
        "files": len(files),
        "lines": sum(counts.values()),
        "events": counts.get("events", 0),
        "malformed": counts.get("malformed", 0),
        "unknown_schema": counts.get("unknown_schema", 0),
    }


def _oracle_stats(path: Path) -> dict[str, int]:
    stats = compute_path(path).stats
    return {k: stats[k] for k in ("files", "lines", "events", "malformed", "unknown_schema")}


def test_lines_end_at_newline_only_and_blank_is_any_whitespace(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Spark's text source split lines at a lone \\r too (the pandas engine only at \\n),
    and only spaces made a line blank: a valid event with a \\r as JSON whitespace became
    two malformed lines (its generation lost), a tab-only line was malformed, and the line
    numbers after them shifted."""
    ev = _events()
    cr = ev[1].replace(b'","', b'",\r"', 1)
    lines = [ev[0], b"\t", cr, b" \x0c\r", ev[2] + b"\r", ev[3]]
    (tmp_path / "x.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    want = _oracle_stats(tmp_path)
    assert want["events"] == 4 and want["lines"] == 4 and want["malformed"] == 0
    assert _parsed_stats(spark, tmp_path) == want


def test_an_input_folder_with_glob_characters(spark: SparkSession, tmp_path: Path) -> None:
    """Spark globs the paths it reads: a folder named `logs [prod]` was "not found"."""
    logs = tmp_path / "logs [prod] {a,b} *?"
    logs.mkdir()
    (logs / "a.jsonl").write_bytes(b"\n".join(_events()) + b"\n")
    want = _oracle_stats(logs)
    assert want["events"] == 4
    assert _parsed_stats(spark, logs) == want


def test_a_single_file_is_read_whatever_its_name(spark: SparkSession, tmp_path: Path) -> None:
    """--input names a folder or a file. The pandas engine read any single file; Spark's
    pathGlobFilter (*.jsonl) applies to a single file too, so a file named otherwise gave a
    silently empty report. And Spark's problems named a single file URL-encoded
    (`my%20log.txt`)."""
    log_file = tmp_path / "my log.txt"
    log_file.write_bytes(b"\n".join([*_events(), b"not json"]) + b"\n")
    summary = run_report(str(log_file), tmp_path / "out", engine="spark", spark=spark)
    assert summary["input_stats"] == compute_path(log_file).stats
    assert summary["input_stats"]["used"] == 4
    problems = pd.read_parquet(tmp_path / "out" / "tables" / "problems")
    assert list(problems["file"]) == ["my log.txt"] and list(problems["line"]) == [5]


def test_a_previous_report_or_other_parquet_below_the_input(
    spark: SparkSession, tmp_path: Path
) -> None:
    """`report --input logs --out logs/report` twice, or any *.parquet below the input that
    is not an export (here `x.parquet`, not Parquet at all): the Spark report died in its
    first job with a Java stack (FAILED_READ_FILE). Now only exports (part-*.parquet) are
    read, and nothing below --out."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "a.jsonl").write_bytes(b"\n".join(_events()) + b"\n")
    (logs / "x.parquet").write_bytes(b"junk")
    first = run_report(str(logs), logs / "report", engine="pandas")
    again = run_report(str(logs), logs / "report", engine="spark", spark=spark)
    assert again["input_stats"] == first["input_stats"]
    assert again["input_stats"]["used"] == 4 and again["input_stats"]["files"] == 1


def test_a_missing_input_with_a_scheme_is_one_clear_line(tmp_path: Path) -> None:
    """The command checks that the input exists only for a plain path: for
    `file:///...` Spark's PATH_NOT_FOUND came out as a Python and Java traceback. Now the
    input is looked up through Hadoop's file system, and the failed report leaves no
    --out behind."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal.analytics.cli",
            "report",
            "--input",
            f"file://{tmp_path}/nope",
            "--out",
            str(tmp_path / "out"),
            "--master",
            "local[1]",
            "--driver-memory",
            "1g",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr[-1500:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"Error: input file://{tmp_path}/nope does not exist"
    )
    assert not (tmp_path / "out").exists()
