"""The groups' Deployments as a watch sees them: their replica counts, for the status.

The status timer (reconciler.observe_group) runs every 5 s per group. It read each
group's Deployment with a GET: at 50 idle groups that was 10 of the API server's 10.8
requests a second (bench/groups.py). A kopf index keeps the counts from one watch on the
Deployments the operator made (its labels), so the timer reads memory; kopf starts the
handlers only once its indexes have been filled from the first listing.
"""

from __future__ import annotations

from typing import Any

import kopf

from shoal.contracts.names import GROUP_LABEL
from shoal.operator.builders import MANAGED_BY

__all__ = ["INDEX_ID", "DeploymentIndex", "group_deployments", "replica_counts"]

INDEX_ID = "group_deployments"

# (namespace, Deployment name) -> (replicas, ready replicas)
DeploymentIndex = kopf.Index[tuple[str, str], tuple[int, int]]


@kopf.index(
    "apps",
    "v1",
    "deployments",
    id=INDEX_ID,
    labels={"app.kubernetes.io/managed-by": MANAGED_BY, GROUP_LABEL: kopf.PRESENT},
)
def group_deployments(
    namespace: str | None, name: str | None, status: kopf.Status, **_: Any
) -> dict[tuple[str, str], tuple[int, int]]:
    replicas = int(status.get("replicas") or 0)
    ready = int(status.get("readyReplicas") or 0)
    return {(namespace or "default", name or ""): (replicas, ready)}


def replica_counts(
    index: DeploymentIndex | None, namespace: str, name: str
) -> dict[str, int] | None:
    """The Deployment's counts as the watch last saw them; None if it has not seen it
    (not made yet, or the index is not there: the caller asks the API server)."""
    if index is None:
        return None
    for replicas, ready in index.get((namespace, name), ()):
        return {"replicas": replicas, "ready": ready}
    return None
