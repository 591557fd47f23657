"""An alarm that rings when a message is published to a dozing partition.

A partition with nothing to consume would otherwise keep a pull request open at all
times: one request and one expiry status every `fetch_expires` per partition, which is
most of what an idle group costs the server (docs/data-path.md, "Dozing"). A partition
whose pulls keep coming back empty stops pulling and arms an alarm instead: a plain
NATS subscription to its stream subject, which the server ends itself after one message.
Publishing to the partition rings it; the runner then pulls again, and the pull brings
the message (from the stream, with its ack subject; the alarm's copy is only a signal).

A subscription is not a pull request: JetStream delivers nothing through it, so a dozing
partition can be released at once, with no request of ours left open on the server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Alarm:
    def __init__(self, nc: Any, subject: str) -> None:
        self.nc = nc
        self.subject = subject
        self._sub: Any = None
        self._rang: asyncio.Future[Any] | None = None
        self._listener: Callable[[], None] | None = None

    @property
    def armed(self) -> bool:
        return self._sub is not None

    @property
    def rang(self) -> bool:
        return self._rang is not None and self._rang.done()

    async def arm(self) -> None:
        """Subscribe to the partition's subject. Anything published after this call's
        subscription reached the server rings the alarm."""
        if self._sub is not None:
            return
        self._rang = rang = asyncio.get_running_loop().create_future()
        rang.add_done_callback(self._ring)
        # max_msgs=1: nats-py drops the subscription after its first message, so a second
        # one, sent before the server saw the unsubscribe below, never reaches the
        # (already resolved) future. The unsubscribe makes the server end it after one
        # message too: one notification, however many messages are published meanwhile.
        self._sub = await self.nc.subscribe(self.subject, future=rang, max_msgs=1)
        await self._sub.unsubscribe(limit=1)

    def on_ring(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the alarm rings (or is disarmed). One listener, replaced
        by the next call: a dozing partition calls this at every safety sweep while the
        alarm stays armed, and adding a callback each time grew an idle member by tens
        of MB a day."""
        self._listener = callback

    def _ring(self, _: asyncio.Future[Any]) -> None:
        if self._listener is not None:
            self._listener()

    async def disarm(self) -> None:
        sub, self._sub = self._sub, None
        rang, self._rang = self._rang, None
        if rang is not None and not rang.done():
            rang.cancel()
        if sub is None:
            return
        try:
            await sub.unsubscribe()
        except Exception:
            # Already ended (it rang), or the connection is closing: nothing to undo.
            log.debug("Unsubscribing the alarm on %s failed", self.subject, exc_info=True)
