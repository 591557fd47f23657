"""A steady producer for the full-stack tests: a group under load while it scales, rolls or
loses a node, and every message it sent kept for the ledger's audit afterwards."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER

# Chunks go out every STEP seconds: a rate that stays even on the scale of the tests'
# partition gaps, without a publish call per message.
STEP = 0.1


class SteadyLoad:
    """`rate` messages a second over `projects` projects, ids ``<id_prefix>-<n>``, each
    project's messages numbered (SEQ_HEADER) so that the audit can check their order.

    `items` holds every message sent so far. ``report`` prints what was sent once stopped.
    """

    def __init__(
        self,
        js: Any,
        subject_prefix: str,
        partitions: int,
        *,
        rate: float,
        projects: int,
        id_prefix: str,
        report: bool = False,
    ) -> None:
        self.producer = Producer(js, subject_prefix, partitions)
        self.rate = rate
        self.projects = projects
        self.id_prefix = id_prefix
        self.report = report
        self.items: list[Outgoing] = []
        self.stopping = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.started = 0.0

    def chunk(self, count: int) -> list[Outgoing]:
        """The next `count` messages, numbered on from those sent."""
        start = len(self.items)
        return [
            Outgoing(
                f"project-{i % self.projects}",
                b"x",
                f"{self.id_prefix}-{i}",
                {SEQ_HEADER: str(i // self.projects)},
            )
            for i in range(start, start + count)
        ]

    async def run(self) -> None:
        batch = max(1, int(self.rate * STEP))
        next_at = time.monotonic()
        while not self.stopping.is_set():
            chunk = self.chunk(batch)
            self.items += chunk
            await self.producer.publish_many(chunk, window=256)
            next_at += STEP
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    def start(self) -> None:
        self.started = time.monotonic()
        self.task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        """Stop after the chunk in flight; again is a no-op (tests stop in a finally too)."""
        self.stopping.set()
        if self.task is not None:
            await self.task
            self.task = None
            if self.report:
                took = time.monotonic() - self.started
                print(f"load stopped: {len(self.items)} messages in {took:.0f} s")
