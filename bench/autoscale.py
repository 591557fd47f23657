"""Autoscaling on the local control plane: how fast it reacts, and what it buys.

Scenario (harness.autoscale): a ConsumerGroup (ledger handler with 2 ms of CPU-bound
work per message, minReplicas 1, maxReplicas 2, interval 2 s, cooldown 15 s,
targetLagPerMember 4,000, cpuThreshold 90) receives a backlog of 30,000 messages over
1,000 projects at once. Then the same backlog goes to a fixed group of minReplicas
members (autoscaling off). maxReplicas is the host's core count: a member is one Python
process whose throughput is bound by one core (it runs all its partitions' handlers
concurrently), so members beyond the cores add hand-overs, not throughput.

Figures:

* ``time_to_target_replicas_s``: from the backlog's publication to the moment the group's
  members reached the peak replica count the leader chose.
* ``drain_s``: from publication until the work stream was empty, autoscaled and fixed,
  and their ratio (``speedup``).
* ``replicas_over_time``: spec.replicas and members, sampled every ~0.5 s (the series),
  also drawn as a text chart on stderr and as a PNG (``--plot``, by default
  ``bench/results/autoscale-replicas.png``).
* ``audit``: lost + duplicates in the ledger (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from harness import autoscale
from harness.bench import emit, note, run_bench
from harness.kubetest import create_namespace, operator_process
from harness.localkube.plane import LocalKube

BENCH = "autoscale"


def text_chart(series: list[tuple[float, int]], width: int = 60) -> str:
    """One row per replica count, time across: enough to see the shape in a terminal."""
    if not series:
        return "(no samples)"
    end = max(t for t, _ in series) or 1.0
    top = max(r for _, r in series)
    rows = []
    for level in range(top, 0, -1):
        cells = [" "] * (width + 1)
        for t, r in series:
            if r >= level:
                cells[int(t / end * width)] = "#"
        rows.append(f"{level:>2} |{''.join(cells)}")
    rows.append(f"   +{'-' * (width + 1)} {end:.0f} s")
    return "\n".join(rows)


def plot(series: list[tuple[float, int]], members: list[tuple[float, int]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.step([t for t, _ in series], [r for _, r in series], where="post", label="spec.replicas")
    ax.step([t for t, _ in members], [m for _, m in members], where="post", label="members")
    ax.set_xlabel("seconds since the backlog arrived")
    ax.set_ylabel("replicas")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


async def scenario(root: Path, messages: int, plot_path: Path | None) -> None:
    # The plane and the scenario are synchronous (kubectl); keep the event loop free.
    await asyncio.to_thread(_scenario, root, messages, plot_path)


def _scenario(root: Path, messages: int, plot_path: Path | None) -> None:
    options: dict[str, Any] = {
        "messages": messages,
        "max_replicas": 2,
        "cpu_ms": 2.0,
        "delay_ms": 0,
    }
    with LocalKube(root / "plane") as plane:
        with operator_process(plane, ["bench-auto", "bench-fixed"], root / "operator.log"):
            create_namespace(plane, "bench-auto")
            create_namespace(plane, "bench-fixed")
            note(f"autoscaled group: {messages} messages over 1,000 projects")
            auto = autoscale.run(plane, "bench-auto", autoscaling=True, **options)
            autoscale.delete(plane, "bench-auto")
            note("fixed group of minReplicas (1) members, same backlog")
            fixed = autoscale.run(plane, "bench-fixed", autoscaling=False, **options)
            autoscale.delete(plane, "bench-fixed")
    peak = max(r for _, r in auto.replicas)
    reached = auto.peak_s is not None
    emit(BENCH, "time_to_target_replicas_s", auto.peak_s, peak_replicas=peak, ok=reached)
    speedup = fixed.drained_s / auto.drained_s if auto.drained_s and fixed.drained_s else None
    emit(
        BENCH,
        "drain_s",
        auto.drained_s,
        fixed=fixed.drained_s,
        speedup=speedup,
        publish_s=auto.published_s,
        messages=messages,
    )
    emit(
        BENCH,
        "replicas_over_time",
        len(auto.changes()),
        changes=[[round(t, 1), a, b] for t, a, b in auto.changes()],
        series=[[round(t, 1), r] for t, r in auto.replicas],
        members=[[round(t, 1), m] for t, m in auto.members],
    )
    print(text_chart(auto.replicas), file=sys.stderr)
    png = plot_path or root / "replicas.png"
    if plot(auto.replicas, auto.members, png):
        note(f"plot: {png}")
    problems = 0
    for name, line in (("autoscaled", auto), ("fixed", fixed)):
        assert line.audit is not None
        summary = line.audit.summary()
        problems += summary["lost"] + summary["duplicates"]
        emit(BENCH, f"audit_{name}", summary["lost"] + summary["duplicates"], **summary)
    emit(BENCH, "audit", problems, ok=problems == 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=30_000)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--plot",
        type=Path,
        default=Path("bench/results/autoscale-replicas.png"),
        help="where to draw replicas over time (PNG; default %(default)s)",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 on a missed target")
    args = parser.parse_args()
    return run_bench(
        "shoal-bench-autoscale-",
        args.keep,
        args.strict,
        lambda root: scenario(root, args.messages, args.plot),
    )


if __name__ == "__main__":
    sys.exit(main())
