"""The report's metrics in plain Python and pandas: the test oracle for the Spark job.

Deliberately written differently from the Spark job: a loop over each group's generations
calling the pure functions of :mod:`shoal.analytics.metrics`, with pandas only for the
aggregations on top. ``report --engine pandas`` uses it for small inputs without Java; the
tests check that both engines produce the same tables.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from shoal.analytics import metrics
from shoal.analytics.ingest import PROBLEM_KINDS, parse_file, parse_parquet
from shoal.analytics.layout import input_files, is_parquet
from shoal.analytics.tables import COLUMNS, KEYS, TIMESTAMP_COLUMNS

__all__ = ["Computed", "compute", "compute_path"]

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


@dataclass
class _Stint:
    member: str
    first: int
    last: int
    start_us: int
    generations: int = 1


class _Out:
    """Rows of every table, appended as the groups advance."""

    def __init__(self) -> None:
        self.generations: list[dict[str, Any]] = []
        # The big tables as tuples in column order (millions of rows at scale).
        self.member_counts: list[tuple[Any, ...]] = []
        self.member_churn: list[tuple[Any, ...]] = []
        self.ownership: list[tuple[Any, ...]] = []
        self.problems: list[dict[str, Any]] = []
        # Hand-over times, columnar: there can be millions.
        self.handover_key: list[tuple[str, str, str]] = []
        self.handover_ms: list[float] = []


class _Group:
    """One group's state between generations: the previous assignment, open stints and
    cumulative churn per member."""

    def __init__(self, namespace: str, group: str, out: _Out) -> None:
        self.ns, self.group, self.out = namespace, group, out
        self.highest: int | None = None
        self.index = 0
        self.previous: dict[int, str] | None = None
        self.previous_us: int | None = None
        self.stints: dict[int, _Stint] = {}
        self.cum: dict[str, list[int]] = {}

    def _close(self, partition: int, stint: _Stint, end_us: int, ended: bool) -> None:
        self.out.ownership.append(
            (
                self.ns,
                self.group,
                partition,
                stint.member,
                stint.first,
                stint.last,
                stint.generations,
                stint.start_us,
                end_us,
                (end_us - stint.start_us) / 1e6,
                ended,
            )
        )

    def add(self, ev: dict[str, Any]) -> None:
        """Use one event (in input order), or record it as out of order."""
        gen, ts_us = ev["generation"], ev["ts_us"]
        if self.highest is not None and gen <= self.highest:
            self.out.problems.append(
                {
                    "file": ev["file"],
                    "line": ev["line"],
                    "kind": "out_of_order",
                    "detail": f"generation {gen} after {self.highest}",
                    "namespace": self.ns,
                    "group": self.group,
                    "generation": gen,
                }
            )
            return
        self.highest = gen
        self.index += 1
        previous = self.previous
        assignment = dict(zip(ev["parts"], ev["owners"], strict=True))
        members = ev["members"]
        counts = metrics.owner_counts(assignment, members)
        stats = metrics.count_stats(counts)
        loads: dict[str, float] | None = None
        load_max = load_mean = load_skew = None
        if ev["has_loads"]:
            loads = metrics.member_loads(
                assignment, members, dict(zip(ev["parts"], ev["loads"], strict=True))
            )
            if loads:
                load_max = max(loads.values())
                load_mean = sum(loads.values()) / len(loads)
                load_skew = load_max / load_mean if load_mean > 0 else None
        moved = metrics.moves(previous, assignment)
        minimum = metrics.min_moves(ev["parts"], members, previous)
        handover = ev["handover"]
        self.out.generations.append(
            {
                "namespace": self.ns,
                "group": self.group,
                "generation": gen,
                "index": self.index,
                "ts": ts_us,
                "epoch": ev["epoch"],
                "leader": ev["leader"],
                "reason": ev["reason"],
                "strategy": ev["strategy"],
                "members": len(members),
                "partitions": len(assignment),
                "min_count": stats.min,
                "max_count": stats.max,
                "mean_count": stats.mean,
                "stddev_count": stats.stddev,
                "max_over_mean": stats.max_over_mean,
                "skew": stats.skew,
                "load_max": load_max,
                "load_mean": load_mean,
                "load_skew": load_skew,
                "moves": moved,
                "moves_recorded": ev["moved_recorded"],
                "min_moves": minimum,
                "churn_ratio": metrics.churn_ratio(moved, minimum),
                "handovers": len(handover),
                "handover_p50": metrics.percentile(handover, 0.5),
                "handover_p90": metrics.percentile(handover, 0.9),
                "handover_p99": metrics.percentile(handover, 0.99),
                "handover_max": max(handover) if handover else None,
                "interval_s": None
                if self.previous_us is None
                else (ts_us - self.previous_us) / 1e6,
            }
        )
        key = (self.ns, self.group, ev["strategy"])
        self.out.handover_key.extend([key] * len(handover))
        self.out.handover_ms.extend(handover)
        member_set = set(members)
        for member, count in counts.items():
            self.out.member_counts.append(
                (
                    self.ns,
                    self.group,
                    gen,
                    member,
                    count,
                    None if loads is None else loads[member],
                    member in member_set,
                )
            )
        # Churn per member and ownership stints.
        gained: dict[str, int] = {}
        lost: dict[str, int] = {}
        stints: dict[int, _Stint] = {}
        for p, owner in assignment.items():
            before = previous.get(p) if previous is not None else None
            if before is not None and before != owner:
                gained[owner] = gained.get(owner, 0) + 1
                lost[before] = lost.get(before, 0) + 1
            stint = self.stints.pop(p, None)
            if stint is not None and stint.member == owner:
                stint.last = gen
                stint.generations += 1
                stints[p] = stint
            else:
                if stint is not None:
                    self._close(p, stint, ts_us, True)
                stints[p] = _Stint(owner, gen, gen, ts_us)
        for p, stint in self.stints.items():  # partitions this generation dropped
            self._close(p, stint, ts_us, True)
        self.stints = stints
        for member in sorted(set(gained) | set(lost)):
            total = self.cum.setdefault(member, [0, 0])
            total[0] += gained.get(member, 0)
            total[1] += lost.get(member, 0)
            self.out.member_churn.append(
                (
                    self.ns,
                    self.group,
                    gen,
                    member,
                    gained.get(member, 0),
                    lost.get(member, 0),
                    total[0],
                    total[1],
                    total[0] + total[1],
                )
            )
        self.previous, self.previous_us = assignment, ts_us

    def finish(self) -> None:
        """Close the stints still open at the group's last generation."""
        if self.previous_us is not None:
            for p, stint in self.stints.items():
                self._close(p, stint, self.previous_us, False)
        self.stints = {}


def _frame(name: str, rows: list[dict[str, Any]] | list[tuple[Any, ...]]) -> pd.DataFrame:
    frame = pd.DataFrame.from_records(rows, columns=COLUMNS[name])
    for column in TIMESTAMP_COLUMNS & set(frame.columns):
        frame[column] = pd.to_datetime(frame[column], unit="us", utc=True)
    return frame.sort_values(KEYS[name], kind="stable").reset_index(drop=True)


def _ratio(moves: int, minimum: int) -> float | None:
    return metrics.churn_ratio(int(moves), int(minimum))


def _pct(values: Iterable[float], q: float) -> float | None:
    return metrics.percentile(list(values), q)


def _groups(
    gens: pd.DataFrame, counts: pd.DataFrame, stints: pd.DataFrame, handover: pd.DataFrame
) -> pd.DataFrame:
    rows: list[dict[str, Any]] = []
    members = (
        counts[counts["is_member"].astype(bool)].groupby(["namespace", "group"])["member"].nunique()
    )
    by_stints = {k: v for k, v in stints.groupby(["namespace", "group"])}
    by_handover = {k: v["handover_ms"] for k, v in handover.groupby(["namespace", "group"])}
    for key, g in gens.groupby(["namespace", "group"]):
        ns, group = str(key[0]), str(key[1])
        first_us = int(g["ts_us"].min())
        last_us = int(g["ts_us"].max())
        span = (last_us - first_us) / 1e6
        intervals = g["interval_s"].dropna()
        s = by_stints.get((ns, group), stints.iloc[0:0])
        ended = s[s["ended"].astype(bool)]
        h = by_handover.get((ns, group), pd.Series(dtype=float))
        rows.append(
            {
                "namespace": ns,
                "group": group,
                "strategies": ",".join(sorted(set(g["strategy"]))),
                "generations": len(g),
                "members_seen": int(members.get((ns, group), 0)),
                "first_ts": first_us,
                "last_ts": last_us,
                "span_s": span,
                "per_hour": (len(g) - 1) / (span / 3600) if span > 0 else None,
                "interval_mean_s": float(intervals.mean()) if len(intervals) else None,
                "interval_p50_s": _pct(intervals, 0.5),
                "max_skew": int(g["skew"].max()),
                "mean_skew": float(g["skew"].mean()),
                "moves": int(g["moves"].sum()),
                "min_moves": int(g["min_moves"].sum()),
                "churn_ratio": _ratio(g["moves"].sum(), g["min_moves"].sum()),
                "handover_p50": _pct(h, 0.5),
                "handover_p99": _pct(h, 0.99),
                "stints": len(s),
                "ownership_mean_generations": (
                    float(ended["generations"].mean()) if len(ended) else None
                ),
                "ownership_mean_s": float(ended["duration_s"].mean()) if len(ended) else None,
            }
        )
    return _frame("groups", rows)


def _by_strategy(gens: pd.DataFrame, handover: pd.DataFrame) -> pd.DataFrame:
    rows: list[dict[str, Any]] = []
    for strategy, g in gens.groupby("strategy"):
        h = handover.loc[handover["strategy"] == strategy, "handover_ms"]
        rows.append(
            {
                "strategy": strategy,
                "groups": len(g.groupby(["namespace", "group"])),
                "generations": len(g),
                "max_skew": int(g["skew"].max()),
                "mean_skew": float(g["skew"].mean()),
                "moves": int(g["moves"].sum()),
                "min_moves": int(g["min_moves"].sum()),
                "churn_ratio": _ratio(g["moves"].sum(), g["min_moves"].sum()),
                "handover_p50": _pct(h, 0.5),
                "handover_p99": _pct(h, 0.99),
            }
        )
    return _frame("by_strategy", rows)


def _reasons(gens: pd.DataFrame) -> pd.DataFrame:
    agg = (
        gens.groupby(["namespace", "group", "reason"])
        .agg(
            generations=("generation", "size"),
            moves=("moves", "sum"),
            min_moves=("min_moves", "sum"),
        )
        .reset_index()
    )
    return _frame("reasons", [{str(k): v for k, v in r.items()} for r in agg.to_dict("records")])


@dataclass
class Computed:
    tables: dict[str, pd.DataFrame]
    stats: dict[str, int]
    handover: pd.DataFrame


def compute(
    rows: Iterable[dict[str, Any]], files: int, progress: Progress | None = None
) -> Computed:
    """Every table of :mod:`shoal.analytics.tables` from parsed rows, in read order.

    Streams: each row is used as it comes (``rows`` may be a generator over the files)."""
    started = time.monotonic()
    out = _Out()
    groups: dict[tuple[str, str], _Group] = {}
    counts = dict.fromkeys(("lines", "events"), 0)
    for row in rows:
        counts["lines"] += 1
        if row["kind"] is not None:
            out.problems.append({c: row[c] for c in COLUMNS["problems"]})
            continue
        counts["events"] += 1
        key = (row["namespace"], row["group"])
        state = groups.get(key)
        if state is None:
            state = groups[key] = _Group(key[0], key[1], out)
        state.add(row)
        if progress is not None and counts["events"] % 10_000 == 0:
            progress(f"pandas: {counts['events']} events ({time.monotonic() - started:.1f} s)")
    for state in groups.values():
        state.finish()
    gens_raw = pd.DataFrame(out.generations, columns=COLUMNS["generations"])
    gens_raw["ts_us"] = gens_raw["ts"]
    handover = pd.DataFrame(
        {
            "namespace": [k[0] for k in out.handover_key],
            "group": [k[1] for k in out.handover_key],
            "strategy": [k[2] for k in out.handover_key],
            "handover_ms": pd.Series(out.handover_ms, dtype=float),
        }
    )
    tables = {
        "generations": _frame("generations", out.generations),
        "member_counts": _frame("member_counts", out.member_counts),
        "member_churn": _frame("member_churn", out.member_churn),
        "ownership": _frame("ownership", out.ownership),
        "problems": _frame("problems", out.problems),
    }
    tables["groups"] = _groups(gens_raw, tables["member_counts"], tables["ownership"], handover)
    tables["by_strategy"] = _by_strategy(gens_raw, handover)
    tables["reasons"] = _reasons(gens_raw)
    stats = {
        "files": files,
        **counts,
        "used": len(out.generations),
        **{kind: sum(1 for p in out.problems if p["kind"] == kind) for kind in PROBLEM_KINDS},
    }
    if progress is not None:
        progress(f"pandas: done ({time.monotonic() - started:.1f} s)")
    return Computed(tables, stats, handover)


def compute_path(
    root: Path, progress: Progress | None = None, exclude: Path | None = None
) -> Computed:
    """:func:`compute` over every file below root (nothing below ``exclude``), reading one
    file at a time."""
    files = input_files(root, exclude)
    base = root if root.is_dir() else root.parent

    def rows() -> Iterator[dict[str, Any]]:
        for path in files:
            name = path.relative_to(base).as_posix()
            if is_parquet(path.name):
                yield from parse_parquet(name, path)
            else:
                yield from parse_file(name, path.read_bytes())

    return compute(rows(), len(files), progress)
