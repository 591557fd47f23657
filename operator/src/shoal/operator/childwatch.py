"""Which of a group's other children exist: its ServiceAccount, Role, RoleBinding and
PodDisruptionBudget, as one watch per kind sees them.

Nothing runs the reconcile handlers when someone deletes one of them by hand (the
ConsumerGroup did not change), and nothing else would notice: without its Role the
leader's autoscaler is refused every call, without its ServiceAccount no member pod can
be created again, without its PDB a drain evicts every member at once. The status timer
(reconciler.observe_group) looks each one up here, in memory, as it does the Deployment
(deployments.py), and applies the children again when one is missing. A GET per child
per tick would cost the API server 4 requests every 5 s per group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from shoal.contracts.names import GROUP_LABEL
from shoal.operator.builders import MANAGED_BY, ResourceNames, resource_names

__all__ = ["CHILD_KINDS", "ChildIndex", "missing_children"]

# (namespace, name) -> present
ChildIndex = kopf.Index[tuple[str, str], bool]


# index id -> (kopf's resource selector, apiVersion, kind, the child's key in ResourceNames)
CHILD_KINDS: dict[str, tuple[tuple[str, ...], str, str, str]] = {
    "group_service_accounts": (
        ("v1", "serviceaccounts"),
        "v1",
        "ServiceAccount",
        "service_account",
    ),
    "group_roles": (
        ("rbac.authorization.k8s.io", "v1", "roles"),
        "rbac.authorization.k8s.io/v1",
        "Role",
        "role",
    ),
    "group_role_bindings": (
        ("rbac.authorization.k8s.io", "v1", "rolebindings"),
        "rbac.authorization.k8s.io/v1",
        "RoleBinding",
        "role_binding",
    ),
    "group_pdbs": (
        ("policy", "v1", "poddisruptionbudgets"),
        "policy/v1",
        "PodDisruptionBudget",
        "pdb",
    ),
}


def _present(namespace: str | None, name: str | None, **_: Any) -> dict[tuple[str, str], bool]:
    return {(namespace or "default", name or ""): True}


for _index_id, (_selector, *_rest) in CHILD_KINDS.items():
    kopf.index(
        *_selector,
        id=_index_id,
        labels={"app.kubernetes.io/managed-by": MANAGED_BY, GROUP_LABEL: kopf.PRESENT},
    )(_present)


def missing_children(
    indexes: Mapping[str, Any], namespace: str, group: str
) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of each child the watches have not seen. A kind whose
    index kopf did not pass (not registered) counts as seen: nothing is known of it."""
    names: ResourceNames = resource_names(group)
    missing: list[tuple[str, str, str]] = []
    for index_id, (_, api_version, kind, key) in CHILD_KINDS.items():
        index = indexes.get(index_id)
        if index is None:
            continue
        name = str(names[key])  # type: ignore[literal-required]
        if (namespace, name) not in index:
            missing.append((api_version, kind, name))
    return missing
