"""report.html: the summary, tables and plots as one static page (PNG files beside it)."""

from __future__ import annotations

import html
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from shoal.analytics import plots
from shoal.analytics.report import HEATMAP_MEMBERS, plain
from shoal.analytics.tables import ReportData

__all__ = ["draw_generation_plots", "write_html"]

log = logging.getLogger(__name__)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.6em 0; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: right; }
th { background: #f4f4f4; } td.text { text-align: left; }
.note { color: #555; } .empty { font-size: 1.2em; background: #fff4d6; padding: 0.8em; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
"""


def _cell(value: Any) -> tuple[str, bool]:
    value = plain(value)
    if value is None:
        return "-", False
    if isinstance(value, bool):
        return ("yes" if value else "no"), True
    if isinstance(value, float):
        return (f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"), False
    if isinstance(value, int):
        return f"{value:,}", False
    return html.escape(str(value)), True


def _table(frame: pd.DataFrame, columns: Sequence[str] | None = None, limit: int = 100) -> str:
    if frame.empty:
        return '<p class="note">(none)</p>'
    columns = list(columns or frame.columns)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for record in frame[columns].head(limit).to_dict("records"):
        cells = []
        for column in columns:
            text, is_text = _cell(record[column])
            cells.append(f'<td class="text">{text}</td>' if is_text else f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    more = (
        f'<p class="note">first {limit} of {len(frame)} rows; all of them are in the tables '
        "folder</p>"
        if len(frame) > limit
        else ""
    )
    return f"<table><tr>{head}</tr>{''.join(body)}</table>{more}"


Plot = tuple[str, str, Callable[[Path], bool]]


def _generation_plots(gens: pd.DataFrame) -> list[Plot]:
    return [
        ("skew.png", "Skew over time", lambda p: plots.skew_over_time(gens, p)),
        (
            "moves.png",
            "Moves against the minimum",
            lambda p: plots.moves_vs_minimum(gens, p),
        ),
    ]


def _draw(jobs: list[Plot], folder: Path) -> dict[str, bool]:
    """Which of the plots were drawn (a plot must never cost the rest of the report)."""
    drawn: dict[str, bool] = {}
    for name, _, draw in jobs:
        try:
            drawn[name] = draw(folder / name)
        except Exception:
            log.exception("Could not draw %s", name)
            drawn[name] = False
    return drawn


def draw_generation_plots(gens: pd.DataFrame, out: Path) -> dict[str, bool]:
    """The plots drawn from the generations table alone, into ``out/plots``: an engine
    that has the table before the rest of the report may draw them meanwhile (the Spark
    engine does, in a thread, while Spark collects the other tables) and hand the result
    to :func:`write_html` in ``ReportData.early_plots``."""
    return _draw(_generation_plots(gens), out / "plots")


def _plots(data: ReportData, out: Path) -> list[tuple[str, str]]:
    gens = data.tables["generations"]
    folder = out / "plots"
    early = _generation_plots(gens)
    late: list[Plot] = [
        (
            "heatmap.png",
            "Partitions per member",
            lambda p: plots.heatmap(data.heatmap, p, HEATMAP_MEMBERS),
        ),
        (
            "handover.png",
            "Hand-over latency",
            lambda p: plots.handover_distribution(
                data.handover_sample, data.tables["by_strategy"], p
            ),
        ),
    ]
    drawn = data.early_plots.result() if data.early_plots is not None else _draw(early, folder)
    drawn.update(_draw(late, folder))
    return [(f"plots/{name}", title) for name, title, _ in [*early, *late] if drawn.get(name)]


def write_html(data: ReportData, summary: dict[str, Any], out: Path) -> Path:
    stats = summary["input_stats"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        "<title>Shoal assignment report</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>Shoal assignment report: skew and churn</h1>",
        f"<p class='note'>Generated {html.escape(summary['generated_at'])} by the "
        f"{html.escape(summary['engine'])} engine from {html.escape(summary['input'])}.</p>",
    ]
    if summary["empty"]:
        parts.append(f"<p class='empty'>{html.escape(summary['message'])}</p>")
    else:
        parts.append(f"<p>{html.escape(summary['message'])}.</p>")
    parts += [
        "<h2>Input</h2>",
        _table(pd.DataFrame([stats])),
        "<p class='note'>Problems are never fatal: malformed lines, unknown schema versions "
        "and out-of-order events (a generation not above an earlier one of the same group) "
        "are counted here, listed below and left out of every figure.</p>",
    ]
    if not summary["empty"]:
        parts += [
            "<h2>Strategies side by side</h2>",
            "<p class='note'>churn_ratio = moves / min_moves over all generations (1.0 = "
            "every change moved only what a balanced assignment had to; empty = moves "
            "where the minimum was 0, e.g. load rebalancing).</p>",
            _table(data.tables["by_strategy"]),
        ]
        for src, title in _plots(data, out):
            parts.append(f"<h2>{html.escape(title)}</h2><img src='{src}' alt='{title}'>")
        parts += [
            "<h2>Groups</h2>",
            "<p class='note'>per_hour: generations per hour (rebalance frequency); stints: "
            "spells of one member owning one partition; ownership means over the stints "
            "that ended.</p>",
            _table(data.tables["groups"]),
            "<h2>Reasons</h2>",
            _table(data.tables["reasons"]),
            "<h2>Cumulative churn per member (top 30)</h2>",
            _table(data.member_totals, limit=30),
            "<h2>Generations (latest 50)</h2>",
            _table(
                data.tables["generations"].sort_values("ts", ascending=False),
                [
                    "namespace",
                    "group",
                    "generation",
                    "ts",
                    "reason",
                    "strategy",
                    "members",
                    "skew",
                    "max_over_mean",
                    "load_skew",
                    "moves",
                    "min_moves",
                    "churn_ratio",
                    "handover_p50",
                    "handover_p99",
                ],
                limit=50,
            ),
        ]
    parts += ["<h2>Problems</h2>", _table(data.tables["problems"]), "</body></html>"]
    path = out / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
