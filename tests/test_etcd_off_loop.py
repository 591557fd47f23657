"""The etcd client's calls never block the event loop, even when the client must be built
again first (with a username that is an Authenticate call, up to its timeout): a member
whose loop stalls misses its keep-alives and fence checks, and fails liveness."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest

from shoal.clients.etcd import Etcd


async def test_releasing_a_claim_builds_a_missing_client_off_the_loop(
    etcd_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    etcd = Etcd(etcd_endpoint)
    await etcd.connect(attempts=5)
    try:
        revision = await etcd.create_returning_revision("/off-loop/claim", b"me", None)
        assert revision is not None
        build = etcd._make_client

        def slow_build() -> Any:
            time.sleep(1.0)  # as an Authenticate call against a slow endpoint would
            return build()

        monkeypatch.setattr(etcd, "_make_client", slow_build)
        etcd._client = None  # as after a fail-over whose rebuild failed
        ticks = [time.monotonic()]

        async def ticker() -> None:
            while True:
                await asyncio.sleep(0.01)
                ticks.append(time.monotonic())

        ticking = asyncio.create_task(ticker())
        try:
            assert await etcd.release_claim("/off-loop/claim", revision, "/off-loop/rec", None)
        finally:
            ticking.cancel()
        ticks.append(time.monotonic())
        stalled = max(b - a for a, b in itertools.pairwise(ticks))
        assert stalled < 0.5, f"the loop stalled {stalled:.2f} s"
    finally:
        await etcd.delete_prefix("/off-loop/")
        etcd.close()
