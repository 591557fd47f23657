"""Small helpers the full-stack tests share: waiting, reading objects, conditions."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from e2e.localkube.plane import LocalKube


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.3) -> Any:
    """Poll check() until it returns something truthy (returned); else fail saying what."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def get_json(plane: LocalKube, *args: str) -> Any:
    """`kubectl get ARGS -o json`, parsed."""
    return json.loads(plane.kubectl("get", *args, "-o", "json").stdout)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    """The status condition of that type ({} if absent)."""
    for c in obj.get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return dict(c)
    return {}


def create_namespace(plane: LocalKube, name: str) -> None:
    """Create a namespace and wait for its default ServiceAccount (pods need it)."""
    plane.kubectl("create", "namespace", name)
    wait_until(
        lambda: (
            plane.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode
            == 0
        ),
        30,
        f"the default service account of {name}",
    )
