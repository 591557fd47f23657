"""An in-process member for tests that need to steer it: a Worker with its own NATS
connection, its own view of the group, and a membership whose safety the test turns off
and on (a fence), the partition's assignment written by the test. Real servers, no
leader, no election: what the worker does with a partition and the messages of its
durable (tests/test_open_pulls.py, tests/test_gate_bounds.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from shoal.clients.etcd import Etcd
from shoal.clients.nats import connect
from shoal.consumer.metrics import Metrics
from shoal.consumer.worker import Worker
from shoal.group.config import GroupConfig
from shoal.group.view import GroupView

__all__ = ["FakeMembership", "Handler", "Member", "assign", "until"]

Handler = Any


class FakeMembership:
    """A live lease whose safety the test turns off and on (a fence, as a keep-alive
    that comes late for a moment makes)."""

    def __init__(self, lease: int) -> None:
        self.lease_id = lease
        self.incarnation = 0
        self.ok = True
        self.changed = asyncio.Event()

    def safe(self) -> bool:
        return self.ok

    async def put_stats_now(self) -> None:
        pass


async def until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Member:
    """A Worker with its own connection (through `url`), view and fake membership."""

    def __init__(self, config: GroupConfig, etcd: Etcd, handler: Handler) -> None:
        self.config = config
        self.etcd = etcd
        self.handler = handler
        self.tasks: list[asyncio.Task[Any]] = []

    async def start(self, url: str) -> None:
        c = self.config
        self.nc = await connect(url, name=c.member_id)
        self.view = GroupView(self.etcd, c.keys, c.partitions)
        self.membership = FakeMembership(await self.etcd.grant_lease(60))
        self.worker = Worker(
            c,
            self.etcd,
            self.view,
            self.membership,  # type: ignore[arg-type]
            self.nc,
            self.nc.jetstream(),
            self.handler,
            Metrics(),
        )
        self.tasks.append(asyncio.create_task(self.view.run()))
        await self.view.synced.wait()
        self.tasks.append(asyncio.create_task(self.worker.run()))

    def fence(self, on: bool) -> None:
        self.membership.ok = not on
        self.worker.poke()

    async def close(self) -> None:
        if not hasattr(self, "worker"):
            return
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.worker.dispatcher.stop()
        for task in list(self.worker._tasks):
            task.cancel()
        for runner in list(self.worker.runners.values()):
            if runner.task is not None:
                runner.task.cancel()
        with contextlib.suppress(OSError):  # (a connection the proxy reset, in a failure)
            await self.nc.close()


async def assign(etcd: Etcd, config: GroupConfig, owner: str, generation: int) -> None:
    value = {"owner": owner, "generation": generation, "epoch": 1, "ts": time.time()}
    await etcd.put(config.keys.partition(0), json.dumps(value).encode())
