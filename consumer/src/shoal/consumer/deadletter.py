"""Messages JetStream gave up on: to the dead-letter subject, not left in the stream.

A worker dead-letters a message whose handler fails on its last delivery. One case
escapes it: the last delivery is never answered (its member was killed mid-handler, or
froze past ack_wait). JetStream then stops delivering the message and announces it on
``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<durable>``; without a listener it
would stay in the work-queue stream forever, invisible to every consumer.

The leader listens (one listener per group, so one dead letter per message). After a
grace of ``ack_wait`` (a late ack may still remove the message) it copies what is left to
``<prefix>.dlq.<partition>`` with the reason and deletes it from the stream. Advisories
are core NATS: one sent while no leader listens is missed, and the message stays.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

from shoal.contracts.names import (
    DEAD_LETTER_REASON_HEADER,
    MEMBER_HEADER,
    MSG_ID_HEADER,
    ORIGINAL_MSG_ID_HEADER,
    ORIGINAL_SUBJECT_HEADER,
    dlq_subject,
    subject_partition,
)
from shoal.group.config import GroupConfig
from shoal.group.jetstream import delete_message

log = logging.getLogger(__name__)


def dead_letter_headers(
    headers: Mapping[str, str] | None, subject: str, reason: str, member: str
) -> dict[str, str]:
    """A dead letter's headers: the original's, without its de-duplication id (the
    dead-letter stream must keep every copy), which it keeps as Shoal-Original-Msg-Id
    (a message dead-lettered again after a redrive keeps the first one), plus why, from
    where and by whom."""
    out = dict(headers or {})
    msg_id = out.pop(MSG_ID_HEADER, None)
    if msg_id and not out.get(ORIGINAL_MSG_ID_HEADER):
        out[ORIGINAL_MSG_ID_HEADER] = msg_id
    out[DEAD_LETTER_REASON_HEADER] = reason[:500]
    out[ORIGINAL_SUBJECT_HEADER] = subject
    out[MEMBER_HEADER] = member
    return out


ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"


def advisory_subject(stream: str) -> str:
    return f"{ADVISORY}.{stream}.*"


def parse_advisory(data: bytes) -> tuple[int, int] | None:
    """(stream sequence, deliveries) of a max-deliveries advisory; None for anything else."""
    try:
        body = json.loads(data)
        seq, deliveries = body["stream_seq"], body.get("deliveries", 0)
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(seq, int) or seq < 1 or not isinstance(deliveries, int):
        return None
    return seq, deliveries


class ExhaustedMessages:
    """While this member leads: dead-letter what JetStream stopped delivering."""

    def __init__(self, config: GroupConfig, nc: Any, js: Any, leader: Any) -> None:
        self.config = config
        self.nc = nc
        self.js = js
        self.leader = leader
        self.dead_lettered = 0
        self._pending: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        sub: Any = None
        try:
            while True:
                if self.leader.is_leader and sub is None:
                    sub = await self.nc.subscribe(
                        advisory_subject(self.config.stream), cb=self._on_advisory
                    )
                elif not self.leader.is_leader and sub is not None:
                    await sub.unsubscribe()
                    sub = None
                await asyncio.sleep(1.0)
        finally:
            for task in self._pending:
                task.cancel()
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:
                    log.debug("Advisory unsubscribe failed", exc_info=True)

    async def _on_advisory(self, msg: Any) -> None:
        parsed = parse_advisory(msg.data)
        if parsed is None:
            log.warning("Ignoring a malformed max-deliveries advisory on %s", msg.subject)
            return
        task = asyncio.create_task(self._sweep(*parsed))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _sweep(self, seq: int, deliveries: int) -> None:
        await asyncio.sleep(self.config.ack_wait)  # a late ack may still settle it
        stream = self.config.stream
        try:
            original = await self.js.get_msg(stream, seq)
        except Exception:
            return  # acknowledged after all (work-queue streams delete acked messages)
        partition = subject_partition(original.subject, self.config.subject_prefix)
        if partition is None:
            log.warning(
                "Message %d of %s is on unexpected subject %s", seq, stream, original.subject
            )
            return
        reason = (
            f"not acknowledged after {deliveries} deliveries "
            f"(max_deliver {self.config.max_deliver}); JetStream stopped delivering it"
        )
        headers = dead_letter_headers(
            original.headers, original.subject, reason, self.config.member_id
        )
        try:
            await self.js.publish(
                dlq_subject(self.config.subject_prefix, partition),
                original.data or b"",
                headers=headers,
            )
            await self._delete(stream, seq)
        except Exception as exc:
            log.warning("Could not dead-letter message %d of %s: %r", seq, stream, exc)
            return
        self.dead_lettered += 1
        log.warning("Dead-lettered message %d of partition %d: %s", seq, partition, reason)

    async def _delete(self, stream: str, seq: int) -> None:
        await delete_message(self.nc, self.config.nats_js_api_prefix, stream, seq)
