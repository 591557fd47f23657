"""The Helm chart's copies of what lives elsewhere, checked without a cluster.

The CRD's single source of truth is the top-level crds/consumergroup.yaml; a chart can
only read files inside itself, so the chart carries a byte copy in files/crds/, which
templates/crd.yaml renders (e2e/test_chart.py proves the rendered CRD equals the source,
and e2e/test_helm_upgrade.py that `helm upgrade` updates it). And the
operator creates a Role for each group's pods: Kubernetes refuses that unless the operator
holds every permission the Role grants, so the chart's rules must cover build_role's.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml

from shoal.operator.builders import build_role

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "crds" / "consumergroup.yaml"
CHART = REPO / "charts" / "shoal"
COPY = CHART / "files" / "crds" / "consumergroup.yaml"
HELPERS = CHART / "templates" / "_helpers.tpl"


def test_chart_crd_is_a_copy_of_the_top_level_crd() -> None:
    source, copy = SOURCE.read_bytes(), COPY.read_bytes()
    if source == copy:
        return
    diff = "".join(
        difflib.unified_diff(
            copy.decode(errors="replace").splitlines(keepends=True),
            source.decode(errors="replace").splitlines(keepends=True),
            fromfile=str(COPY.relative_to(REPO)),
            tofile=str(SOURCE.relative_to(REPO)),
            n=1,
        )
    )
    raise AssertionError(
        "charts/shoal/files/crds/consumergroup.yaml differs from crds/consumergroup.yaml "
        "(the source of truth); copy it:\n\n"
        "    cp crds/consumergroup.yaml charts/shoal/files/crds/\n\n" + diff[:4000]
    )


def test_the_chart_ships_no_crds_folder() -> None:
    # Helm would install a crds/ copy before the templates and never upgrade it; with the
    # template rendering the same CRD, the install would also fail on "already exists".
    assert not (CHART / "crds").exists(), "the CRD belongs in files/crds/ (templates/crd.yaml)"


def chart_operator_rules() -> list[dict[str, Any]]:
    """The rules of the `shoal.operatorRules` template (plain YAML inside the define)."""
    match = re.search(
        r'\{\{-? define "shoal\.operatorRules" -?\}\}\n(.*?)\{\{-? end -?\}\}',
        HELPERS.read_text(),
        re.DOTALL,
    )
    assert match, f'{HELPERS} has no define "shoal.operatorRules"'
    rules = yaml.safe_load(match.group(1))
    assert isinstance(rules, list) and rules
    return rules


def test_chart_rbac_covers_the_roles_the_operator_creates() -> None:
    held = {
        (group, resource, verb)
        for rule in chart_operator_rules()
        if not rule.get("resourceNames")  # unrestricted rules cover any name
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    granted = {
        (group, resource, verb)
        for rule in build_role("g", "ns")["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    missing = sorted(granted - held)
    assert not missing, (
        "the operator would be refused creating its groups' Roles (RBAC escalation "
        f"prevention); add to shoal.operatorRules in {HELPERS.relative_to(REPO)}: {missing}"
    )
