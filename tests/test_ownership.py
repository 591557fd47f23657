"""A partition's record on the worker (ownership.py): the moves its life allows, and the
runners index the hot path reads, kept by those moves alone. No servers: the record is
plain bookkeeping, and the worker's use of it is fed a view by hand."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest

from shoal.clients.etcd import KV
from shoal.consumer.metrics import Metrics
from shoal.consumer.ownership import _NEXT, Ownership, Stage
from shoal.consumer.partition import PartitionRunner
from shoal.consumer.worker import Worker
from shoal.group.config import GroupConfig
from shoal.group.view import GroupView

RUNNER: Any = object()  # the record only keeps it


def test_a_partition_s_whole_life_is_logged_move_by_move(caplog: pytest.LogCaptureFixture) -> None:
    own = Ownership()
    caplog.set_level(logging.DEBUG, logger="shoal.consumer.ownership")
    assert own.stage(3) is Stage.FREE and own.slot(3) is None

    assert own.move(3, Stage.CLAIMING)
    assert own.stage(3) is Stage.CLAIMING and own.runners == {}
    assert own.busy()
    assert own.move(3, Stage.CONSUMING, runner=RUNNER)
    assert own.runners == {3: RUNNER} and own.runner(3) is RUNNER
    assert own.move(3, Stage.RELEASED, runner=RUNNER, revision=40)
    slot = own.slot(3)
    assert slot is not None and slot.revision == 40 and slot.runner is None
    assert own.runners == {}
    assert not own.busy()  # a drain does not wait for the view to catch up
    assert own.move(3, Stage.FREE)
    assert own.slot(3) is None

    moves = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert moves == [
        "Partition 3 (worker): free -> claiming",
        "Partition 3 (worker): claiming -> consuming",
        "Partition 3 (worker): consuming -> released",
        "Partition 3 (worker): released -> free",
    ]


@pytest.mark.parametrize(
    ("path", "refused"),
    [
        # Nothing starts a partition whose claim is being deleted, or was just deleted.
        ([Stage.CONSUMING, Stage.RELEASING], Stage.CONSUMING),
        ([Stage.CONSUMING, Stage.RELEASED], Stage.CONSUMING),
        ([Stage.CONSUMING, Stage.RELEASED], Stage.CLAIMING),
        # A claim being made is not one to delete; a free partition has nothing deleted.
        ([Stage.CLAIMING], Stage.RELEASING),
        ([], Stage.RELEASED),
        ([], Stage.HANDLERS_STOPPING),
        # Handlers still stopping keep the claim: no runner beside them under it.
        ([Stage.CONSUMING, Stage.HANDLERS_STOPPING], Stage.CONSUMING),
        # A partition consumed is not claimed again.
        ([Stage.CONSUMING], Stage.CLAIMING),
    ],
)
def test_a_move_its_life_does_not_allow_is_refused_and_logged(
    path: list[Stage], refused: Stage, caplog: pytest.LogCaptureFixture
) -> None:
    own = Ownership()
    for stage in path:
        assert own.move(5, stage, runner=RUNNER)
    before = own.stage(5)
    runners = dict(own.runners)
    assert not own.move(5, refused, runner=RUNNER)
    assert own.stage(5) is before and own.runners == runners
    assert any("(a bug)" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_runner_is_needed_to_consume_or_to_wait_for_its_handlers() -> None:
    own = Ownership()
    assert not own.move(1, Stage.CONSUMING)
    assert own.stage(1) is Stage.FREE and own.runners == {}


def test_every_way_a_runner_ends_is_a_move_consuming_allows() -> None:
    """runner_done moves the partition on as it forgets the runner, whatever happened;
    a refused move there would leave a zombie runner listed (issue #24, defect 5)."""
    assert _NEXT[Stage.CONSUMING] == {
        Stage.FREE,
        Stage.RELEASED,
        Stage.RELEASING,
        Stage.HANDLERS_STOPPING,
    }
    for stage in _NEXT[Stage.CONSUMING]:
        own = Ownership()
        own.move(2, Stage.CONSUMING, runner=RUNNER)
        assert own.move(2, stage, runner=RUNNER)
        assert 2 not in own.runners


# -- the worker's use of it -----------------------------------------------------------

ME = "m-0"
LEASE = 77
CONFIG = GroupConfig(group="g", namespace="ns", member_id=ME, partitions=8)


class Membership:
    lease_id = LEASE
    incarnation = 0

    def safe(self) -> bool:
        return True


def worker_with(*kvs: KV, revision: int) -> Worker:
    view = GroupView(None, CONFIG.keys, CONFIG.partitions)  # type: ignore[arg-type]
    view.load(revision, {kv.key: kv for kv in kvs})
    membership: Any = Membership()
    return Worker(CONFIG, None, view, membership, None, None, None, Metrics())  # type: ignore[arg-type]


def target(p: int, owner: str) -> KV:
    value = json.dumps({"owner": owner, "generation": 1, "epoch": 1, "ts": 1.0}).encode()
    return KV(CONFIG.keys.partition(p), value, 5, 5, 0)


def claim(p: int, member: str, revision: int) -> KV:
    return KV(CONFIG.keys.claim(p), member.encode(), revision, revision, LEASE)


async def test_a_fenced_runner_with_handlers_running_keeps_its_claim_until_they_stop() -> None:
    """Fenced, the runner is done at once (runner_done forgets it) but its cancelled
    handlers are not: the partition waits in one record, claim kept, and is released
    only once they have stopped (it moved away meanwhile)."""
    worker = worker_with(target(6, "m-1"), claim(6, ME, 30), revision=30)
    runner = PartitionRunner(worker, 6, claim_revision=30, target_ts=None)
    assert worker.ownership.move(6, Stage.CONSUMING, runner=runner)
    runner.fence()
    runner.inflight = 1  # a cancelled handler, still stopping

    await worker.runner_done(runner)
    assert 6 not in worker.runners
    slot = worker.ownership.slot(6)
    assert slot is not None and slot.stage is Stage.HANDLERS_STOPPING and slot.runner is runner

    spawned: list[Any] = []
    worker._spawn = spawned.append  # type: ignore[method-assign,assignment]  # no etcd here
    worker._reconcile()
    assert worker.ownership.stage(6) is Stage.HANDLERS_STOPPING and spawned == []

    runner.inflight = 0
    worker._reconcile()
    # Our claim outlived the fence and the partition is not ours: it is released.
    slot = worker.ownership.slot(6)
    assert slot is not None and slot.stage is Stage.RELEASING and slot.revision == 30
    assert len(spawned) == 1
    spawned[0].close()


async def test_a_drain_waits_for_handlers_an_earlier_fence_cancelled() -> None:
    """Leaving, the worker must not let its caller revoke the lease (and so hand the
    partition to its next owner) while handlers cancelled by an earlier fence still
    stop: drain waits for them too, up to the same bound as for its own runners."""
    worker = worker_with(target(6, ME), claim(6, ME, 30), revision=30)
    runner = PartitionRunner(worker, 6, claim_revision=30, target_ts=None)
    assert worker.ownership.move(6, Stage.CONSUMING, runner=runner)
    runner.fence()
    runner.inflight = 1
    await worker.runner_done(runner)
    assert worker.ownership.stage(6) is Stage.HANDLERS_STOPPING

    async def stops_later() -> None:
        await asyncio.sleep(0.5)
        runner.inflight = 0
        runner.went_idle()

    stopping = asyncio.create_task(stops_later())
    began = time.monotonic()
    await worker.drain(timeout=5)
    assert runner.inflight == 0, "drain returned while a cancelled handler still ran"
    assert time.monotonic() - began < 2
    await stopping

    # One that never stops (deaf to cancellation) does not hold the exit for ever.
    runner.inflight = 1
    began = time.monotonic()
    await worker.drain(timeout=5)
    assert time.monotonic() - began < 4


async def test_a_partition_whose_claim_went_with_the_lease_waits_for_its_stopping_handlers() -> (
    None
):
    """Fenced for longer than the lease: the claim is gone, the partition is still ours
    in the target. The handlers the fence cancelled still stop: claiming it again now
    would start a runner beside them; it is claimed once they have stopped."""
    worker = worker_with(target(6, ME), claim(6, ME, 30), revision=30)
    runner = PartitionRunner(worker, 6, claim_revision=30, target_ts=None)
    assert worker.ownership.move(6, Stage.CONSUMING, runner=runner)
    runner.fence()
    runner.inflight = 1
    await worker.runner_done(runner)
    assert worker.ownership.stage(6) is Stage.HANDLERS_STOPPING
    worker.view.load(40, {kv.key: kv for kv in [target(6, ME)]})  # the claim expired

    spawned: list[Any] = []
    worker._spawn = spawned.append  # type: ignore[method-assign,assignment]  # no etcd here
    worker._reconcile()
    assert worker.ownership.stage(6) is Stage.HANDLERS_STOPPING and spawned == []

    runner.inflight = 0
    worker._reconcile()
    assert worker.ownership.stage(6) is Stage.CLAIMING and len(spawned) == 1
    spawned[0].close()


class RefusingNats:
    """A connection whose naks never reach JetStream (it went away mid hand-over)."""

    async def publish(self, subject: str, payload: bytes) -> None:
        raise ConnectionError("nats away")

    async def request(self, subject: str, payload: bytes, timeout: float) -> None:
        raise ConnectionError("nats away")


class Msg:
    reply = "$JS.ACK.s.d.1.7.7.0.0"


async def test_a_give_back_whose_naks_failed_is_not_an_orderly_hand_over() -> None:
    """What the runner held could not be given back: its release must write no hand-over
    record (handback None), or the next owner would take the move for orderly and skip
    waiting for those deliveries (takeover.py), running newer messages first."""
    from shoal.consumer.dispatch import Held

    worker = worker_with(target(6, ME), claim(6, ME, 30), revision=30)
    worker.nc = RefusingNats()
    runner = PartitionRunner(worker, 6, claim_revision=30, target_ts=None)
    await runner._give_back([Held(Msg(), "p", 7, 1, time.monotonic())])
    assert runner.handback is None
    # Nothing to give back: orderly, with the credits it was handed.
    runner = PartitionRunner(worker, 6, claim_revision=30, target_ts=None)
    runner.credits = {9: 1}
    await runner._give_back([])
    assert runner.handback == {9: 1}


async def test_a_runner_resumed_under_a_claim_that_outlived_a_fence_is_no_fresh_claim() -> None:
    """Fenced for a moment, our claim survived: the new runner must not take the last
    (orderly) hand-over record for its own start, since the fenced runner before it left
    what it held to JetStream's redelivery; it waits for those deliveries (takeover.py).
    The view saw the partition's last deletion write a record (an orderly move to us)."""
    worker = worker_with(target(6, ME), revision=20)
    worker.view._apply_events(
        [DeleteEvent(CONFIG.keys.claim(6), 21), FakePut(CONFIG.keys.handback(6), b"{}", 21)], 21
    )
    worker.view._apply_events([FakePut(CONFIG.keys.claim(6), ME.encode(), 22, LEASE)], 22)
    assert worker.view.handed_over_cleanly(6)
    started: list[tuple[int, bool]] = []

    def start(
        p: int, claim_revision: int, target_ts: float | None, *, fresh_claim: bool = True
    ) -> None:
        started.append((p, fresh_claim))

    worker._start = start  # type: ignore[method-assign]
    worker._reconcile()  # ours already, no runner: resumed after a fence
    assert started == [(6, False)]


class FakePut:
    def __init__(self, key: str, value: bytes, revision: int, lease: int = 0) -> None:
        self.key, self.value, self.lease = key.encode(), value, lease
        self.create_revision = self.mod_revision = revision


class DeleteEvent:  # the view tells deletions by their class name
    def __init__(self, key: str, revision: int) -> None:
        self.key, self.value, self.lease = key.encode(), b"", 0
        self.create_revision, self.mod_revision = 0, revision
