"""The member's event loop: uvloop unless asked for asyncio's own.

Why uvloop: a member spends most of its CPU in the event loop and its transports (NATS
reads and writes, and with an HTTP handler one request and one answer per message), and
uvloop's are compiled (libuv). Measured on this machine (bench/http_handler.py, one
member, 128 partitions, 50,000 messages): member CPU per message 0.055 -> 0.041 ms with
an HTTP handler and 0.0101 -> 0.0086 ms with the in-process noop handler; four members
POSTing to a 20 ms service drained 9.0k -> 10.5-11.0k msg/s. Code we would write cannot
do that; it is one well-kept library (MagicStack, the event loop of uvicorn and others).

`--event-loop asyncio` (SHOAL_EVENT_LOOP=asyncio) runs the standard loop instead: for
debugging with asyncio's debug mode, or to rule the loop out when something looks wrong.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

__all__ = ["CHOICES", "DEFAULT", "run"]

T = TypeVar("T")

CHOICES = ("uvloop", "asyncio")
DEFAULT = "uvloop"


def run(main: Coroutine[Any, Any, T], loop: str = DEFAULT) -> T:
    """Run `main` to completion on a new loop of the kind `loop` names."""
    if loop == "asyncio":
        return asyncio.run(main)
    if loop == "uvloop":
        return uvloop.run(main)
    main.close()  # never awaited: say so rather than warn about it
    raise ValueError(f"unknown event loop {loop!r}: expected one of {', '.join(CHOICES)}")
