"""etcdalarms.AlarmReader: one alarm listing per etcd client for every group's status tick.

The listing itself runs against a real etcd in faults/test_etcd_faults.py and
e2e/test_operator_delete.py (a NOSPACE alarm raised and cleared); here, what the reader
shares between callers, with a client that counts its listings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

from shoal.clients.etcd import Etcd
from shoal.operator.etcdalarms import NOSPACE_ALARM, AlarmReader


class CountingEtcd:
    def __init__(self, raised: bool) -> None:
        self.listings = 0
        self.raised = raised
        self.client = SimpleNamespace(list_alarms=self._alarms)

    def _alarms(self) -> list[Any]:
        self.listings += 1
        return [SimpleNamespace(alarm_type=NOSPACE_ALARM)] if self.raised else []

    async def call(self, fn: Callable[[], Any]) -> Any:
        await asyncio.sleep(0.01)  # a round trip, during which others ask too
        return fn()


async def test_fifty_groups_on_one_etcd_share_one_listing() -> None:
    reader = AlarmReader(max_age=60)
    etcd = CountingEtcd(raised=True)
    answers = await asyncio.gather(*(reader.nospace(cast(Etcd, etcd)) for _ in range(50)))
    assert answers == [True] * 50
    assert etcd.listings == 1


async def test_each_etcd_is_asked_and_a_stale_answer_is_read_again() -> None:
    reader = AlarmReader(max_age=0.05)
    full, fine = CountingEtcd(raised=True), CountingEtcd(raised=False)
    assert await reader.nospace(cast(Etcd, full)) is True
    assert await reader.nospace(cast(Etcd, fine)) is False
    full.raised = False  # space freed and the alarm disarmed
    assert await reader.nospace(cast(Etcd, full)) is True  # still the fresh answer
    await asyncio.sleep(0.06)
    assert await reader.nospace(cast(Etcd, full)) is False
    assert (full.listings, fine.listings) == (2, 1)
