"""A runner's own life (partition.Phase): the moves it allows, logged at debug level, and
the hot path's flags that follow it. No servers: nothing here sends anything."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from shoal.consumer.metrics import Metrics
from shoal.consumer.partition import PartitionRunner, Phase
from shoal.consumer.worker import Worker
from shoal.contracts.names import partition_for
from shoal.group.config import GroupConfig

CONFIG = GroupConfig(group="g", namespace="ns", member_id="m-0", partitions=4)


class Membership:
    def safe(self) -> bool:
        return True


def runner() -> PartitionRunner:
    unused: Any = None
    membership: Any = Membership()
    worker = Worker(CONFIG, unused, unused, membership, None, None, unused, Metrics())
    return PartitionRunner(worker, 2, claim_revision=10, target_ts=None)


def phase(r: PartitionRunner) -> Phase:
    return r.phase  # (read through a call: mypy would keep an earlier assert's narrowing)


async def test_a_hand_over_is_logged_move_by_move(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="shoal.consumer.partition")
    r = runner()
    assert r._enter(Phase.DOZING) and r.dozing and not r.stopping
    assert r._enter(Phase.CONSUMING) and not r.dozing
    r.stop()
    assert phase(r) is Phase.STOPPING and r.stopping and not r.fenced
    assert r._enter(Phase.GIVING_BACK)
    r.released()
    assert phase(r) is Phase.RELEASED
    moves = [m.getMessage() for m in caplog.records if m.getMessage().startswith("Partition 2:")]
    assert moves == [
        "Partition 2: consuming -> dozing",
        "Partition 2: dozing -> consuming",
        "Partition 2: consuming -> stopping",
        "Partition 2: stopping -> giving back",
        "Partition 2: giving back -> released",
    ]


async def test_a_fence_sticks_and_a_move_its_life_does_not_allow_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r = runner()
    assert not r._enter(Phase.GIVING_BACK)  # nothing is given back before the stop
    assert phase(r) is Phase.CONSUMING and not r.stopping
    r.fence()
    assert phase(r) is Phase.FENCED and r.fenced and r.stopping
    for move in (Phase.CONSUMING, Phase.DOZING, Phase.STOPPING, Phase.GIVING_BACK):
        assert not r._enter(move)
        assert phase(r) is Phase.FENCED and r.fenced
    r.stop()  # stopping already: a no-op, not a move back
    r.released()
    assert phase(r) is Phase.RELEASED and r.fenced  # (fenced stays said: no hand-back)
    assert not r._enter(Phase.CONSUMING)
    warnings = [m.getMessage() for m in caplog.records if m.levelno == logging.WARNING]
    assert len([m for m in warnings if "(a bug)" in m]) == 6


def test_long_project_ids_are_checked_but_not_cached() -> None:
    """The cache of checked project ids held every id, however long: many distinct ids
    of 64 KiB (a header may be that long) would have filled gigabytes."""
    worker = runner().worker
    long_id = "p" * 65_000
    assert worker.belongs(long_id, partition_for(long_id, CONFIG.partitions))
    assert not worker.belongs(long_id, (partition_for(long_id, CONFIG.partitions) + 1) % 4)
    assert worker.belongs("short", partition_for("short", CONFIG.partitions))
    assert list(worker._partition_of) == ["short"]
