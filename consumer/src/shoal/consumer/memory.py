"""Give the C heap's free pages back to the system, once a minute (glibc only).

A member's RSS grew by 3-5 MB over a 30-minute soak (a varying load, a restart, a leader
kill, a NATS outage) while the Python heap it allocates stayed flat under tracemalloc:
glibc keeps the pages of freed memory (nats-py's reconnect buffer during an outage, the
bursts' message objects, gRPC's buffers) in its arenas, and returns to the system only
what lies at the top of the main heap. ``malloc_trim(0)`` returns every whole free page,
wherever it lies. It takes the allocator's lock for a few milliseconds on a member's
heap, so once a minute costs nothing a member would notice. Elsewhere than glibc (musl,
macOS) this does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_INTERVAL_SECONDS = 60.0


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


async def trim_forever(interval: float = TRIM_INTERVAL_SECONDS) -> None:
    """Trim every `interval` seconds, for as long as the member runs. With nothing to do
    (an interval of 0: never; no glibc) it waits for good instead of returning: the
    member leaves its group when any of its components ends."""
    trim = _malloc_trim() if interval > 0 else None
    if trim is None:
        if interval > 0:
            log.debug("No malloc_trim here (not glibc): freed heap pages stay with the process")
        await asyncio.get_running_loop().create_future()  # until cancelled
        return
    while True:
        await asyncio.sleep(interval)
        started = time.perf_counter()
        released = trim(0)
        log.debug(
            "malloc_trim: %s in %.1f ms",
            "pages returned" if released else "nothing to return",
            1000 * (time.perf_counter() - started),
        )
