"""The report's PNG plots, drawn with matplotlib's Agg backend (no display, no pyplot state).

Each function takes pandas frames from :class:`shoal.analytics.tables.ReportData`, writes one
PNG and returns True, or returns False without writing when there is nothing to draw.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

__all__ = ["handover_distribution", "heatmap", "moves_vs_minimum", "skew_over_time"]

log = logging.getLogger(__name__)

COLORS = {"sticky": "tab:blue", "modulo": "tab:orange"}
MAX_GROUP_LINES = 16
DPI = 110


def _color(strategy: str) -> str:
    return COLORS.get(strategy, "tab:gray")


def _save(fig: Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)


def _biggest_groups(gens: pd.DataFrame) -> list[tuple[str, str]]:
    sizes = gens.groupby(["namespace", "group"]).size().sort_values(ascending=False)
    return [(str(k[0]), str(k[1])) for k in sizes.index[:MAX_GROUP_LINES]]


def _strategy_legend(ax: Axes, strategies: list[str]) -> None:
    from matplotlib.lines import Line2D

    ax.legend(
        [Line2D([0], [0], color=_color(s)) for s in strategies], strategies, loc="upper right"
    )


def skew_over_time(gens: pd.DataFrame, path: Path) -> bool:
    """Owner-count skew (max - min) per generation over time, one line per group; below it,
    load skew (max / mean member load) when the events carry loads."""
    if gens.empty:
        return False
    with_loads = gens["load_skew"].notna().any()
    fig = Figure(figsize=(10, 6.5 if with_loads else 4), layout="constrained")
    axes = fig.subplots(2 if with_loads else 1, 1, sharex=True, squeeze=False)[:, 0]
    strategies = sorted(gens["strategy"].unique())
    for ns, group in _biggest_groups(gens):
        g = gens[(gens["namespace"] == ns) & (gens["group"] == group)].sort_values("generation")
        color = _color(str(g["strategy"].iloc[-1]))
        axes[0].step(g["ts"], g["skew"], where="post", color=color, alpha=0.6, linewidth=0.9)
        if with_loads:
            axes[1].plot(g["ts"], g["load_skew"], color=color, alpha=0.6, linewidth=0.8)
    axes[0].set_ylabel("skew (partitions, max - min)")
    axes[0].set_title("Skew over time (one line per group)")
    _strategy_legend(axes[0], strategies)
    if with_loads:
        axes[1].set_ylabel("load skew (max / mean)")
    axes[-1].set_xlabel("time (UTC)")
    _save(fig, path)
    return True


def moves_vs_minimum(gens: pd.DataFrame, path: Path) -> bool:
    """Left: moves against the minimum, one point per generation (on the diagonal = minimal).
    Right: cumulative moves (solid) and cumulative minimum (dashed) over time, per strategy."""
    if gens.empty:
        return False
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    top = max(1, int(max(gens["moves"].max(), gens["min_moves"].max())))
    left.plot([0, top], [0, top], color="black", linewidth=0.8, linestyle=":")
    for strategy, g in gens.groupby("strategy"):
        name = str(strategy)
        left.scatter(
            g["min_moves"],
            g["moves"],
            s=8,
            alpha=0.35,
            color=_color(name),
            label=name,
            edgecolors="none",
        )
        ordered = g.sort_values("ts")
        right.plot(ordered["ts"], ordered["moves"].cumsum(), color=_color(name), label=name)
        right.plot(
            ordered["ts"],
            ordered["min_moves"].cumsum(),
            color=_color(name),
            linestyle="--",
            label=f"{name} minimum",
        )
    left.set_xlabel("minimum moves (balanced assignment)")
    left.set_ylabel("moves")
    left.set_title("Moves against the minimum, per generation")
    left.legend(loc="upper left")
    right.set_xlabel("time (UTC)")
    right.set_ylabel("cumulative partitions moved")
    right.set_title("Cumulative moves (solid) and minimum (dashed)")
    right.legend(loc="upper left")
    _save(fig, path)
    return True


def heatmap(counts: pd.DataFrame, path: Path, max_members: int = 32) -> bool:
    """Partitions per member (rows) and generation (columns), one panel per group chosen
    (the longest history of each strategy, generations evenly sampled)."""
    if counts.empty:
        return False
    keys = sorted(
        {(str(a), str(b)) for a, b in zip(counts["namespace"], counts["group"], strict=True)}
    )
    fig = Figure(figsize=(11, 3.2 * len(keys) + 0.6), layout="constrained")
    axes = fig.subplots(len(keys), 1, squeeze=False)[:, 0]
    for ax, (ns, group) in zip(axes, keys, strict=True):
        g = counts[(counts["namespace"] == ns) & (counts["group"] == group)]
        table = g.pivot_table(
            index="member", columns="generation", values="partitions", aggfunc="sum"
        )
        order = table.notna().idxmax(axis=1).sort_values(kind="stable").index
        table = table.loc[order]
        if len(table) > max_members:
            table = table.loc[table.sum(axis=1).nlargest(max_members).index]
        image = ax.imshow(
            table.to_numpy(dtype=float), aspect="auto", interpolation="nearest", cmap="viridis"
        )
        ax.set_yticks(range(len(table.index)), [str(m) for m in table.index], fontsize=6)
        columns = list(table.columns)
        ticks = np.linspace(0, len(columns) - 1, min(10, len(columns))).round().astype(int)
        ax.set_xticks(ticks, [str(columns[i]) for i in ticks], fontsize=7)
        ax.set_xlabel("generation")
        ax.set_title(f"Partitions per member: {ns}/{group}")
        fig.colorbar(image, ax=ax, label="partitions")
    _save(fig, path)
    return True


def handover_distribution(sample: pd.DataFrame, by_strategy: pd.DataFrame, path: Path) -> bool:
    """Histogram of hand-over times (log scale) per strategy, with p50 and p99 marked."""
    values = sample["handover_ms"].astype(float) if not sample.empty else pd.Series(dtype=float)
    values = values[values > 0]
    if values.empty:
        return False
    low, high = float(values.min()), float(values.max())
    if math.isclose(low, high):
        low, high = low / 2, high * 2
    bins = np.logspace(math.log10(low), math.log10(high), 60)
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax = fig.subplots()
    for strategy, g in sample[sample["handover_ms"] > 0].groupby("strategy"):
        name = str(strategy)
        ax.hist(
            g["handover_ms"], bins=bins.tolist(), histtype="step", color=_color(name), label=name
        )
        row = by_strategy[by_strategy["strategy"] == name]
        for column, style in (("handover_p50", "--"), ("handover_p99", ":")):
            if not row.empty and pd.notna(row[column].iloc[0]):
                ax.axvline(float(row[column].iloc[0]), color=_color(name), linestyle=style)
    ax.set_xscale("log")
    ax.set_xlabel("hand-over time (ms); dashed p50, dotted p99")
    ax.set_ylabel("partitions moved")
    ax.set_title("Hand-over latency distribution")
    ax.legend()
    _save(fig, path)
    return True
