"""What a member may do to Kubernetes: its group's ConsumerGroup and its fellow pods.

The pods' ServiceAccount (operator/builders.py, the Role) may get this one ConsumerGroup,
get and patch its ``scale`` subresource, create Events, and get/list/patch pods. The
official client is synchronous: every call runs in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from shoal.contracts.names import (
    API_GROUP,
    API_VERSION,
    DELETION_COST_ANNOTATION,
    KIND,
    PLURAL,
    format_time,
)

log = logging.getLogger(__name__)

COMPONENT = "shoal-autoscaler"


def api_client() -> Any:
    """In a pod with a mounted token: in-cluster; otherwise KUBECONFIG (or ~/.kube/config)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config()
        return client.ApiClient()
    return config.new_client_from_config(os.environ.get("KUBECONFIG"))


def _rfc3339(t: float) -> str:
    return format_time(t)


# (connect, read) seconds for each call: without it a call whose answer never comes (the
# API server's host gone after it took the request) blocks its thread, and the autoscaler
# round that awaits it, for good, with nothing logged.
REQUEST_TIMEOUT = (5.0, 30.0)


class GroupObject:
    """One ConsumerGroup, seen and scaled from inside its own pods."""

    def __init__(self, namespace: str, name: str, api: Any | None = None) -> None:
        self.namespace = namespace
        self.name = name
        self.api = api if api is not None else api_client()
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)

    async def read(self) -> dict[str, Any]:
        """The ConsumerGroup (spec and status) as the API server has it now."""
        obj = await asyncio.to_thread(
            self.custom.get_namespaced_custom_object,
            API_GROUP,
            API_VERSION,
            self.namespace,
            PLURAL,
            self.name,
            _request_timeout=REQUEST_TIMEOUT,
        )
        return dict(obj)

    async def scale(self, replicas: int) -> None:
        """Set spec.replicas through the scale subresource (what the Role allows)."""
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object_scale,
            API_GROUP,
            API_VERSION,
            self.namespace,
            PLURAL,
            self.name,
            {"spec": {"replicas": replicas}},
            _request_timeout=REQUEST_TIMEOUT,
        )

    async def event(self, reason: str, message: str, uid: str, warning: bool = False) -> None:
        now = time.time()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{self.name}.", "namespace": self.namespace},
            "involvedObject": {
                "apiVersion": f"{API_GROUP}/{API_VERSION}",
                "kind": KIND,
                "name": self.name,
                "namespace": self.namespace,
                "uid": uid,
            },
            "reason": reason,
            # The API server refuses Event messages longer than 1 KiB.
            "message": message[:1000],
            "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": os.environ.get("POD_NAME", ""),
            "firstTimestamp": _rfc3339(now),
            "lastTimestamp": _rfc3339(now),
            "count": 1,
        }
        await asyncio.to_thread(
            self.core.create_namespaced_event,
            self.namespace,
            body,
            _request_timeout=REQUEST_TIMEOUT,
        )

    async def set_deletion_costs(self, costs: dict[str, int]) -> None:
        """Annotate pods so a ReplicaSet scaling down removes the cheapest first."""
        for pod, cost in costs.items():
            patch = {"metadata": {"annotations": {DELETION_COST_ANNOTATION: str(cost)}}}
            try:
                await asyncio.to_thread(
                    self.core.patch_namespaced_pod,
                    pod,
                    self.namespace,
                    patch,
                    _request_timeout=REQUEST_TIMEOUT,
                )
            except ApiException as exc:
                if exc.status != 404:  # a member whose pod is gone needs no mark
                    raise
