"""The handler a group's spec names, `package.module:function`: importing it, and saying in
one line what is wrong when that fails. Members load their handler with it
(shoal.consumer.handlers.load_handler); the operator checks the spec's handler with it
before it applies a group (its pods would only crash-loop on an unknown one).

A handler may also be a URL, `http(s)://host[:port][/path]`: a service the members POST
each message to (shoal.consumer.httphandler). There is nothing to import then, and the
operator does not check it (the service may run beside the members or elsewhere, and
start after the group); `check_url_handler` only says whether the URL can be used.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from shoal.contracts.spec import HANDLER_WORDS, URL_HANDLER_PATTERN

_URL = re.compile(f"^{URL_HANDLER_PATTERN}$")

__all__ = ["HandlerError", "check_url_handler", "import_handler", "is_url_handler"]


class HandlerError(RuntimeError):
    """The handler named in the configuration cannot be used."""


def import_handler(spec: str) -> Callable[..., Awaitable[Any]]:
    """Import `module:function`; every failure is one HandlerError line saying what is wrong."""
    if is_url_handler(spec):
        raise HandlerError(f"handler {spec!r} is a URL: a service to call, not a function")
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise HandlerError(f"handler {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HandlerError(
            f"handler {spec!r}: cannot import module {module_name!r}: {exc}{_where(exc)}"
        ) from exc
    func = getattr(module, func_name, None)
    if func is None:
        raise HandlerError(f"handler {spec!r}: module {module_name!r} has no {func_name!r}")
    if not inspect.iscoroutinefunction(func):
        raise HandlerError(f"handler {spec!r} must be an 'async def' function taking one message")
    handler: Callable[..., Awaitable[Any]] = func
    return handler


def _where(exc: ImportError) -> str:
    """A hint for a package that is not on the import path. Most often it sits in the
    current directory: `python -m` puts that on the path, but the installed
    `shoal-consumer` command does not (as for every console script)."""
    top = (getattr(exc, "name", None) or "").partition(".")[0]
    if not isinstance(exc, ModuleNotFoundError) or not top:
        return ""
    here = Path.cwd()
    if (here / top).is_dir() or (here / f"{top}.py").is_file():
        return (
            f" ({top!r} is in the current directory, which the shoal-consumer command does "
            "not search: run it with PYTHONPATH=. or install your package)"
        )
    return " (is its package installed, or its directory on PYTHONPATH?)"


def is_url_handler(spec: str) -> bool:
    """True for a handler given as an http:// or https:// URL (well-formed or not)."""
    return spec.startswith(("http://", "https://"))


def check_url_handler(spec: str) -> str:
    """The URL, if a member can POST to it; else a HandlerError saying what is wrong."""
    if not _URL.match(spec):
        raise HandlerError(f"handler {spec!r} {HANDLER_WORDS}")
    try:
        port = urlsplit(spec).port
    except ValueError as exc:  # a port above 65535
        raise HandlerError(f"handler {spec!r}: {exc}") from None
    if port == 0:
        raise HandlerError(f"handler {spec!r}: port 0 is not a port to send to")
    return spec
