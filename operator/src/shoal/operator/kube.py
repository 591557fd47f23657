"""The operator's Kubernetes I/O, on the official client (synchronous: run in threads)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kubernetes import client, dynamic
from kubernetes.client.rest import ApiException

from shoal.clients.kube import REQUEST_TIMEOUT, api_client
from shoal.operator.etcdsecret import SecretData, data_version

__all__ = ["Kube", "api_client"]

log = logging.getLogger(__name__)

FIELD_MANAGER = "shoal-operator"


def with_timeout(api: Any, timeout: tuple[float, float]) -> Any:
    """`api` with a (connect, read) timeout on every request that names none: the
    client's own default is none at all, and it leaves TCP keep-alive off. One answer
    that never came (the API server's host gone after it took the request) then held its
    call for good: a group's status timer awaits its calls, kopf runs one object's timer
    after the other, so that group's status stopped, and the call kept one of the few
    threads of asyncio's default executor that every other call needs. Set on the REST
    client, so the dynamic client's discovery, which takes no per-call options, has it
    too."""
    rest = api.rest_client
    request = rest.request

    def timed(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("_request_timeout"):
            kwargs["_request_timeout"] = timeout
        return request(*args, **kwargs)

    rest.request = timed
    return api


class Kube:
    def __init__(self, api: Any, timeout: tuple[float, float] = REQUEST_TIMEOUT) -> None:
        self.api = with_timeout(api, timeout)
        self.dynamic = dynamic.DynamicClient(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def _apply(self, obj: dict[str, Any]) -> None:
        resource = self.dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        resource.server_side_apply(
            body=obj,
            name=obj["metadata"]["name"],
            namespace=obj["metadata"].get("namespace"),
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        )

    async def apply(self, obj: dict[str, Any]) -> None:
        """Server-side apply: we own the fields we set, nothing else is touched."""
        await asyncio.to_thread(self._apply, obj)

    async def deployment_status(self, namespace: str, name: str) -> dict[str, int] | None:
        """The Deployment's replicas and ready replicas; None if there is no such
        Deployment (not made yet, or deleted: the status timer applies it again)."""
        try:
            dep = await asyncio.to_thread(
                self.apps.read_namespaced_deployment_status, name, namespace
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        st = dep.status
        return {"replicas": int(st.replicas or 0), "ready": int(st.ready_replicas or 0)}

    def _exists(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        resource = self.dynamic.resources.get(api_version=api_version, kind=kind)
        try:
            resource.get(name=name, namespace=namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def exists(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Whether the object exists (a GET; 404 is False, other errors raise)."""
        return await asyncio.to_thread(self._exists, api_version, kind, namespace, name)

    async def read_secret(self, namespace: str, name: str) -> SecretData | None:
        """A Secret's (base64) data and its version (a digest of the data: metadata
        changes are no new version); None if there is no such Secret.

        Only `get`: the operator reads the Secrets groups name and never lists any.
        """
        try:
            secret = await asyncio.to_thread(self.core.read_namespaced_secret, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        data = dict(secret.data or {})
        return SecretData(data_version(data), data)

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """The pods `selector` matches, as API JSON (camelCase, as `kubectl get -o json`
        has them), for pure functions to read. Only `list`: no watch, no cache."""
        pods = await asyncio.to_thread(
            self.core.list_namespaced_pod, namespace, label_selector=selector
        )
        found: list[dict[str, Any]] = self.api.sanitize_for_serialization(pods).get("items", [])
        return found

    async def remove_consumers(self, namespace: str, deployment: str, selector: str) -> int:
        """Delete the consumers' Deployment (if still there); how many pods remain."""
        try:
            await asyncio.to_thread(
                self.apps.delete_namespaced_deployment,
                deployment,
                namespace,
                propagation_policy="Background",
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
        pods = await asyncio.to_thread(
            self.core.list_namespaced_pod, namespace, label_selector=selector
        )
        return len(pods.items)
