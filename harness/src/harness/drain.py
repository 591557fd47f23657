"""Waiting for a WorkQueue stream to drain, and telling a stranded message from a late one.

With WorkQueue retention the stream drops a message once its durable has the ack, so an
empty stream means every message was consumed. A clustered stream can break that rule
for a while: after a stream-leader failover a replica may keep messages its consumers
already acked, and purges them below the consumers' common ack floor on its own schedule.
Such a message is *stranded*: stored, yet no durable has it pending or unacked, so nobody
will ever be handed it again. `wait_drained` returns the ids of those messages instead of
timing out, so the caller can check them against what was processed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import nats.js.errors

from shoal.contracts.names import MSG_ID_HEADER

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Drained:
    """How a stream drained: `stranded` holds the ids of the messages it kept."""

    stranded: set[str] = field(default_factory=set)

    @property
    def clean(self) -> bool:
        return not self.stranded


async def stuck_durables(js: Any, stream: str) -> dict[str, dict[str, int]]:
    """Per durable with messages left: pending, ack pending, redelivered, waiting pulls."""
    stuck: dict[str, dict[str, int]] = {}
    for info in await js.consumers_info(stream):
        pending, acking = int(info.num_pending or 0), int(info.num_ack_pending or 0)
        if pending or acking:
            stuck[info.name] = {
                "pending": pending,
                "ack_pending": acking,
                "redelivered": int(info.num_redelivered or 0),
                "waiting": int(info.num_waiting or 0),
            }
    return stuck


async def stored_ids(js: Any, stream: str, subjects: str, first: int, count: int) -> set[str]:
    """The message ids of the first `count` messages stored at or after sequence `first`."""
    ids: set[str] = set()
    seq = first
    for _ in range(count):
        try:  # the next stored message: no walk over the (many) deleted sequences
            msg = await js.get_msg(stream, seq, subjects, next=True)
        except nats.js.errors.NotFoundError:
            break
        if msg.headers and MSG_ID_HEADER in msg.headers:
            ids.add(msg.headers[MSG_ID_HEADER])
        seq = int(msg.seq or seq) + 1
    return ids


async def wait_drained(
    js: Any, stream: str, subjects: str, timeout: float, *, stranded_after: float
) -> Drained:
    """Wait until `stream` is empty, or what it holds has been stranded `stranded_after` s.

    Raises TimeoutError, naming the durables still holding messages, if neither happens
    within `timeout`. A failed read (a server down) neither counts as quiet nor aborts.
    """
    deadline = time.monotonic() + timeout
    left, quiet_since = -1, None
    while time.monotonic() < deadline:
        try:
            state = (await js.stream_info(stream)).state
            left = int(state.messages)
            if left == 0:
                return Drained()
            if await stuck_durables(js, stream):
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= stranded_after:
                ids = await stored_ids(js, stream, subjects, int(state.first_seq), left)
                log.warning(
                    "%d message(s) stay in %s with no durable holding them (seq %d..%d)",
                    left,
                    stream,
                    state.first_seq,
                    state.last_seq,
                )
                return Drained(stranded=ids)
        except Exception as exc:
            quiet_since = None
            log.debug("reading %s failed: %r", stream, exc)
        await asyncio.sleep(0.5)
    try:
        holding: object = await stuck_durables(js, stream)
    except Exception as exc:
        holding = f"unknown ({exc!r})"
    raise TimeoutError(
        f"stream not drained after {timeout:.0f} s: {left} messages left; "
        f"durables holding them: {holding}"
    )
