"""The import rules between Shoal's layers (scripts/check_imports.py, run by make lint)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "check_imports.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_imports", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rules = _load()


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_repository_keeps_the_rules() -> None:
    assert rules.check(REPO) == []


def test_each_rule_names_the_file_the_line_and_the_rule(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "common/src/shoal/contracts/names.py": (
                "import json\nfrom shoal.consumer import worker\n"
            ),
            "common/src/shoal/logs.py": "from shoal.contracts import names\n",
            "consumer/src/shoal/consumer/worker.py": "from harness.fleet import Fleet\n",
            "consumer/src/shoal/consumer/etcd.py": "from . import worker\n",
            "operator/src/shoal/operator/reconciler.py": (
                "def later():\n    from ..consumer.etcd import Etcd\n"
            ),
            "analytics/src/shoal/analytics/report.py": "import shoal.consumer.worker\n",
            "common/src/shoal/clients/etcd.py": (
                "from shoal.clients import backoff\nfrom shoal.consumer.config import X\n"
            ),
        },
    )
    problems = rules.check(root, frozenset())
    assert problems == [
        "common/src/shoal/clients/etcd.py:2: shoal.clients.etcd imports "
        "shoal.consumer.config.X: the clients import nothing of Shoal but the contracts "
        "and themselves",
        "common/src/shoal/contracts/names.py:2: shoal.contracts.names imports "
        "shoal.consumer.worker: the contracts and the modules beside them import nothing of "
        "Shoal but the contracts",
        "consumer/src/shoal/consumer/worker.py:1: shoal.consumer.worker imports "
        "harness.fleet.Fleet: "
        "product code never imports the test harness",
        "operator/src/shoal/operator/reconciler.py:2: shoal.operator.reconciler imports "
        "shoal.consumer.etcd: the operator and analytics never import shoal.consumer",
        "analytics/src/shoal/analytics/report.py:1: shoal.analytics.report imports "
        "shoal.consumer.worker: the operator and analytics never import shoal.consumer",
    ]


def test_known_breaks_are_allowed_where_they_stand_and_the_list_only_shrinks(
    tmp_path: Path,
) -> None:
    root = _tree(
        tmp_path,
        {
            "consumer/src/shoal/consumer/etcd.py": "",
            "operator/src/shoal/operator/reconciler.py": "from shoal.consumer.etcd import Etcd\n",
        },
    )
    known = frozenset({("shoal.operator.reconciler", "shoal.consumer.etcd")})
    assert rules.check(root, known) == []
    stale = known | {("shoal.operator.observe", "shoal.consumer.view")}
    assert rules.check(root, stale) == [
        "scripts/check_imports.py: KNOWN lists shoal.operator.observe -> shoal.consumer.view, "
        "which is gone: remove it from the list"
    ]


def test_a_forbidden_import_fails_the_command(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {"common/src/shoal/contracts/spec.py": "from shoal.consumer.config import GroupConfig\n"},
    )
    done = subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True)
    assert done.returncode == 1
    assert "shoal.contracts.spec imports shoal.consumer.config" in done.stderr
    assert "import rule violation(s)" in done.stderr


def test_the_operator_and_analytics_load_no_consumer_module() -> None:
    """Issue 28's check, as a newcomer would run it: `python -X importtime -m
    shoal.operator --help` (and importing every handler of the operator, and analytics'
    commands) loads nothing of shoal.consumer."""
    runs = [
        ["-m", "shoal.operator", "--help"],
        ["-c", "import shoal.operator.reconciler, shoal.operator.cli"],
        ["-c", "import shoal.analytics.cli, shoal.analytics.export, shoal.analytics.generate"],
    ]
    for args in runs:
        done = subprocess.run(
            [sys.executable, "-X", "importtime", *args], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        loaded = [line for line in done.stderr.splitlines() if "shoal.consumer" in line]
        assert loaded == [], (args, loaded)


def test_the_documented_import_paths_still_work() -> None:
    """DESIGN.md's public paths keep a re-export when the code moves."""
    from shoal import assignor
    from shoal.consumer.assignor import assign
    from shoal.consumer.partitioning import partition_for

    assert assign is assignor.assign
    assert assign(4, ["a", "b"]) == {0: "a", 1: "a", 2: "b", 3: "b"}
    assert 0 <= partition_for("project-1") < 128
