"""The Go handler of examples/go as an image of its own, for the local plane's kubelet.

`build()` builds `localhost/shoal-go-handler:dev` with buildah (`buildah bud --isolation
chroot`, as scripts/build-image.sh builds shoal:dev; no OCI runtime, no registry): FROM
scratch, the static binary harness.goexamples builds (CGO_ENABLED=0), non-root, its
ENTRYPOINT the handler (examples/go/handler/Containerfile). Once per version: the image
carries the hash of the binary and of the Containerfile in a label, and a later call
whose hash matches builds nothing. It needs root and buildah (buildah's storage);
`MissingBuildah` says which is missing, so that a test fails saying so.

    python -m harness.goimage          # prints the tag
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from harness import REPO_ROOT
from harness.goexamples import build as build_binaries
from harness.servers import cache_dir

__all__ = ["CONTAINERFILE", "TAG", "MissingBuildah", "build"]

TAG = "localhost/shoal-go-handler:dev"
CONTAINERFILE = REPO_ROOT / "examples" / "go" / "handler" / "Containerfile"
LABEL = "dev.shoal.go-handler.digest"
CONTAINERS_CONF = REPO_ROOT / "scripts" / "containers.conf"
BUILD_TIMEOUT = 300.0


class MissingBuildah(RuntimeError):
    """This machine cannot build images: no buildah, or not root."""


def _buildah(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CONTAINERS_CONF=str(CONTAINERS_CONF))
    return subprocess.run(
        ["buildah", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def _labels(tag: str) -> dict[str, str]:
    """The image's labels; empty when buildah has no such image."""
    result = _buildah("inspect", "--type", "image", tag)
    if result.returncode != 0:
        return {}
    config = json.loads(result.stdout).get("OCIv1", {}).get("config", {})
    return dict(config.get("Labels") or {})


def build(tag: str = TAG) -> str:
    """Build the image (once per version) and return its tag."""
    if shutil.which("buildah") is None:
        raise MissingBuildah(
            "the Go handler image needs buildah (`make image` installs Debian's buildah)"
        )
    if os.geteuid() != 0:
        raise MissingBuildah(
            "the Go handler image needs root (buildah's storage, and the kubelet's image "
            "runtime that runs it)"
        )
    binary = build_binaries()["handler"]
    h = hashlib.sha256(binary.read_bytes())
    h.update(CONTAINERFILE.read_bytes())
    digest = h.hexdigest()[:16]
    if _labels(tag).get(LABEL) == digest:
        return tag
    root = cache_dir() / "go-examples"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".image-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; the next finds it done
        if _labels(tag).get(LABEL) == digest:
            return tag
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="go-handler-image-") as context:
            shutil.copy2(binary, os.path.join(context, "handler"))
            result = _buildah(
                "bud",
                "--isolation",
                "chroot",
                "--label",
                f"{LABEL}={digest}",
                "-t",
                tag,
                "-f",
                str(CONTAINERFILE),
                context,
                timeout=BUILD_TIMEOUT,
            )
        if result.returncode != 0:
            raise RuntimeError(
                f"buildah bud of {tag} failed ({result.returncode}):\n{result.stderr[-4000:]}"
            )
        print(
            f"goimage: {tag} built in {time.monotonic() - started:.1f} s ({digest})",
            file=sys.stderr,
        )
    return tag


if __name__ == "__main__":
    print(build())
