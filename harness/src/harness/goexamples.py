"""The Go examples (examples/go: a producer and an HTTP handler), built for tests and
benchmarks with the machine's Go.

`build()` runs `go build` once per version of the sources (go.mod, go.sum, every .go
file) and of Go, into ``<cache>/go-examples/<hash>/`` outside the clone (the shoal cache,
see harness.servers.cache_dir), and returns the binaries' paths; later calls, in this
process or another, build nothing. Go is found as scripts/ensure-nats-server.sh finds it
(``$GO``, else ``go`` on PATH, else /usr/local/go/bin/go). Modules come through the
default GOPROXY into the module cache, checked against the committed go.sum
(``-mod=readonly``: a build never edits go.mod or go.sum).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from harness import REPO_ROOT
from harness.servers import cache_dir

__all__ = ["EXAMPLES", "PROGRAMS", "GoMissing", "build", "go_binary"]

EXAMPLES = REPO_ROOT / "examples" / "go"
PROGRAMS = ("producer", "handler")
BUILD_TIMEOUT = 600.0


class GoMissing(RuntimeError):
    """No Go toolchain on this machine."""


def go_binary() -> str:
    """The Go toolchain to build with; raises GoMissing without one."""
    wanted = os.environ.get("GO")
    found = shutil.which(wanted) if wanted else shutil.which("go")
    if not found and not wanted and os.access("/usr/local/go/bin/go", os.X_OK):
        found = "/usr/local/go/bin/go"
    if not found:
        raise GoMissing(
            "the Go examples need Go (https://go.dev/dl/ or Debian's golang-go; "
            "make test needs it anyway, for make tools)"
        )
    return found


def _sources() -> list[Path]:
    files = [EXAMPLES / "go.mod", EXAMPLES / "go.sum", *EXAMPLES.rglob("*.go")]
    return sorted(files)


def _digest(go: str) -> str:
    """A hash of the sources and of Go's version: what the binaries depend on."""
    version = subprocess.run(
        [go, "version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    h = hashlib.sha256(version.encode())
    for path in _sources():
        h.update(str(path.relative_to(EXAMPLES)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build() -> dict[str, Path]:
    """Build (once) and return {program: binary path} for every program in PROGRAMS."""
    go = go_binary()
    root = cache_dir() / "go-examples"
    dest = root / _digest(go)
    binaries = {name: dest / name for name in PROGRAMS}
    if all(path.exists() for path in binaries.values()):
        return binaries
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; the next finds it done
        if all(path.exists() for path in binaries.values()):
            return binaries
        staging = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
        try:
            env = dict(os.environ, CGO_ENABLED="0")
            command = [
                go,
                "build",
                "-mod=readonly",
                "-trimpath",
                "-buildvcs=false",
                "-o",
                f"{staging}/",
            ]
            command += [f"./{name}" for name in PROGRAMS]
            result = subprocess.run(
                command,
                cwd=EXAMPLES,
                env=env,
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT,
            )
            if result.returncode != 0:
                raise RuntimeError(
                    f"{' '.join(command)} in {EXAMPLES} failed ({result.returncode}):\n"
                    f"{result.stderr[-4000:]}"
                )
            shutil.rmtree(dest, ignore_errors=True)
            staging.rename(dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return binaries
