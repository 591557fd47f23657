"""The members' Kubernetes calls (shoal.clients.kube.GroupObject: the autoscaler's reads,
scales, Events and pod marks) give up on an API server that never answers, instead of
blocking the autoscaler's round for good with nothing logged."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest
from kubernetes import client

from shoal.clients import kube


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A loopback port that takes connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


async def test_calls_to_an_api_server_that_never_answers_time_out(
    silent_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kube, "REQUEST_TIMEOUT", (1.0, 1.0))
    configuration = client.Configuration()
    configuration.host = silent_server
    group = kube.GroupObject("ns", "orders", client.ApiClient(configuration))
    for call in (
        group.read(),
        group.scale(3),
        group.event("Scaled", "to 3", "uid"),
        group.set_deletion_costs({"pod-0": 1}),
    ):
        started = time.monotonic()
        with pytest.raises(Exception) as raised:  # (urllib3 raises several types)
            async with asyncio.timeout(20):
                await call
        assert not isinstance(raised.value, TimeoutError), "blocked past 20 s"
        assert time.monotonic() - started < 10
