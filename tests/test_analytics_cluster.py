"""The report on a real Spark standalone cluster: a master and two workers started from the
pyspark distribution itself (``spark-class ...Master`` / ``...Worker``), loopback only,
small memory. ``shoal-analytics report --master spark://...`` runs in its own process and
must give the oracle's figures; the master must have run it on its workers.

Every process is started in its own process group and the groups are killed at the end,
whatever happened (a worker's executors are its children, in its group).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.children import spawn
from harness.servers import free_port
from shoal.analytics.generate import history, specs_for, write_edge_cases, write_history
from shoal.analytics.report import run_report

pytestmark = [pytest.mark.spark, pytest.mark.e2e, pytest.mark.timeout(900)]

# Requests to the master's own UI must not go through a proxy from the environment.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


@dataclass
class Cluster:
    url: str
    ui: str
    processes: list[subprocess.Popen[bytes]]

    def state(self) -> dict[str, Any]:
        with _HTTP.open(f"{self.ui}/json/", timeout=5) as response:
            state: dict[str, Any] = json.load(response)
        return state


def _start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        # spark-class execs java: the JVM is this child, and dies with this process.
        return spawn(
            [str(spark_home() / "bin" / "spark-class"), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group, killed as one
        )


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for proc in reversed(processes):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for proc in reversed(processes):
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        # Executors a worker started are in its group too; make sure none is left.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for(cluster: Cluster, workers: int, logs: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        for proc, log in zip(cluster.processes, logs, strict=True):
            if proc.poll() is not None:
                raise AssertionError(f"{log.name} exited: {log.read_text()[-2000:]}")
        try:
            alive = [w for w in cluster.state().get("workers", []) if w.get("state") == "ALIVE"]
            if len(alive) >= workers:
                return
        except (OSError, ValueError) as exc:
            # ValueError: the UI answers before it has attached its /json/ page (it once
            # sent its HTML front page there, just after binding).
            last = exc
        time.sleep(0.5)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for log in logs)
    raise AssertionError(f"no {workers} live workers after {timeout} s ({last!r})\n{tails}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("spark-cluster")
    env = {
        **os.environ,
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(root),
        # Small daemons: the master and workers only schedule.
        "SPARK_DAEMON_MEMORY": "256m",
        # No REST submission server: it would bind the fixed port 6066.
        "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
    }
    port, ui = free_port(), free_port()
    url = f"spark://127.0.0.1:{port}"
    processes: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        logs.append(root / "master.log")
        processes.append(
            _start(
                [
                    "org.apache.spark.deploy.master.Master",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--webui-port",
                    str(ui),
                ],
                logs[-1],
                env,
            )
        )
        for i in range(2):
            work = root / f"worker-{i}"
            work.mkdir()
            logs.append(root / f"worker-{i}.log")
            processes.append(
                _start(
                    [
                        "org.apache.spark.deploy.worker.Worker",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(free_port()),
                        "--webui-port",
                        str(free_port()),
                        "--cores",
                        "1",
                        "--memory",
                        "768m",
                        "--work-dir",
                        str(work),
                        url,
                    ],
                    logs[-1],
                    env,
                )
            )
        made = Cluster(url, f"http://127.0.0.1:{ui}", processes)
        _wait_for(made, 2, logs, timeout=120)
        yield made
    finally:
        _stop(processes)
    assert all(proc.poll() is not None for proc in processes)


def test_report_on_a_standalone_cluster_matches_the_oracle(
    cluster: Cluster, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    write_edge_cases(logs / "edge")
    bad = {"malformed": 7, "unknown_schema": 1, "out_of_order": 2}
    for i, spec in enumerate(specs_for(1, 80, seed=11)):
        write_history(history(spec), logs / "synthetic", bad=bad, seed=i, max_lines=30)
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal.analytics.cli",
            "report",
            "--input",
            str(logs),
            "--out",
            str(out),
            "--master",
            cluster.url,
            "--driver-memory",
            "512m",
            # Executors of 512 MB fit the 768 MB workers (Spark's floor is 450 MB).
            "--conf",
            "spark.executor.memory=512m",
            "--conf",
            "spark.driver.host=127.0.0.1",
            "--conf",
            "spark.driver.bindAddress=127.0.0.1",
        ],
        capture_output=True,
        text=True,
        timeout=780,
        check=False,
        env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "spark" and summary["master"] == cluster.url
    assert "where the time went" in done.stderr

    oracle = run_report(str(logs), tmp_path / "oracle", engine="pandas")
    assert summary["input_stats"] == oracle["input_stats"]
    assert summary["input_stats"]["malformed"] == 14
    assert summary["problems"]["by_kind"] == oracle["problems"]["by_kind"]
    for section in ("by_strategy", "groups"):
        assert summary[section].keys() == oracle[section].keys()
        for key, figures in summary[section].items():
            for figure, value in figures.items():
                other = oracle[section][key][figure]
                if isinstance(value, float) or isinstance(other, float):
                    assert value == pytest.approx(other, rel=1e-9, abs=1e-9), (key, figure)
                else:
                    assert value == other, (key, figure)

    # The master ran the report as an application with executors on its workers.
    apps = [a for a in cluster.state().get("completedapps", []) if a["name"] == "shoal-analytics"]
    assert apps, cluster.state()
    assert apps[-1]["cores"] >= 1
