"""`helm upgrade` updates the ConsumerGroup CRD (templates/crd.yaml, not crds/).

On the local plane: install the chart, change a CEL rule in a copy of the chart, upgrade,
and the API server enforces the new rule; upgrade back, and the old rule is back.
Uninstalling keeps the CRD (crds.keep). The operator's image is one the process kubelet
does not have, so no operator runs: the test is about the CRD alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from harness.kubetest import adopt_crd_for_helm, get_json
from harness.localkube.plane import LocalKube
from harness.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "shoal"
CRD = "consumergroups.shoal.dev"
RELEASE, NAMESPACE = "shoal-upgrade", "shoal-upgrade"
OLD_RULE = "- rule: self.minReplicas <= self.maxReplicas"
NEW_RULE = "- rule: self.minReplicas < self.maxReplicas"
NEW_MESSAGE = "minReplicas must be below maxReplicas (rule changed by an upgrade)"


def run(plane: LocalKube, *command: str, input_text: str | None = None) -> str:
    result = subprocess.run(
        list(command),
        env={**os.environ, **plane.env()},
        capture_output=True,
        text=True,
        input=input_text,
        timeout=200,
    )
    assert result.returncode == 0, f"{command}: {result.stdout}{result.stderr}"
    return result.stdout


def helm_install_or_upgrade(plane: LocalKube, chart: Path) -> None:
    run(
        plane,
        "helm",
        "upgrade",
        "--install",
        RELEASE,
        str(chart),
        "-n",
        NAMESPACE,
        "--create-namespace",
        "-f",
        str(plane.root / "values.yaml"),
        # No image the process kubelet runs: the operator pod waits, nothing reconciles.
        "--set",
        "image.repository=not-on-this-node",
        "--set",
        f"watchNamespaces={{{NAMESPACE}}}",
    )


def dry_run_group(plane: LocalKube) -> subprocess.CompletedProcess[str]:
    """Create (server-side dry run: admission and CEL, nothing stored) a group whose
    minReplicas equals maxReplicas: valid under the old rule, not under the new one."""
    group = {
        "apiVersion": "shoal.dev/v1alpha1",
        "kind": "ConsumerGroup",
        "metadata": {"name": "bounds", "namespace": NAMESPACE},
        "spec": {"handler": "shoal.consumer.handlers:noop", "minReplicas": 3, "maxReplicas": 3},
    }
    return plane.kubectl(
        "create", "--dry-run=server", "-f", "-", check=False, input_text=json.dumps(group)
    )


def crd_rules(plane: LocalKube) -> list[str]:
    crd = get_json(plane, "crd", CRD)
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return [rule["rule"] for rule in spec["x-kubernetes-validations"]]


def test_helm_upgrade_updates_the_crd_and_the_api_server_enforces_it(
    localkube: LocalKube, tmp_path: Path
) -> None:
    plane = localkube
    changed = tmp_path / "shoal"
    shutil.copytree(CHART, changed)
    copy = changed / "files" / "crds" / "consumergroup.yaml"
    text = copy.read_text()
    assert text.count(OLD_RULE) == 1
    copy.write_text(
        text.replace(
            OLD_RULE + "\n                  message: minReplicas must not exceed maxReplicas",
            NEW_RULE + f"\n                  message: {NEW_MESSAGE}",
        )
    )
    assert NEW_MESSAGE in copy.read_text()

    adopt_crd_for_helm(plane, RELEASE, NAMESPACE)
    started = time.monotonic()
    try:
        helm_install_or_upgrade(plane, CHART)
        plane.kubectl("wait", "--for=condition=Established", f"crd/{CRD}", "--timeout=60s")
        assert (
            get_json(plane, "crd", CRD)["metadata"]["annotations"]["meta.helm.sh/release-name"]
            == RELEASE
        )
        accepted = dry_run_group(plane)
        assert accepted.returncode == 0, accepted.stderr

        helm_install_or_upgrade(plane, changed)
        assert "self.minReplicas < self.maxReplicas" in crd_rules(plane)
        # The API server compiles the new schema asynchronously: poll until it refuses.
        refused = eventually(
            lambda: dry_run_group(plane),
            30,
            "the API server to enforce the upgraded rule",
            until=lambda result: result.returncode != 0,
            interval=0.5,
        )
        assert NEW_MESSAGE in refused.stderr, refused.stderr

        # Back to the released chart: the old rule is back, and so is the group.
        helm_install_or_upgrade(plane, CHART)
        eventually(
            lambda: dry_run_group(plane),
            30,
            "the API server to accept the group again after the downgrade",
            until=lambda result: result.returncode == 0,
            interval=0.5,
        )
        print(f"install, two upgrades and their checks took {time.monotonic() - started:.1f} s")
    finally:
        subprocess.run(
            ["helm", "uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "60s"],
            env={**os.environ, **plane.env()},
            capture_output=True,
            timeout=120,
        )
        plane.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
    # crds.keep: the uninstall left the CRD (and so every group of the cluster).
    assert get_json(plane, "crd", CRD)["metadata"]["name"] == CRD
    assert "self.minReplicas <= self.maxReplicas" in crd_rules(plane)
