"""`with` for the harness's things that start and stop (servers, clusters, proxies)."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class StartStop:
    """``with x:`` is ``x.start()`` (which returns x) on the way in and ``x.stop()`` on the
    way out, whatever happened: a test's servers must not outlive it."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
