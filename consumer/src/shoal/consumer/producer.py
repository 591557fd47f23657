"""The producer side: publish a project's data to its partition's subject.

No registration hand-shake (the seed's REG_RESP/CLOSE/DATA subjects): a project's
partition is a pure function of its id. Every message carries a message id so that a
retried publish is de-duplicated by JetStream instead of processed twice.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from typing import Any

from shoal.contracts.names import (
    DEFAULT_PARTITIONS,
    MSG_ID_HEADER,
    PROJECT_HEADER,
    partition_for,
    partition_subject,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outgoing:
    project_id: str
    data: bytes
    message_id: str | None = None
    headers: dict[str, str] | None = None


class Producer:
    def __init__(self, js: Any, subject_prefix: str, partitions: int = DEFAULT_PARTITIONS) -> None:
        self.js = js
        self.subject_prefix = subject_prefix
        self.partitions = partitions

    def _prepare(self, item: Outgoing) -> tuple[str, dict[str, str]]:
        partition = partition_for(item.project_id, self.partitions)
        headers = dict(item.headers or {})
        headers[PROJECT_HEADER] = item.project_id
        headers[MSG_ID_HEADER] = item.message_id or uuid.uuid4().hex
        return partition_subject(self.subject_prefix, partition), headers

    async def publish(
        self,
        project_id: str,
        data: bytes,
        *,
        message_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """Publish one message and wait for JetStream's acknowledgement."""
        subject, hdrs = self._prepare(Outgoing(project_id, data, message_id, headers))
        return await self.js.publish(subject, data, headers=hdrs)

    async def publish_many(
        self,
        items: Iterable[Outgoing] | AsyncIterable[Outgoing],
        *,
        window: int = 512,
        attempts: int = 5,
    ) -> int:
        """Publish asynchronously with at most `window` unacknowledged; returns the count.

        A publish whose acknowledgement fails is retried with the same message id, so the
        retry cannot create a duplicate.
        """
        pending: set[asyncio.Task[None]] = set()
        count = 0

        async def one(item: Outgoing) -> None:
            subject, hdrs = self._prepare(item)
            for attempt in range(1, attempts + 1):
                try:
                    await self.js.publish(subject, item.data, headers=hdrs)
                    return
                except Exception as exc:
                    if attempt == attempts:
                        raise
                    log.warning("Publish to %s failed (%r); retry %d", subject, exc, attempt)
                    await asyncio.sleep(0.2 * attempt)

        async def submit(item: Outgoing) -> None:
            nonlocal count
            if len(pending) >= window:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    pending.discard(task)
                    task.result()
            task = asyncio.create_task(one(item))
            pending.add(task)
            count += 1

        if isinstance(items, AsyncIterable):
            async for item in items:
                await submit(item)
        else:
            for item in items:
                await submit(item)
        if pending:
            await asyncio.gather(*pending)
        return count
