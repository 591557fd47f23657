"""What the process kubelet reads from a pod's spec, and the time stamps it writes:
pure functions, no I/O, shared by the kubelet (kubelet.py) and its pod runners
(podrunner.py)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

# Pods share the host's loopback (podnet.py's namespaces have no other address either).
POD_IP = "127.0.0.1"


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def wants_token(pod: Any) -> bool:
    """The pod has a projected service-account token for the API server's audiences (the
    kube-api-access volume the ServiceAccount admission plugin adds unless
    automountServiceAccountToken is false): only then does it get a token and kubeconfig."""
    for volume in pod.spec.volumes or []:
        for source in getattr(volume.projected, "sources", None) or []:
            token = source.service_account_token
            if token is not None and not token.audience:
                return True
    return False


def is_sidecar(spec: Any) -> bool:
    """A native sidecar: an init container with restartPolicy Always."""
    return getattr(spec, "restart_policy", None) == "Always"


def termination_prereqs(specs: list[tuple[str, Any]], running: set[str]) -> dict[str, list[str]]:
    """For each running container, the running ones it must wait for before it is sent
    SIGTERM (the real kubelet's newTerminationOrdering): a sidecar waits for every main
    container and for the next sidecar in the list (which waits for the one after it,
    and so on: sidecars stop in reverse order); everything else waits for nothing.
    specs: (kind, spec) as PodRunner._specs gives them."""
    mains = [spec.name for kind, spec in specs if kind == "main" and spec.name in running]
    prereqs: dict[str, list[str]] = {name: [] for name in running}
    later: str | None = None
    for kind, spec in reversed(specs):
        if kind != "sidecar":
            continue
        if spec.name in running:
            prereqs[spec.name] = mains + ([later] if later in running else [])
        # As in the kubelet, a sidecar that is not running (its channel closed at once)
        # breaks the chain: the one before it waits only for the main containers.
        later = spec.name
    return prereqs


class VolumeError(RuntimeError):
    """A volume cannot be set up (MountVolume.SetUp failed, in kubelet terms)."""


class ConfigError(RuntimeError):
    """A container's env refers to what does not exist (CreateContainerConfigError)."""


def mounted_paths(spec: Any, volumes: dict[str, Path]) -> list[tuple[str, str]]:
    """(mountPath, materialized path) of the container's materialized volumes, deepest
    mountPath first so that nested mounts win."""
    pairs = []
    for mount in spec.volume_mounts or []:
        if mount.name in volumes:
            target = volumes[mount.name] / (mount.sub_path or "")
            pairs.append((mount.mount_path.rstrip("/") or "/", str(target).rstrip("/")))
    return sorted(pairs, key=lambda pair: len(pair[0]), reverse=True)


def rewrite_path(value: str, moved: list[tuple[str, str]]) -> str:
    """A path at or under a mountPath, moved to where the volume really is."""
    for mount_path, target in moved:
        if value == mount_path:
            return target
        if value.startswith(mount_path + "/"):
            return target + value[len(mount_path) :]
    return value


def without_stamps(status: dict[str, Any] | None) -> dict[str, Any] | None:
    """A reported status without lastTransitionTime, to compare with a fresh one."""
    if status is None:
        return None
    conditions = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status["conditions"]
    ]
    return {**status, "conditions": conditions}


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args."""
    for key, val in env.items():
        value = value.replace(f"$({key})", val)
    return value
