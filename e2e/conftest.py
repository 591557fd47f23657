"""Fixtures for the full-stack suite: the local control plane, once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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
