"""The operator's Kubernetes calls end: against an API server that takes a request and
never answers (its host gone after it accepted), each call raises after the (connect,
read) timeout instead of holding a group's status timer, and a thread, for good."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from kubernetes import client, dynamic
from urllib3.exceptions import MaxRetryError, ReadTimeoutError

from shoal.operator.kube import Kube, with_timeout


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A real listening socket that accepts, reads, and never says a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()
    accepted: list[socket.socket] = []

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(conn)  # kept open, never answered

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        listener.close()


def _api(host: str) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = host
    return client.ApiClient(configuration)


async def _ends_within(seconds: float, call: object) -> float:
    """Run a blocking call in a thread; how long it took to raise (it must raise).
    (urllib3 tries a GET whose read timed out 3 more times: 4 timeouts in all.)"""
    started = time.monotonic()
    with pytest.raises((MaxRetryError, ReadTimeoutError)):
        async with asyncio.timeout(seconds):
            await asyncio.to_thread(call)  # type: ignore[arg-type]
    return time.monotonic() - started


async def test_a_call_the_api_server_never_answers_times_out(silent_server: str) -> None:
    api = with_timeout(_api(silent_server), (1.0, 0.5))
    core = client.CoreV1Api(api)
    took = await _ends_within(15, lambda: core.read_namespaced_secret("s", "ns"))
    assert took < 6, took
    # A per-call timeout still wins over the default.
    took = await _ends_within(
        15, lambda: core.read_namespaced_secret("s", "ns", _request_timeout=(1.0, 0.1))
    )
    assert took < 1.5, took
    # The dynamic client's discovery takes no per-call options: it has the default too.
    took = await _ends_within(15, lambda: dynamic.DynamicClient(api))
    assert took < 6, took


async def test_the_operators_kube_is_made_with_the_timeout(silent_server: str) -> None:
    """Kube discovers the API at its start (the dynamic client): before, against a
    server that never answered, that start waited for good."""
    took = await _ends_within(15, lambda: Kube(_api(silent_server), timeout=(1.0, 0.5)))
    assert took < 6, took
