"""The report's tables: names, columns and meaning, shared by both engines.

Every table is keyed by ``namespace`` and ``group`` (a group's generations are compared only
with each other). Times are UTC timestamps; durations are seconds. The engines must produce
the same rows with these columns in this order (``tests/test_analytics_parity.py``).

generations
    One row per generation used (valid and in order): ``index`` is its 1-based position in
    its group, owner-count statistics over members and non-member owners, ``skew`` = max -
    min (0 with nobody to count), load figures when the event has loads (``load_skew`` =
    max member load / mean member load), ``moves`` (from the previous generation's
    assignment), ``moves_recorded`` (the length of the event's own ``moved`` list),
    ``min_moves``, ``churn_ratio``, hand-over percentiles (linear interpolation) and
    ``interval_s`` since the previous generation.
member_counts
    Partitions (and summed load) per member and non-member owner, per generation.
member_churn
    Per generation and member with a change: partitions gained and lost, and the running
    totals (cumulative churn).
ownership
    One row per stint: a partition owned by one member over consecutive generations. A stint
    ``ended`` when a later generation gave the partition to someone else (or dropped it);
    ``end`` is that generation's time, else the group's last time (still open).
groups
    Per group: generations, rebalance frequency (``per_hour``, intervals), skew, moves,
    minimum, churn ratio, hand-over percentiles, ownership stints.
reasons
    Per group and reason: generations, moves, minimum.
by_strategy
    Per strategy (of the generation): the figures ``summary.json`` carries.
problems
    Every line or event that was not used, with ``kind`` malformed, unknown_schema or
    out_of_order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from concurrent.futures import Future

__all__ = [
    "BIG_TABLES",
    "COLUMNS",
    "INTEGER_COLUMNS",
    "KEYS",
    "TIMESTAMP_COLUMNS",
    "ReportData",
]

COLUMNS: dict[str, list[str]] = {
    "generations": [
        "namespace",
        "group",
        "generation",
        "index",
        "ts",
        "epoch",
        "leader",
        "reason",
        "strategy",
        "members",
        "partitions",
        "min_count",
        "max_count",
        "mean_count",
        "stddev_count",
        "max_over_mean",
        "skew",
        "load_max",
        "load_mean",
        "load_skew",
        "moves",
        "moves_recorded",
        "min_moves",
        "churn_ratio",
        "handovers",
        "handover_p50",
        "handover_p90",
        "handover_p99",
        "handover_max",
        "interval_s",
    ],
    "member_counts": [
        "namespace",
        "group",
        "generation",
        "member",
        "partitions",
        "load",
        "is_member",
    ],
    "member_churn": [
        "namespace",
        "group",
        "generation",
        "member",
        "gained",
        "lost",
        "cum_gained",
        "cum_lost",
        "cum_moves",
    ],
    "ownership": [
        "namespace",
        "group",
        "partition",
        "member",
        "first_generation",
        "last_generation",
        "generations",
        "start",
        "end",
        "duration_s",
        "ended",
    ],
    "groups": [
        "namespace",
        "group",
        "strategies",
        "generations",
        "members_seen",
        "first_ts",
        "last_ts",
        "span_s",
        "per_hour",
        "interval_mean_s",
        "interval_p50_s",
        "max_skew",
        "mean_skew",
        "moves",
        "min_moves",
        "churn_ratio",
        "handover_p50",
        "handover_p99",
        "stints",
        "ownership_mean_generations",
        "ownership_mean_s",
    ],
    "reasons": ["namespace", "group", "reason", "generations", "moves", "min_moves"],
    "by_strategy": [
        "strategy",
        "groups",
        "generations",
        "max_skew",
        "mean_skew",
        "moves",
        "min_moves",
        "churn_ratio",
        "handover_p50",
        "handover_p99",
    ],
    "problems": ["file", "line", "kind", "detail", "namespace", "group", "generation"],
}

# A sort order that makes each table's rows unique (for comparisons and stable output).
KEYS: dict[str, list[str]] = {
    "generations": ["namespace", "group", "generation"],
    "member_counts": ["namespace", "group", "generation", "member"],
    "member_churn": ["namespace", "group", "member", "generation"],
    "ownership": ["namespace", "group", "partition", "first_generation"],
    "groups": ["namespace", "group"],
    "reasons": ["namespace", "group", "reason"],
    "by_strategy": ["strategy"],
    "problems": ["file", "line"],
}

TIMESTAMP_COLUMNS = {"ts", "start", "end", "first_ts", "last_ts"}

# Whole numbers, kept integral even where some rows have none (pandas' nullable Int64).
INTEGER_COLUMNS = {
    "line",
    "generation",
    "index",
    "epoch",
    "members",
    "partitions",
    "min_count",
    "max_count",
    "skew",
    "moves",
    "moves_recorded",
    "min_moves",
    "handovers",
    "gained",
    "lost",
    "cum_gained",
    "cum_lost",
    "cum_moves",
    "partition",
    "first_generation",
    "last_generation",
    "generations",
    "members_seen",
    "max_skew",
    "stints",
    "groups",
}

# Tables with a row per member or partition and generation: the Spark engine writes them
# and hands only samples to the HTML report.
BIG_TABLES = ("member_counts", "member_churn", "ownership")


@dataclass
class ReportData:
    """What the summary and the HTML report are made of (pandas, on the driver).

    ``tables`` holds every small table in full; for the big ones it may hold only what the
    plots need (``heatmap`` rows of member_counts, ``handover_sample``), with the full
    tables written by the engine itself. ``stats`` counts the input: files, lines, events,
    used, and one entry per problem kind.
    """

    tables: dict[str, pd.DataFrame]
    stats: dict[str, int]
    heatmap: pd.DataFrame
    handover_sample: pd.DataFrame
    member_totals: pd.DataFrame
    engine: str
    extra: dict[str, Any] = field(default_factory=dict)
    # The plots of the generations table, if the engine started drawing them early (see
    # shoal.analytics.html_report.draw_generation_plots): which were drawn.
    early_plots: Future[dict[str, bool]] | None = None


def normalize(frame: pd.DataFrame, name: str) -> pd.DataFrame:
    """Columns in table order, rows in key order, timestamps as UTC-aware."""
    frame = frame.loc[:, COLUMNS[name]].copy()
    for column in TIMESTAMP_COLUMNS & set(frame.columns):
        frame[column] = pd.to_datetime(frame[column], utc=True)
    for column in INTEGER_COLUMNS & set(frame.columns):
        frame[column] = frame[column].astype("Int64")
    return frame.sort_values(KEYS[name], kind="stable").reset_index(drop=True)
