"""The pandas engine (the Spark job's test oracle) on hand-written corner cases, with the
numbers worked out by hand; and the report's files (summary.json, tables, report.html)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from click.testing import CliRunner

from shoal.analytics.cli import main as cli
from shoal.analytics.generate import history, specs_for, write_edge_cases
from shoal.analytics.layout import InputError
from shoal.analytics.oracle import Computed, compute_path
from shoal.analytics.report import run_report


@pytest.fixture(scope="module")
def edge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("edge")
    write_edge_cases(root)
    return root


@pytest.fixture(scope="module")
def edge(edge_dir: Path) -> Computed:
    return compute_path(edge_dir)


def rows(frame: pd.DataFrame, group: str) -> list[dict[str, Any]]:
    picked = frame[frame["group"] == group]
    return [{str(k): v for k, v in r.items()} for r in picked.to_dict("records")]


def column(computed: Computed, group: str, name: str) -> list[Any]:
    values = [r[name] for r in rows(computed.tables["generations"], group)]
    return [None if pd.isna(v) else v for v in values]


def test_input_counts(edge: Computed) -> None:
    # 5 files: hidden ones, _temporary/ and notes.txt are skipped; blank.jsonl counts.
    assert edge.stats == {
        "files": 5,
        "lines": 22,
        "events": 22,
        "used": 21,
        "malformed": 0,
        "unknown_schema": 0,
        "out_of_order": 1,
    }
    problems = edge.tables["problems"].to_dict("records")
    assert problems == [
        {
            "file": "split/2.jsonl",
            "line": 4,
            "kind": "out_of_order",
            "detail": "generation 2 after 3",
            "namespace": "edge",
            "group": "split",
            "generation": 2,
        }
    ]
    assert "hidden" not in set(edge.tables["generations"]["group"])


def test_a_single_member_never_moves(edge: Computed) -> None:
    assert column(edge, "single", "moves") == [0, 0, 0]
    assert column(edge, "single", "min_moves") == [0, 0, 0]
    assert column(edge, "single", "skew") == [0, 0, 0]
    assert column(edge, "single", "max_over_mean") == [1.0, 1.0, 1.0]
    assert column(edge, "single", "stddev_count") == [0.0, 0.0, 0.0]


def test_leave_and_join_in_one_generation_then_an_empty_group(edge: Computed) -> None:
    # b and c replace a and b: a's 4 partitions move; then nobody; then d starts afresh.
    assert column(edge, "swap", "generation") == [1, 2, 3, 5]
    assert column(edge, "swap", "index") == [1, 2, 3, 4]
    assert column(edge, "swap", "moves") == [0, 4, 0, 0]
    assert column(edge, "swap", "min_moves") == [0, 4, 0, 0]
    assert column(edge, "swap", "churn_ratio") == [1.0, 1.0, 1.0, 1.0]
    assert column(edge, "swap", "members") == [2, 2, 0, 1]
    assert column(edge, "swap", "min_count") == [4, 4, None, 8]
    assert column(edge, "swap", "skew") == [0, 0, 0, 0]
    assert column(edge, "swap", "handover_p50") == [None, 13.5, None, None]
    assert column(edge, "swap", "handover_p90") == pytest.approx([None, 16.3, None, None])
    assert column(edge, "swap", "handovers") == [0, 8, 0, 0]
    assert column(edge, "swap", "interval_s") == [None, 180.0, 60.0, 240.0]


def test_quotas_decide_the_minimum(edge: Computed) -> None:
    # generation 2: quotas a2 b2 c2 d1 from holdings a3 b3 c1: minimum 2; the log moved 2.
    # generation 3: a hand-made balanced assignment moving 3 where 0 were needed.
    # generation 4: five members, ties broken by id: c gives one partition away.
    assert column(edge, "quota", "moves") == [0, 2, 3, 1]
    assert column(edge, "quota", "min_moves") == [0, 2, 0, 1]
    assert column(edge, "quota", "churn_ratio") == [1.0, 1.0, None, 1.0]
    assert column(edge, "quota", "skew") == [2, 1, 1, 1]


def test_outsiders_loads_and_partial_loads(edge: Computed) -> None:
    # generation 2 names an owner "gone" that is not a member: counted (x1 y2 gone1).
    assert column(edge, "outsider", "min_count") == [2, 1, 1]
    assert column(edge, "outsider", "moves") == [0, 2, 1]
    assert column(edge, "outsider", "min_moves") == [0, 0, 1]
    # loads {0: 5, 2: 1.5, 9: 7}: x 5, y 1.5 (partition 9 is not assigned): 5 / 3.25.
    assert column(edge, "outsider", "load_skew") == pytest.approx([5 / 3.25, None, 3.0])
    counts = rows(edge.tables["member_counts"], "outsider")
    gone = [r for r in counts if r["member"] == "gone"]
    assert len(gone) == 1 and gone[0]["is_member"] is False and gone[0]["partitions"] == 1


def test_a_partition_missing_for_a_generation_is_not_a_move(edge: Computed) -> None:
    assert column(edge, "gap", "partitions") == [4, 3, 4]
    assert column(edge, "gap", "moves") == [0, 1, 0]
    stints = rows(edge.tables["ownership"], "gap")
    p3 = [
        (s["member"], s["first_generation"], s["last_generation"], s["ended"])
        for s in stints
        if s["partition"] == 3
    ]
    assert p3 == [("b", 1, 1, True), ("a", 3, 3, False)]


def test_one_group_over_two_files_in_order(edge: Computed) -> None:
    assert column(edge, "split", "generation") == [1, 2, 3, 4]
    assert column(edge, "split", "interval_s") == [None, 60.0, 60.0, 60.25]
    assert column(edge, "split", "reason") == ["initial", "join", "leave", "scale"]
    groups = edge.tables["groups"].set_index("group")
    assert groups.loc["split", "strategies"] == "modulo,sticky"


def test_cumulative_churn_and_stints(edge: Computed) -> None:
    churn = rows(edge.tables["member_churn"], "swap")
    assert [(r["member"], r["gained"], r["lost"], r["cum_moves"]) for r in churn] == [
        ("a", 0, 4, 4),
        ("c", 4, 0, 4),
    ]
    split = pd.DataFrame(rows(edge.tables["member_churn"], "split"))
    last = split.groupby("member")["cum_moves"].last().to_dict()
    totals = split.groupby("member")[["gained", "lost"]].sum().sum(axis=1).to_dict()
    assert last == totals
    groups = edge.tables["groups"].set_index("group")
    assert groups.loc["single", "stints"] == 8  # one open stint per partition
    assert pd.isna(groups.loc["single", "ownership_mean_s"])  # none ended


@pytest.fixture(scope="module")
def pandas_report(edge_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("report")
    run_report(str(edge_dir), out, engine="pandas")
    yield out


def test_report_files(pandas_report: Path) -> None:
    summary = json.loads((pandas_report / "summary.json").read_text())
    assert summary["empty"] is False
    assert summary["input_stats"]["used"] == 21
    assert summary["problems"]["by_kind"] == {
        "malformed": 0,
        "unknown_schema": 0,
        "out_of_order": 1,
    }
    sticky = summary["by_strategy"]["sticky"]
    assert set(sticky) >= {"generations", "max_skew", "mean_skew", "moves", "min_moves"}
    assert sticky["churn_ratio"] == sticky["moves"] / sticky["min_moves"]
    assert summary["groups"]["edge/swap"]["generations"] == 4
    html = (pandas_report / "report.html").read_text()
    for png in ("skew.png", "moves.png", "heatmap.png", "handover.png"):
        assert (pandas_report / "plots" / png).stat().st_size > 5000
        assert f"plots/{png}" in html
    assert "generation 2 after 3" in html
    for name in ("generations", "member_counts", "member_churn", "ownership", "problems"):
        assert len(pd.read_parquet(pandas_report / "tables" / name)) > 0
    assert (pandas_report / "tables" / "by_strategy.csv").exists()


def test_cli_generate_then_report_and_empty_input(tmp_path: Path) -> None:
    runner = CliRunner()
    logs = tmp_path / "logs"
    done = runner.invoke(
        cli,
        [
            "generate",
            "--out",
            str(logs),
            "--groups",
            "1",
            "--generations",
            "40",
            "--malformed",
            "2",
        ],
    )
    assert done.exit_code == 0, done.output
    report = runner.invoke(
        cli, ["report", "--engine", "pandas", "--input", str(logs), "--out", str(tmp_path / "r")]
    )
    assert report.exit_code == 0, report.output
    headline = json.loads(report.stdout.strip().splitlines()[-1])
    assert headline["input_stats"]["malformed"] == 4
    assert set(headline["by_strategy"]) == {"sticky", "modulo"}
    assert headline["by_strategy"]["sticky"]["generations"] == 40

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "bad.jsonl").write_text("garbage\n")
    report = runner.invoke(
        cli, ["report", "--engine", "pandas", "--input", str(empty), "--out", str(tmp_path / "e")]
    )
    assert report.exit_code == 0, report.output
    summary = json.loads((tmp_path / "e" / "summary.json").read_text())
    assert summary["empty"] is True and summary["message"].startswith("empty report")
    assert summary["by_strategy"] == {} and summary["problems"]["count"] == 1
    assert "empty report" in (tmp_path / "e" / "report.html").read_text()

    missing = runner.invoke(
        cli, ["report", "--input", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]
    )
    assert missing.exit_code == 1 and "does not exist" in missing.output


def test_the_command_says_where_its_time_went(
    tmp_path: Path, timed_report: Callable[..., tuple[list[str], dict[str, Any]]]
) -> None:
    logs = tmp_path / "logs"
    runner = CliRunner()
    done = runner.invoke(cli, ["generate", "--out", str(logs), "--groups", "1"])
    assert done.exit_code == 0, done.output
    names, _ = timed_report("--engine", "pandas", "-i", str(logs), "-o", str(tmp_path / "out"))
    assert names[2:] == [
        "read, parse and compute (one pass)",
        "normalize the tables",
        "write tables (parquet)",
        "small tables as CSV",
        "the plots' data",
        "plots and report.html",
    ]


def test_help_describes_every_command() -> None:
    runner = CliRunner()
    top = runner.invoke(cli, ["--help"])
    assert top.exit_code == 0
    for command in ("export", "report", "generate"):
        assert command in top.output
        sub = runner.invoke(cli, [command, "--help"])
        assert sub.exit_code == 0 and "--out" in sub.output


def write_export_parquet(path: Path, generations: int = 20) -> None:
    """A Parquet file exactly as `export --format parquet` writes it."""
    from shoal.analytics.export import _parquet_encoder

    path.parent.mkdir(parents=True, exist_ok=True)
    spec = specs_for(1, generations, strategies=("sticky",), partitions=8, seed=1)[0]
    lines = [
        f"{i + 1} {1_700_000_000_000_000 + i} ".encode() + e.to_bytes()
        for i, e in enumerate(history(spec))
    ]
    with path.open("wb") as f:
        _parquet_encoder([])(lines, f)


def test_the_pandas_engine_reads_parquet_exports(tmp_path: Path) -> None:
    """The README says the report reads the files of `export --format parquet` and that
    --engine pandas computes the same numbers. The pandas engine saw no Parquet file in a
    folder (0 files, an empty report) and read a single .parquet file as text (its bytes
    malformed lines). Now a row is a line (its 1-based row number), as in the Spark engine."""
    write_export_parquet(tmp_path / "pq" / "date=2026-11-21" / "part-x.parquet")
    (tmp_path / "pq" / "notes.parquet").write_bytes(b"not an export")  # not part-*: skipped
    folder = compute_path(tmp_path / "pq")
    assert folder.stats["files"] == 1 and folder.stats["used"] == 20, folder.stats
    single = compute_path(tmp_path / "pq" / "date=2026-11-21" / "part-x.parquet")
    assert single.stats == folder.stats
    assert list(single.tables["generations"]["generation"]) == list(range(1, 21))


def test_a_previous_report_below_the_input_is_left_out(tmp_path: Path) -> None:
    """`report --input logs --out logs/report`, twice: the report's own tables are
    part-*.parquet files below the input, which a reader of Parquet exports must not
    read as input."""
    write_export_parquet(tmp_path / "logs" / "part-x.parquet")
    first = run_report(str(tmp_path / "logs"), tmp_path / "logs" / "report", engine="pandas")
    again = run_report(str(tmp_path / "logs"), tmp_path / "logs" / "report", engine="pandas")
    assert again["input_stats"] == first["input_stats"]
    assert again["input_stats"]["files"] == 1 and again["input_stats"]["used"] == 20


def test_a_failed_report_leaves_no_output_folder(tmp_path: Path) -> None:
    """run_report made --out (and its missing parents) before it looked at the input (or
    for Java): a report that failed left an empty folder behind. A folder that was there
    stays."""
    with pytest.raises(InputError, match="does not exist"):
        run_report(str(tmp_path / "nope"), tmp_path / "new" / "out", engine="pandas")
    assert not (tmp_path / "new").exists()
    (tmp_path / "there").mkdir()
    with pytest.raises(InputError):
        run_report(str(tmp_path / "nope"), tmp_path / "there", engine="pandas")
    assert (tmp_path / "there").is_dir()
