"""The handler a group's spec names, `package.module:function`: importing it, and saying in
one line what is wrong when that fails. Members load their handler with it
(shoal.consumer.handlers.load_handler); the operator checks the spec's handler with it
before it applies a group (its pods would only crash-loop on an unknown one).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["HandlerError", "import_handler"]


class HandlerError(RuntimeError):
    """The handler named in the configuration cannot be used."""


def import_handler(spec: str) -> Callable[..., Awaitable[Any]]:
    """Import `module:function`; every failure is one HandlerError line saying what is wrong."""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise HandlerError(f"handler {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HandlerError(
            f"handler {spec!r}: cannot import module {module_name!r}: {exc}"
        ) from exc
    func = getattr(module, func_name, None)
    if func is None:
        raise HandlerError(f"handler {spec!r}: module {module_name!r} has no {func_name!r}")
    if not inspect.iscoroutinefunction(func):
        raise HandlerError(f"handler {spec!r} must be an 'async def' function taking one message")
    handler: Callable[..., Awaitable[Any]] = func
    return handler
