"""The worker never consumes a partition without its claim (the reconcile decisions,
fed a view by hand).

Found by the fault suite (nats kill -9, then restart): a partition moved away and back
within moments. The worker deleted its claim on the release, and on the way back its view
still showed that claim (the watch had not caught up), so it took it for its own and
started consuming under a claim that no longer existed, for good: "unclaimed" in the
status, and nothing to stop a second member from claiming the partition.
"""

from __future__ import annotations

import json
from typing import Any

from shoal.clients.etcd import KV
from shoal.consumer.metrics import Metrics
from shoal.consumer.ownership import Stage
from shoal.consumer.partition import PartitionRunner
from shoal.consumer.worker import Worker
from shoal.group.config import GroupConfig
from shoal.group.view import GroupView

ME = "m-0"
LEASE = 77


class Membership:
    """What the worker reads of its membership: a live lease, never fenced."""

    lease_id = LEASE
    incarnation = 0

    def safe(self) -> bool:
        return True


CONFIG = GroupConfig(group="g", namespace="ns", member_id=ME, partitions=8)


def worker_with(*kvs: KV, revision: int) -> Worker:
    view = GroupView(None, CONFIG.keys, CONFIG.partitions)  # type: ignore[arg-type]
    view.load(revision, {kv.key: kv for kv in kvs})
    membership: Any = Membership()
    return Worker(CONFIG, None, view, membership, None, None, None, Metrics())  # type: ignore[arg-type]


def target(config: GroupConfig, p: int, owner: str) -> KV:
    value = json.dumps({"owner": owner, "generation": 1, "epoch": 1, "ts": 1.0}).encode()
    return KV(config.keys.partition(p), value, 5, 5, 0)


def claim(config: GroupConfig, p: int, member: str, revision: int) -> KV:
    return KV(config.keys.claim(p), member.encode(), revision, revision, LEASE)


async def test_a_claim_it_deleted_is_not_taken_for_its_own() -> None:
    # Partition 3 is ours again; the view still shows the claim we deleted (revision 40).
    worker = worker_with(target(CONFIG, 3, ME), claim(CONFIG, 3, ME, 40), revision=40)
    consumed = PartitionRunner(worker, 3, claim_revision=40, target_ts=None)
    assert worker.ownership.move(3, Stage.CONSUMING, runner=consumed)
    assert worker.ownership.move(3, Stage.RELEASED, revision=40)
    worker._reconcile()
    assert 3 not in worker.runners
    # Nor claimed anew: the old claim still shows.
    assert worker.ownership.stage(3) is Stage.RELEASED

    # Once the view has seen the deletion, the partition is claimed again.
    worker.view.load(41, {CONFIG.keys.partition(3): target(CONFIG, 3, ME)})
    started: list[Any] = []
    worker._spawn = started.append  # type: ignore[method-assign,assignment]  # no etcd here
    worker._reconcile()
    assert worker.ownership.stage(3) is Stage.CLAIMING
    assert len(started) == 1
    started[0].close()


async def test_a_runner_whose_claim_is_gone_stops() -> None:
    worker = worker_with(target(CONFIG, 2, ME), target(CONFIG, 5, ME), revision=60)
    gone = PartitionRunner(worker, 2, claim_revision=50, target_ts=None)
    fresh = PartitionRunner(worker, 5, claim_revision=70, target_ts=None)  # view behind
    for runner in (gone, fresh):
        assert worker.ownership.move(runner.partition, Stage.CONSUMING, runner=runner)
    worker._reconcile()
    assert gone.stopping
    assert not fresh.stopping


async def test_after_a_brief_fence_the_partition_waits_for_its_cancelled_handlers() -> None:
    """Fenced for a moment, the lease survives and the partition is still ours: it is
    started again under its claim, but only once the handlers the fence cancelled have
    stopped. Started at once (as it was), it ran the partition's messages beside a
    handler still rolling back."""
    worker = worker_with(target(CONFIG, 4, ME), claim(CONFIG, 4, ME, 30), revision=30)
    fenced = PartitionRunner(worker, 4, claim_revision=30, target_ts=None)
    assert worker.ownership.move(4, Stage.CONSUMING, runner=fenced)
    fenced.fence()
    fenced.inflight = 1  # a cancelled handler, still stopping
    assert worker.ownership.move(4, Stage.HANDLERS_STOPPING, runner=fenced)
    started: list[Any] = []
    worker._start = lambda p, *_, **__: started.append(p)  # type: ignore[method-assign]
    worker._reconcile()
    assert started == []
    assert 4 not in worker.runners

    fenced.inflight = 0  # it stopped
    fenced.went_idle()
    assert worker._wake.is_set()  # the worker reconciles again at once
    worker._reconcile()
    assert started == [4]
    # (The real _start moves it on to consuming.)
    assert worker.ownership.stage(4) is Stage.FREE
