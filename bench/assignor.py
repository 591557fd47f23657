"""Benchmark of the partition assignor: churn per membership change, and speed.

Prints one JSON object per line on stdout, nothing else:

* churn: for every N in 1..--max-members, a join N -> N+1 and a leave N -> N-1 (N >= 2),
  sticky beside the seed's modulo strategy, starting from each strategy's own assignment
  of N members. ``moves`` is how many partitions change owner (each one a hand-over
  pause), ``min_moves`` the fewest any balanced assignment allows, ``skew`` max - min
  partitions per member afterwards. The newcomer is a fresh id; the leaver is the member
  that joined last (what a Deployment scale-down usually removes).
* timing: microseconds per ``assign()`` call (median and p99) for a join, a steady state
  (unchanged members, balanced previous) and a load rebalance.

Run: ``python bench/assignor.py`` (with shoal installed, e.g. ``make venv``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

from shoal.assignor import assign, min_moves, moved, skew


def member_ids(n: int) -> list[str]:
    # Pod-like names whose sort order is unrelated to join order.
    return [f"consumer-{(i * 7919) % 10007:05d}" for i in range(n)]


def emit(record: dict[str, object]) -> None:
    print(json.dumps({"bench": "assignor", **record}), flush=True)


def churn(partitions: int, max_members: int) -> None:
    for n in range(1, max_members + 1):
        ids = member_ids(n + 1)
        changes = [("join", ids[:n], ids[: n + 1])]
        if n >= 2:
            changes.append(("leave", ids[:n], ids[: n - 1]))
        for change, before, after in changes:
            for strategy in ("sticky", "modulo"):
                previous = assign(partitions, before, strategy=strategy)
                current = assign(partitions, after, previous, strategy=strategy)
                emit(
                    {
                        "strategy": strategy,
                        "change": change,
                        "n_from": len(before),
                        "n_to": len(after),
                        "partitions": partitions,
                        "moves": len(moved(previous, current)),
                        "min_moves": min_moves(partitions, after, previous),
                        "skew": skew(current, after),
                    }
                )


def timed(calls: int, fn: Callable[[], object]) -> tuple[float, float]:
    for _ in range(min(calls, 200)):  # warm-up
        fn()
    samples: list[float] = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1000.0)
    samples.sort()
    p99 = samples[min(len(samples) - 1, round(0.99 * (len(samples) - 1)))]
    return statistics.median(samples), p99


def timing(partitions: int, calls: int, n: int, seed: int) -> None:
    ids = member_ids(n + 1)
    before, after = ids[:n], ids[: n + 1]
    previous = assign(partitions, before)
    steady = assign(partitions, after, previous)
    rng = random.Random(seed)
    loads = {p: float(rng.randint(0, 1000)) for p in range(partitions)}
    cases: list[tuple[str, Callable[[], object]]] = [
        ("join", lambda: assign(partitions, after, previous)),
        ("steady", lambda: assign(partitions, after, steady)),
        ("loads", lambda: assign(partitions, after, steady, loads=loads)),
    ]
    for case, fn in cases:
        median, p99 = timed(calls, fn)
        emit(
            {
                "timing": case,
                "strategy": "sticky",
                "n_from": len(before) if case == "join" else len(after),
                "n_to": len(after),
                "partitions": partitions,
                "calls": calls,
                "median_us": round(median, 1),
                "p99_us": round(p99, 1),
            }
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Churn (moves per join/leave, sticky vs modulo) and speed of the "
        "partition assignor; one JSON line per figure on stdout."
    )
    parser.add_argument("--partitions", type=int, default=128, help="partitions (default 128)")
    parser.add_argument(
        "--max-members", type=int, default=32, help="churn for N = 1..this (default 32)"
    )
    parser.add_argument(
        "--calls", type=int, default=5000, help="assign() calls per timing figure (default 5000)"
    )
    parser.add_argument(
        "--timing-members",
        type=int,
        nargs="+",
        default=[3, 31],
        help="time joins N -> N+1 and steady states at N+1 for these N (default 3 31)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random loads")
    parser.add_argument("--no-churn", action="store_true", help="only the timing figures")
    parser.add_argument("--no-timing", action="store_true", help="only the churn figures")
    args = parser.parse_args(argv)
    if min(args.partitions, args.max_members, args.calls, *args.timing_members) < 1:
        parser.error("--partitions, --max-members, --calls and --timing-members must be >= 1")
    if not args.no_churn:
        churn(args.partitions, args.max_members)
    if not args.no_timing:
        for n in args.timing_members:
            timing(args.partitions, args.calls, n, args.seed)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly
        sys.stdout = open(os.devnull, "w")  # so the flush at interpreter exit is silent
        sys.exit(0)
