"""Export then report on the assignment log of a real group run.

Real etcd, real nats-server, consumer processes: three members start, a fourth joins, one
leaves. `shoal-analytics export` copies the leader's log, `shoal-analytics report` (PySpark,
in its own process and JVM) reports on it, and the report must tell what happened: every
generation moved exactly the minimum (sticky), the join moved the newcomer's quota, the
leave moved the leaver's partitions.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from harness.fleet import Fleet, settled, wait_for_events, wait_for_status
from shoal.clients.etcd import Etcd
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group

pytestmark = [pytest.mark.e2e, pytest.mark.spark, pytest.mark.timeout(420)]

P = 128


@pytest.fixture
def fleet(make_fleet: Callable[..., Fleet]) -> Fleet:
    return make_fleet(
        handler="shoal.consumer.handlers:noop",
        env={"SHOAL_LEASE_TTL": "5", "SHOAL_KEEPALIVE_INTERVAL": "1", "SHOAL_ACK_WAIT": "2"},
    )


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal.analytics.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


async def test_report_on_a_real_group_run(
    fleet: Fleet,
    etcd: Etcd,
    js: Any,
    nats_url: str,
    etcd_endpoint: str,
    namespace: str,
    group: str,
    tmp_path: Path,
) -> None:
    config = GroupConfig(
        group=group, namespace=namespace, nats_url=nats_url, etcd_endpoints=etcd_endpoint
    )
    await ensure_group(js, config)
    for member in ("c-0", "c-1", "c-2"):
        fleet.start(member)
    three = await wait_for_status(etcd, namespace, group, P, settled({"c-0", "c-1", "c-2"}), 60)
    fleet.start("c-3")
    four = await wait_for_status(
        etcd, namespace, group, P, settled({"c-0", "c-1", "c-2", "c-3"}), 60
    )
    leaver = next(m for m in ("c-1", "c-2", "c-0") if m != four.leader)
    fleet.term(leaver)
    remaining = {"c-0", "c-1", "c-2", "c-3"} - {leaver}
    final = await wait_for_status(etcd, namespace, group, P, settled(remaining), 60)
    assert fleet.wait_exit(leaver, 30) == 0, fleet.logs()
    log = config.log_stream
    # The leader logs a generation once its hand-overs are done: wait for the last one.
    await wait_for_events(
        js,
        log,
        lambda es: any(e["generation"] == final.generation for e in es),
        30,
        f"generation {final.generation}",
    )
    events = int((await js.stream_info(log)).state.messages)
    assert events >= 3

    logs, out = tmp_path / "logs", tmp_path / "report"
    exported = await asyncio.to_thread(
        cli,
        "export",
        "-g",
        group,
        "-n",
        namespace,
        "-o",
        str(logs),
        "--nats-url",
        nats_url,
        timeout=60,
    )
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["messages"] == events
    reported = await asyncio.to_thread(
        cli,
        "report",
        "--input",
        str(logs),
        "--out",
        str(out),
        "--master",
        "local[2]",
        "--driver-memory",
        "1g",
        timeout=300,
    )
    assert reported.returncode == 0, reported.stderr

    summary = json.loads((out / "summary.json").read_text())
    assert summary["input_stats"]["used"] == events
    assert summary["problems"]["count"] == 0
    sticky = summary["by_strategy"]["sticky"]
    assert sticky["generations"] == events
    assert sticky["churn_ratio"] == 1.0 and sticky["moves"] == sticky["min_moves"]
    assert sticky["max_skew"] <= 1
    gens = pd.read_csv(out / "tables" / "generations.csv").sort_values("generation")
    assert (gens["moves"] == gens["min_moves"]).all()
    assert (gens["moves"] == gens["moves_recorded"]).all()
    assert gens.iloc[0]["moves"] == 0 and gens.iloc[0]["reason"] == "initial"

    # The join: exactly the newcomer's quota (128 / 4) moved; the leave: the leaver's share.
    counts = pd.read_parquet(out / "tables" / "member_counts")
    joined = gens[gens["members"] == 4].iloc[0]
    assert joined["reason"] == "join" and joined["moves"] == P // 4 == 32
    # Every move of the join was claimed by its new owner and timed (leader's write to
    # the new owner's claim; generous bound: a busy 2-core host).
    assert joined["handovers"] == 32
    assert 0 <= joined["handover_p50"] <= joined["handover_max"] < 30_000
    newcomer = counts[(counts["generation"] == joined["generation"]) & (counts["member"] == "c-3")]
    assert int(newcomer["partitions"].iloc[0]) == 32
    left = gens.iloc[-1]
    assert left["reason"] == "leave" and left["members"] == 3
    assert left["moves"] == four.counts[leaver]
    churn = pd.read_parquet(out / "tables" / "member_churn")
    lost = churn[(churn["member"] == leaver) & (churn["generation"] == left["generation"])]
    assert int(lost["lost"].iloc[0]) == four.counts[leaver]

    # The report's last generation is what etcd holds now.
    last = counts[counts["generation"] == left["generation"]]
    assert dict(zip(last["member"], last["partitions"], strict=True)) == final.counts
    assert three.counts.keys() <= set(counts["member"])
    assert (out / "report.html").exists() and (out / "plots" / "moves.png").exists()
