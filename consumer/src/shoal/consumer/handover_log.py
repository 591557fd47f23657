"""One log line per hand-over, not one per partition.

A rebalance moves dozens of partitions at once; a member that logged each one wrote 64
lines per hand-over. Partitions that start being released (or taken) together form a
batch; when the last of them is done, one INFO line says what happened:

    Released 32 partitions (0-31) to c-3 in 140 ms
    Took 32 partitions (96-127) in 95 ms

Each partition's own steps stay at DEBUG (partition.py, worker.py).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

log = logging.getLogger("shoal.consumer.worker")


def ranges(partitions: Iterable[int]) -> str:
    """0,1,2,3,7,9,10 -> '0-3,7,9-10'."""
    out: list[str] = []
    run: list[int] = []
    for p in sorted(partitions):
        if run and p == run[-1] + 1:
            run.append(p)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [p]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass
class _Batch:
    verb: str  # "Released" or "Took"
    started: float
    pending: set[int]
    done: list[int] = field(default_factory=list)
    peers: Counter[str] = field(default_factory=Counter)


class HandOverLog:
    def __init__(self) -> None:
        self._batches: dict[str, dict[int, _Batch]] = {"Released": {}, "Took": {}}
        # The batch each verb is adding to during the current reconcile pass.
        self._open: dict[str, _Batch | None] = {"Released": None, "Took": None}

    def new_pass(self) -> None:
        """Partitions started from here on form new batches (one per reconcile pass)."""
        self._open = {"Released": None, "Took": None}

    def releasing(self, to: Mapping[int, str]) -> None:
        """Partitions (-> their new owner) this member starts releasing now."""
        self._begin("Released", to)

    def taking(self, partitions: Iterable[int]) -> None:
        """Partitions this member starts claiming now (those not already under way)."""
        self._begin("Took", {p: "" for p in partitions})

    def released(self, partition: int) -> None:
        self._finish("Released", partition, counted=True)

    def took(self, partition: int) -> None:
        self._finish("Took", partition, counted=True)

    def abandoned(self, partition: int) -> None:
        """No longer being released or taken (fenced, or the target changed again)."""
        for verb in self._batches:
            self._finish(verb, partition, counted=False)

    def is_taking(self, partition: int) -> bool:
        return partition in self._batches["Took"]

    def _begin(self, verb: str, peers: Mapping[int, str]) -> None:
        batches = self._batches[verb]
        new = [p for p in peers if p not in batches]
        if not new:
            return
        batch = self._open[verb]
        if batch is None:
            batch = self._open[verb] = _Batch(verb, time.monotonic(), set())
        batch.pending.update(new)
        batch.peers.update(peers[p] for p in new if peers[p])
        for p in new:
            batches[p] = batch

    def _finish(self, verb: str, partition: int, *, counted: bool) -> None:
        batch = self._batches[verb].pop(partition, None)
        if batch is None:
            return
        batch.pending.discard(partition)
        if counted:
            batch.done.append(partition)
        if batch.pending or not batch.done:
            return
        n = len(batch.done)
        to = ""
        if batch.peers:
            to = " to " + ", ".join(
                name if len(batch.peers) == 1 else f"{name} ({count})"
                for name, count in sorted(batch.peers.items())
            )
        log.info(
            "%s %d partition%s (%s)%s in %.0f ms",
            verb,
            n,
            "" if n == 1 else "s",
            ranges(batch.done),
            to,
            1000 * (time.monotonic() - batch.started),
        )
