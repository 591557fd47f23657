"""Where each partition is in its life on this member: one record per partition.

The worker (worker.py) used to spread this over four structures (the runners, the
partitions being claimed or whose claim deletion was retried, the claims it had deleted,
the fenced runners whose cancelled handlers were still stopping), and "is this partition
ours, being claimed, stopping, or free" meant asking all four. Defects hid between them
(issue #24: a zombie runner after a refused release, a partition restarted beside a
handler still stopping). Now it is one `Slot` per partition that is not free, moved from
stage to stage in one place (`Ownership.move`), every move logged at debug level and any
move the life does not allow refused and logged as a bug:

    free -> claiming -> consuming -> released, releasing or handlers stopping -> free
    free -> consuming                 (our claim survived a brief fence)
    handlers stopping -> claiming     (the claim went with the lease meanwhile)
    free -> releasing                 (our claim outlived a fence; no longer ours)

A free partition has no Slot. How far the runner of a consuming partition is in letting
it go (dozing, stopping, giving back, fenced) is its own state machine, partition.Phase.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.consumer.partition import PartitionRunner

__all__ = ["Ownership", "Slot", "Stage"]

log = logging.getLogger(__name__)


class Stage(Enum):
    FREE = "free"  # nothing of ours: no claim being made or deleted, no runner (no Slot)
    CLAIMING = "claiming"  # creating claims/p (Worker._claim_all)
    CONSUMING = "consuming"  # a runner holds it; how far it is: runner.phase
    # The runner ended fenced, but the handlers the fence cancelled still run (a rollback,
    # say): the claim must outlive them, or the next owner (us again, after a brief
    # fence) starts the partition beside them. PartitionRunner.went_idle() pokes the
    # worker when the last one has stopped.
    HANDLERS_STOPPING = "handlers stopping"
    # Deleting claims/p failed (etcd away, or refusing): retried until it is gone
    # (Worker._release_later). Nothing starts the partition under the claim meanwhile.
    RELEASING = "releasing"
    # claims/p deleted, at `Slot.revision`; the view may still show it until its watch
    # catches up, and must not be taken for a claim of ours meanwhile.
    RELEASED = "released"


# Every move the worker may make; any other is a bug of ours, logged and refused.
_NEXT: dict[Stage, frozenset[Stage]] = {
    # Consuming at once: the claim is ours already (a brief fence, or a restart in
    # place). Releasing: our claim outlived a fence and the partition moved meanwhile.
    Stage.FREE: frozenset({Stage.CLAIMING, Stage.CONSUMING, Stage.RELEASING}),
    Stage.CLAIMING: frozenset({Stage.CONSUMING, Stage.FREE}),
    # The runner is done (Worker.runner_done): its claim deleted, its deletion retried,
    # kept for handlers still stopping, or (fenced) left as it is.
    Stage.CONSUMING: frozenset(
        {Stage.RELEASED, Stage.RELEASING, Stage.HANDLERS_STOPPING, Stage.FREE}
    ),
    # Claiming: the claim went with the lease, so the stopping handlers no longer keep
    # anyone else from the partition (another member may take it: the fence margin is
    # what keeps them apart); the worker claims it again only once they have stopped.
    Stage.HANDLERS_STOPPING: frozenset({Stage.FREE, Stage.CLAIMING}),
    Stage.RELEASING: frozenset({Stage.FREE}),
    Stage.RELEASED: frozenset({Stage.FREE}),
}


@dataclass(slots=True)
class Slot:
    """One partition's record, while it is not free."""

    partition: int
    stage: Stage
    # CONSUMING: the runner; HANDLERS_STOPPING: the fenced one whose handlers still run.
    runner: PartitionRunner | None = None
    # claims/p's create revision: RELEASING, the one being deleted; RELEASED, the one
    # deleted (what the view may still show).
    revision: int = 0
    # When it entered this stage (monotonic): handlers stopping for long is a stall.
    since: float = field(default_factory=time.monotonic)
    # HANDLERS_STOPPING: whether the worker said they outlived stall_after (said once).
    reported: bool = False


class Ownership:
    """Every partition's record on this member: one lookup says where it is."""

    def __init__(self) -> None:
        self._slots: dict[int, Slot] = {}
        # The runner of each consuming partition: an index kept by move() alone, read on
        # the hot path (Worker.receive, once per message) and wherever the owned
        # partitions are listed. Nobody else writes it.
        self.runners: dict[int, PartitionRunner] = {}

    def slot(self, partition: int) -> Slot | None:
        return self._slots.get(partition)

    def stage(self, partition: int) -> Stage:
        slot = self._slots.get(partition)
        return Stage.FREE if slot is None else slot.stage

    def runner(self, partition: int) -> PartitionRunner | None:
        """The runner consuming the partition, if any."""
        return self.runners.get(partition)

    def in_stage(self, stage: Stage) -> list[Slot]:
        return [slot for slot in self._slots.values() if slot.stage is stage]

    def busy(self) -> bool:
        """Anything being claimed, consumed or released (what a drain waits for)."""
        return any(
            slot.stage in (Stage.CLAIMING, Stage.CONSUMING, Stage.RELEASING)
            for slot in self._slots.values()
        )

    def move(
        self,
        partition: int,
        stage: Stage,
        *,
        runner: PartitionRunner | None = None,
        revision: int = 0,
    ) -> bool:
        """Move the partition to `stage`, if that is a move its life allows; True if it
        moved. `runner` is the runner that consumes it (CONSUMING) or whose handlers are
        stopping (HANDLERS_STOPPING); `revision` the claim being or having been deleted
        (RELEASING, RELEASED)."""
        slot = self._slots.get(partition)
        old = Stage.FREE if slot is None else slot.stage
        if stage not in _NEXT[old]:
            log.warning(
                "Partition %d: no move from %s to %s for the worker (a bug); staying %s",
                partition,
                old.value,
                stage.value,
                old.value,
            )
            return False
        holds_runner = stage in (Stage.CONSUMING, Stage.HANDLERS_STOPPING)
        if holds_runner and runner is None:
            log.warning(
                "Partition %d: %s needs its runner (a bug); staying %s",
                partition,
                stage.value,
                old.value,
            )
            return False
        log.debug("Partition %d (worker): %s -> %s", partition, old.value, stage.value)
        if stage is Stage.FREE:
            del self._slots[partition]
        else:
            self._slots[partition] = Slot(
                partition, stage, runner if holds_runner else None, revision
            )
        if stage is Stage.CONSUMING:
            assert runner is not None
            self.runners[partition] = runner
        elif old is Stage.CONSUMING:
            del self.runners[partition]
        return True
