"""Progress of a long report on the console: Spark's stages while they run, and the wall
time of every step (said at the end, in the report's timing block).

:class:`StageProgress` polls ``SparkContext.statusTracker()`` from a daemon thread (the
driver's own view of the running stages; it works on any master, spark-submit included)
and says a line when a stage's completed tasks change, at most every ``interval`` seconds.
:class:`Steps` times the report's steps for :class:`shoal.analytics.timing.Timeline`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from pyspark import SparkContext

__all__ = ["StageProgress", "Steps"]

log = logging.getLogger(__name__)

Say = Callable[[str], None]


class StageProgress:
    """``with StageProgress(sc, say):`` reports ``stage 7 [3/8 tasks, 2 running] name``."""

    def __init__(self, sc: SparkContext, say: Say, interval: float = 2.0) -> None:
        self.sc = sc
        self.say = say
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spark-progress", daemon=True)
        self._last: dict[int, tuple[int, int]] = {}

    def _poll(self) -> None:
        tracker = self.sc.statusTracker()
        for stage_id in sorted(tracker.getActiveStageIds()):
            info = tracker.getStageInfo(stage_id)
            if info is None:
                continue
            state = (info.numCompletedTasks, info.numActiveTasks)
            if self._last.get(stage_id) == state:
                continue
            self._last[stage_id] = state
            name = info.name.split(" at ")[0]
            self.say(
                f"spark: stage {stage_id} [{info.numCompletedTasks}/{info.numTasks} tasks, "
                f"{info.numActiveTasks} running] {name}"
            )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._poll()
            except Exception as exc:  # the context is stopping; progress is not worth a crash
                log.debug("Stage progress: %r", exc)
                return

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Steps:
    """Wall time per named step, in the order the steps ended (steps run at once overlap)."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.times.append((name, time.monotonic() - started))
