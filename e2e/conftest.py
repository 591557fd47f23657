"""Fixtures for the full-stack suite: the local control plane and the image, once per
session."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from harness import REPO_ROOT
from harness.localkube.plane import LocalKube


@pytest.fixture(scope="session")
def localkube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKube]:
    """A running plane (API server, controllers, process kubelet, NATS, etcd)."""
    plane = LocalKube(tmp_path_factory.mktemp("localkube"))
    try:
        plane.up()
        yield plane
    finally:
        plane.down()


@pytest.fixture(scope="session")
def image() -> str:
    """The image, built (`image` tests only: root, buildah). buildah's layer cache makes a
    rebuild of unchanged sources quick."""
    tag = os.environ.get("SHOAL_IMAGE", "shoal:dev")
    started = time.monotonic()
    subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "build-image.sh"), tag], check=True, timeout=1700
    )
    print(f"\nbuild-image.sh took {time.monotonic() - started:.0f} s")
    return tag
