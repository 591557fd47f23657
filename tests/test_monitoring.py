"""The dashboard and the alerts against the metrics the consumer really exports.

They are text (charts/shoal/files/): a renamed metric or a label the scrape never adds
would leave a panel empty or an alert silent without anything failing. Here every series
they query must exist in shoal.consumer.metrics, and every label they group by must be
one the series carry (the metric's own, or the PodMonitor's namespace, group, member).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import generate_latest

from shoal.consumer.metrics import Metrics

CHART = Path(__file__).resolve().parent.parent / "charts" / "shoal"
DASHBOARD = CHART / "files" / "dashboards" / "shoal.json"
ALERTS = CHART / "files" / "prometheus" / "alerts.yaml"
PODMONITOR_LABELS = {"namespace", "group", "member"}


def dashboard_queries() -> dict[str, list[str]]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return {
        panel["title"]: [target["expr"] for target in panel["targets"]]
        for panel in dashboard["panels"]
    }


def alert_queries() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}


def exported() -> dict[str, set[str]]:
    """Series name -> its labels, as a member's /metrics serves them (fencing watched)."""
    metrics = Metrics()
    metrics.watch_fencing(lambda: False)
    metrics.messages.ok += 1
    metrics.messages.observe_handler(0.01)
    metrics.handover_seconds.observe(0.1)
    series: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def all_queries() -> list[str]:
    return [q for qs in dashboard_queries().values() for q in qs] + list(alert_queries().values())


def test_every_queried_series_is_exported_with_the_labels_used() -> None:
    series = exported()
    for query in all_queries():
        names = set(re.findall(r"\bshoal_[a-z_]+\b", query))
        assert names, query
        for name in names:
            assert name in series, f"{name} (in {query!r}) is not exported: {sorted(series)}"
        allowed = PODMONITOR_LABELS.union(*(series[name] for name in names))
        for clause in re.findall(r"\b(?:by|on) \(([^)]*)\)", query):
            used = {label.strip() for label in clause.split(",")}
            assert used <= allowed, f"{query!r} groups by {used - allowed}, which no series has"


def test_the_dashboard_has_the_panels_platform_teams_ask_for() -> None:
    titles = set(dashboard_queries())
    assert {
        "Throughput",
        "Lag per group",
        "Lag per member",
        "Partitions per member",
        "Hand-over latency",
        "Rebalances",
        "Dead letters",
        "Leader and fenced members",
        "Oldest held message",
        "Members whose handler is away",
    } <= titles
    # Grafana's sidecar imports it as is: the data source is a variable, not a fixed uid.
    assert '"uid": "${datasource}"' in DASHBOARD.read_text()


def test_the_alerts_platform_teams_ask_for() -> None:
    assert set(alert_queries()) == {
        "ShoalNoLeader",
        "ShoalPartitionsUnclaimed",
        "ShoalLagGrowing",
        "ShoalDeadLetters",
        "ShoalMemberFenced",
        "ShoalPartitionStalled",
        "ShoalHandlerUnreachable",
    }


def test_fenced_is_read_at_scrape_time() -> None:
    metrics = Metrics()
    fenced = [False]
    metrics.watch_fencing(lambda: fenced[0])
    assert b"shoal_fenced 0.0" in generate_latest(metrics.registry)
    fenced[0] = True
    assert b"shoal_fenced 1.0" in generate_latest(metrics.registry)


def test_every_outcome_is_exported_from_zero() -> None:
    """ShoalDeadLetters is increase(...{outcome="dead_letter"}[5m]) > 0: a series that
    first appears at 2 has no step to increase from, so a member's first dead letters
    (one poison message, or a burst within a scrape) raised nothing. Before, an outcome
    was exported only once counted."""
    metrics = Metrics()
    text = generate_latest(metrics.registry).decode()
    for outcome in ("ok", "retry", "dead_letter"):
        assert f'shoal_messages_processed_total{{outcome="{outcome}"}} 0.0' in text, text
    metrics.messages.dead_letter += 2
    text = generate_latest(metrics.registry).decode()
    assert 'shoal_messages_processed_total{outcome="dead_letter"} 2.0' in text
