"""The project's image, built for real: `make image` (scripts/build-image.sh, buildah).

The Dockerfile is built with buildah (--isolation chroot, no Docker engine) on a Debian
bookworm base assembled by debootstrap, then checked: both commands start as the
non-root user the image declares, no compiler, package-manager cache, pip or source tree
made it into the final image, and its size is reported. Marked `image` (needs root and
minutes of CPU the first time): `make image` runs it; `make test` leaves it out.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.image, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parent.parent
USER = "10001:10001"
ENV = {**os.environ, "CONTAINERS_CONF": str(REPO / "scripts" / "containers.conf")}


def buildah(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["buildah", *args], capture_output=True, text=True, env=ENV, timeout=600
    )
    if check and result.returncode != 0:
        raise AssertionError(f"buildah {' '.join(args)}: {result.stdout}{result.stderr}")
    return result


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[str]:
    name = buildah("from", "--pull-never", image).stdout.strip()
    try:
        yield name
    finally:
        buildah("rm", name, check=False)


def run_as_user(container: str, *command: str) -> subprocess.CompletedProcess[str]:
    return buildah("run", "--isolation", "chroot", "--user", USER, container, "--", *command)


def test_the_image_declares_the_non_root_user(image: str) -> None:
    info = json.loads(buildah("inspect", "--type", "image", image).stdout)["OCIv1"]
    assert info["config"]["User"] == USER
    assert info["config"]["Cmd"] == ["shoal-operator"]


def test_both_commands_run_as_the_non_root_user(container: str) -> None:
    assert run_as_user(container, "id", "-u").stdout.strip() == "10001"
    # kopf names the operator after the user: the uid must have a passwd entry.
    name = "import getpass; print(getpass.getuser())"
    assert run_as_user(container, "python3", "-c", name).stdout.strip() == "shoal"
    consumer = run_as_user(container, "shoal-consumer", "--help").stdout
    assert "run" in consumer and "produce" in consumer, consumer
    operator = run_as_user(container, "shoal-operator", "--help").stdout
    assert "--namespace" in operator, operator
    assert "usage: shoal-ready" in run_as_user(container, "shoal-ready", "--help").stdout


def test_no_compiler_package_cache_pip_or_sources(container: str) -> None:
    root = Path(buildah("mount", container).stdout.strip())
    try:
        found = [
            str(path.relative_to(root))
            for pattern in (
                "usr/bin/gcc*",
                "usr/bin/cc",
                "usr/bin/*-linux-gnu-gcc*",
                "usr/bin/clang*",
                "root/.cache/pip",
                "tmp/*",
                "var/cache/apt/archives/*.deb",
                "var/lib/apt/lists/*_Packages*",
                "opt/shoal/bin/pip*",
                "src",
            )
            for path in root.glob(pattern)
        ]
        assert not found, found
        # The project is installed, not copied: its modules are in the virtualenv.
        assert list(root.glob("opt/shoal/lib/python3*/site-packages/shoal/operator/reconciler.py"))
    finally:
        buildah("umount", container, check=False)


def test_image_size_is_reported(image: str, container: str) -> None:
    (entry,) = json.loads(buildah("images", "--json", image).stdout)
    root = Path(buildah("mount", container).stdout.strip())
    try:
        files = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
        size = sum(p.stat().st_size for p in files)
    finally:
        buildah("umount", container, check=False)
    print(f"\nimage {image}: {entry['size']} (buildah), {size / 1e6:.0f} MB of files")
    # Bookworm minbase, Python and the dependencies (the kubernetes client alone is over
    # 100 MB); a compiler or a second copy of the dependencies would push it over this.
    assert size < 400e6, f"{size / 1e6:.0f} MB"
