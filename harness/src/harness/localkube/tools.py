"""Where the local control plane's binaries are: built once per version into the cache.

`harness/tools/build.sh` builds them (see harness/tools/versions.mk for the versions); this module
only finds them and says, in one line, how to get them when they are missing.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from harness import REPO_ROOT
from harness.servers import cache_dir

VERSIONS_FILE = REPO_ROOT / "harness" / "tools" / "versions.mk"


def versions() -> dict[str, str]:
    """The pinned versions, read from harness/tools/versions.mk."""
    pinned: dict[str, str] = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        match = re.match(r"^([A-Z_]+)\s*[:?]?=\s*(\S+)", line)
        if match:
            pinned[match.group(1)] = match.group(2)
    return pinned


class ToolMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class KubeTools:
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    etcd: Path
    helm: Path
    nats: Path

    @property
    def bin_dirs(self) -> list[Path]:
        return sorted({p.parent for p in (self.kubectl, self.helm, self.nats)})


def kube_dir(version: str | None = None) -> Path:
    return cache_dir() / f"kube-{version or versions()['KUBERNETES_VERSION']}"


def natscli_path() -> Path:
    """Where `make tools` puts the nats CLI of the pinned version."""
    return cache_dir() / f"natscli-{versions()['NATSCLI_VERSION']}" / "nats"


def find_tools() -> KubeTools:
    pinned = versions()
    kube = kube_dir(pinned["KUBERNETES_VERSION"])
    etcd = cache_dir() / f"etcd-{pinned['ETCD_VERSION']}"
    helm = cache_dir() / f"helm-{pinned['HELM_VERSION']}"
    tools = KubeTools(
        kube_apiserver=kube / "kube-apiserver",
        kube_controller_manager=kube / "kube-controller-manager",
        kube_scheduler=kube / "kube-scheduler",
        kubectl=kube / "kubectl",
        etcd=etcd / "etcd",
        helm=helm / "helm",
        nats=natscli_path(),
    )
    missing = [p for p in vars(tools).values() if not (p.is_file() and os.access(p, os.X_OK))]
    if missing:
        raise ToolMissing(
            f"missing {', '.join(str(p) for p in missing)}: run `make tools` "
            "(builds them with Go, once per machine)"
        )
    return tools
