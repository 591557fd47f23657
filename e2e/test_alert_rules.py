"""The chart's alert rules under `promtool` (Debian's prometheus package).

`promtool check rules` validates charts/shoal/files/prometheus/alerts.yaml, the file the
PrometheusRule ships, and `promtool test rules` runs e2e/promtool/alerts_test.yaml: every
alert fires on the series that should raise it and stays quiet on those that should not.
Marked e2e because it needs the binary `make test` installs (scripts/ensure-prometheus.sh).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "charts" / "shoal" / "files" / "prometheus" / "alerts.yaml"
RULE_TESTS = Path(__file__).resolve().parent / "promtool" / "alerts_test.yaml"
ALERTS = {
    "ShoalNoLeader",
    "ShoalPartitionsUnclaimed",
    "ShoalLagGrowing",
    "ShoalDeadLetters",
    "ShoalMemberFenced",
    "ShoalPartitionStalled",
    "ShoalHandlerUnreachable",
}


def promtool() -> str:
    path = os.environ.get("SHOAL_PROMTOOL") or shutil.which("promtool")
    assert path, "no promtool: run `bash scripts/ensure-prometheus.sh` (or `make test`)"
    return path


def test_the_rule_file_is_valid() -> None:
    result = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout, result.stdout


def test_every_alert_fires_when_it_should_and_only_then() -> None:
    tested = RULE_TESTS.read_text()
    for alert in ALERTS:
        assert f"alertname: {alert}" in tested, f"no promtool case for {alert}"
    result = subprocess.run(
        [promtool(), "test", "rules", str(RULE_TESTS)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=RULE_TESTS.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr
