"""Calling the operator's kopf handlers in tests, without kopf's machinery around them:
its Events recorded instead of posted, and a handler called with the kwargs it reads."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

import kopf
import pytest

Event = tuple[str, str, str]  # type, reason, message


def record_events(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    """kopf.info and kopf.warn append to the list returned instead of posting."""
    found: list[Event] = []

    def recorder(kind: str) -> Callable[..., None]:
        def post(body: Any, *, reason: str, message: str = "") -> None:
            found.append((kind, reason, message))

        return post

    monkeypatch.setattr(kopf, "info", recorder("Normal"))
    monkeypatch.setattr(kopf, "warn", recorder("Warning"))
    return found


async def call_handler(handler: object, **kwargs: Any) -> Any:
    """Call a kopf handler with only the kwargs it reads. kopf's decorators type a handler
    as kopf's callback protocol, which requires every kwarg kopf passes (logger, runtime,
    ...) and Spec/Meta/Status rather than the dicts these tests give."""
    return await cast(Callable[..., Awaitable[Any]], handler)(**kwargs)
