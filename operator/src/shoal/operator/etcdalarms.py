"""Whether an etcd has its NOSPACE alarm raised, read once for every group that uses it.

The status timer asks every 5 s per group (reconciler._no_space). Groups on one etcd
share its client (etcdsecret.EtcdClients), so one listing answers all of them for a few
seconds: at 50 groups that is one alarm listing per tick instead of fifty.
"""

from __future__ import annotations

import asyncio
import time

from shoal.clients.etcd import Etcd

__all__ = ["NOSPACE_ALARM", "AlarmReader"]

# etcd's AlarmType NOSPACE (etcdserverpb.AlarmType: NONE 0, NOSPACE 1, CORRUPT 2).
NOSPACE_ALARM = 1


class AlarmReader:
    def __init__(self, max_age: float = 4.0) -> None:
        self.max_age = max_age
        # id(client) -> (when read, monotonic; raised). A client replaced after a Secret's
        # rotation is a new id; an old entry lives at most max_age.
        self._seen: dict[int, tuple[float, bool]] = {}
        self._locks: dict[int, asyncio.Lock] = {}

    async def nospace(self, etcd: Etcd) -> bool:
        """Whether the NOSPACE alarm is raised; what etcd raises if it cannot be asked."""
        key = id(etcd)
        async with self._locks.setdefault(key, asyncio.Lock()):  # one listing at a time
            seen = self._seen.get(key)
            if seen is not None and time.monotonic() - seen[0] < self.max_age:
                return seen[1]
            alarms = await etcd.call(lambda: list(etcd.client.list_alarms()))
            raised = any(int(getattr(a, "alarm_type", 0)) == NOSPACE_ALARM for a in alarms)
            self._seen[key] = (time.monotonic(), raised)
            return raised
