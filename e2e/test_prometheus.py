"""A real Prometheus scrapes a running group, and every dashboard query returns data.

On the local plane: the operator (a local process) runs a ConsumerGroup whose handler
rejects every message (so dead letters appear), messages are published, the group is
scaled 2 -> 3 (a rebalance and real hand-overs), and Debian's Prometheus scrapes the
consumer pods every second. The pods share the host's loopback here, so each serves
/metrics on a port of its own, read from its log; the targets carry the labels the
chart's PodMonitor gives them (namespace, group, member), so the dashboard's queries run
unchanged, Grafana's variables replaced by what Grafana would send.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml

from harness.kubetest import condition, create_namespace, get_json, operator_process, wait_until
from harness.localkube.plane import LocalKube
from harness.servers import PrometheusServer
from harness.waiting import eventually
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import GROUP_LABEL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "charts" / "shoal" / "files" / "dashboards" / "shoal.json"
ALERTS = REPO / "charts" / "shoal" / "files" / "prometheus" / "alerts.yaml"
NAMESPACE, GROUP = "prom-test", "orders"
SERVING = re.compile(r"Serving metrics on [0-9.]+:(\d+)/metrics")


def dashboard_queries() -> dict[str, str]:
    """ "panel title / legend" -> PromQL, with Grafana's variables as Grafana sends them."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = {}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = (
                target["expr"]
                .replace("$__rate_interval", "1m")
                .replace("$namespace", NAMESPACE)
                .replace("$group", GROUP)
            )
            queries[f"{panel['title']} / {target['legendFormat']}"] = expr
    return queries


def scrape_targets(plane: LocalKube) -> list[dict[str, Any]]:
    """file_sd targets: each running consumer pod's metrics port, with PodMonitor labels."""
    targets = []
    pods = get_json(plane, "pods", "-n", NAMESPACE, "-l", f"{GROUP_LABEL}={GROUP}")["items"]
    for pod in pods:
        name = pod["metadata"]["name"]
        log = plane.root / "logs" / "pods" / f"{NAMESPACE}_{name}_consumer.log"
        ports = SERVING.findall(log.read_text(errors="replace")) if log.exists() else []
        if ports:
            targets.append(
                {
                    "targets": [f"127.0.0.1:{ports[-1]}"],
                    "labels": {"namespace": NAMESPACE, "group": GROUP, "member": name},
                }
            )
    return targets


def write_targets(plane: LocalKube, path: Path, members: int) -> None:
    targets = wait_until(
        lambda: (t := scrape_targets(plane)) and len(t) == members and t,
        60,
        f"{members} consumer pods serving metrics",
    )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(targets))
    tmp.replace(path)  # atomically: Prometheus may read it at any time


def group_manifest(replicas: int) -> str:
    return json.dumps(
        {
            "apiVersion": "shoal.dev/v1alpha1",
            "kind": "ConsumerGroup",
            "metadata": {"name": GROUP, "namespace": NAMESPACE},
            "spec": {
                "handler": "shoal.consumer.handlers:reject",
                "replicas": replicas,
                "partitions": 16,
                "maxReplicas": 4,
            },
        }
    )


async def publish(plane: LocalKube, count: int, start: int) -> None:
    nc = await nats.connect(plane.state.nats_url)
    try:
        producer = Producer(nc.jetstream(), f"shoal.{NAMESPACE}.{GROUP}", 16)
        items = [Outgoing(f"project-{i % 50}", b"x", f"m-{i}") for i in range(start, start + count)]
        assert await producer.publish_many(items, window=128) == count
    finally:
        await nc.close()


@pytest.fixture()
def running_group(localkube: LocalKube, tmp_path: Path) -> Iterator[LocalKube]:
    plane = localkube
    with operator_process(
        plane,
        [NAMESPACE],
        tmp_path / "operator.log",
        # What the chart's consumerMetrics.port is on this plane: any free port per pod.
        extra_env={"SHOAL_CONSUMER_METRICS_PORT": "0"},
    ):
        create_namespace(plane, NAMESPACE)
        try:
            plane.kubectl("apply", "-f", "-", input_text=group_manifest(2))
            wait_until(
                lambda: (
                    condition(get_json(plane, "cg", GROUP, "-n", NAMESPACE), "Ready").get("status")
                    == "True"
                ),
                90,
                "the group to become Ready",
            )
            yield plane
        finally:
            plane.kubectl("delete", "cg", GROUP, "-n", NAMESPACE, "--timeout=60s", check=False)
            plane.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def test_every_dashboard_query_returns_data(running_group: LocalKube, tmp_path: Path) -> None:
    plane = running_group
    targets = tmp_path / "targets.json"
    write_targets(plane, targets, 2)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        # The chart's alerts, evaluated against the real series (promtool tests their logic).
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": "shoal-consumers", "file_sd_configs": [{"files": [str(targets)]}]}
        ],
    }
    prometheus = PrometheusServer(tmp_path / "prometheus", yaml.safe_dump(config))
    started = time.monotonic()
    with prometheus.start():
        asyncio.run(publish(plane, 400, 0))
        # A join: the leader rebalances and partitions are handed over while messages flow.
        plane.kubectl("scale", "cg", GROUP, "-n", NAMESPACE, "--replicas=3")
        write_targets(plane, targets, 3)
        # Publish again once the newcomer owns its share: its first messages end the
        # hand-overs the latency histogram measures.
        eventually(
            lambda: prometheus.query("count(shoal_partitions_owned > 0)"),
            60,
            "the third member to own partitions",
            until=lambda result: bool(result) and float(result[0]["value"][1]) == 3,
        )
        asyncio.run(publish(plane, 400, 400))

        up = eventually(
            lambda: prometheus.query("up == 1"),
            30,
            "Prometheus to scrape all three members",
            until=lambda result: len(result) == 3,
        )
        assert {series["metric"]["member"] for series in up} == {
            t["labels"]["member"] for t in json.loads(targets.read_text())
        }

        queries = dashboard_queries()

        def empty_queries() -> list[str]:
            return sorted(title for title, expr in queries.items() if not prometheus.query(expr))

        eventually(
            empty_queries,
            60,
            "every dashboard query to return data",
            until=lambda empty: not empty,
            interval=1.0,
        )
        # The variables' queries (label_values) find the group too.
        assert prometheus.query("count by (namespace, group) (shoal_partitions_owned)")
        # The data is the group's: all 16 partitions owned, a leader, dead letters counted.
        owned = prometheus.query(f'sum(shoal_partitions_owned{{group="{GROUP}"}})')
        assert float(owned[0]["value"][1]) == 16
        leaders = prometheus.query(f'sum(shoal_is_leader{{group="{GROUP}"}})')
        assert float(leaders[0]["value"][1]) == 1
        dead = prometheus.query('sum(shoal_messages_processed_total{outcome="dead_letter"})')
        assert float(dead[0]["value"][1]) > 0
        # Hand-overs were measured: the latency panel shows numbers, not NaN (0/0).
        (handover,) = [q for title, q in queries.items() if title.startswith("Hand-over")][:1]
        eventually(
            lambda: [float(s["value"][1]) for s in prometheus.query(handover)],
            20,
            "a measured hand-over latency",
            until=lambda values: any(v == v for v in values),  # NaN != NaN
        )
        # Every alert rule evaluates without error on the real series, and with a healthy
        # group none of those that need no fault (nor the fenced one) fires.
        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
        assert len(rules) == 7
        assert all(r["health"] == "ok" for r in rules), rules
        firing = {r["name"] for r in rules if r["state"] == "firing"}
        assert not firing & {
            "ShoalNoLeader",
            "ShoalPartitionsUnclaimed",
            "ShoalMemberFenced",
            "ShoalPartitionStalled",
            "ShoalHandlerUnreachable",
        }
        # Dead letters are what this group produces: that alert fires.
        eventually(
            lambda: {
                r["name"]: r["state"] for g in prometheus.api("rules")["groups"] for r in g["rules"]
            }["ShoalDeadLetters"],
            20,
            "ShoalDeadLetters to fire",
            until=lambda state: state == "firing",
        )
    print(f"Prometheus phase took {time.monotonic() - started:.1f} s")
