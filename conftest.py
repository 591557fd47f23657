"""Suite-wide rules for tests/ and e2e/.

A test that asks for a real server (etcd, nats-server, the local control plane) is an e2e
test wherever it lives: it gets the ``e2e`` marker here, so ``pytest -m "not e2e"`` (``make
test-fast``) never starts a server, whether or not its module remembered to say so.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import pytest_timeout  # type: ignore[import-untyped]

from shoal.logs import quiet_known_noise

# What the commands install through setup_logging (no Shoal module does it on import):
# without it, each closed etcd client's watcher thread ends in a traceback.
quiet_known_noise()

# Fixtures that start real servers (tests/conftest.py, e2e/conftest.py); any fixture that
# depends on one of them pulls it into the test's closure, so that is caught too.
SERVER_FIXTURES = frozenset({"etcd_server", "nats_server", "localkube"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


_dump_thread_stacks = pytest_timeout.dump_stacks


def _dump_stacks_and_tasks(terminal: Any) -> None:
    """pytest-timeout's dump, and the asyncio tasks of the loop the test runs in.

    An async test that times out shows only its loop waiting in select() among the
    threads' stacks: which await never returned is in the tasks. pytest-timeout calls
    this from its SIGALRM handler, in the main thread, while the loop runs there."""
    _dump_thread_stacks(terminal)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    for task in asyncio.all_tasks(loop):
        terminal.sep("~", title=f"Task {task.get_name()}")
        terminal.write("".join(_awaiting(task.get_coro())) + f"  waiting for {task}\n")


def _awaiting(awaitable: Any) -> list[str]:
    """Where a suspended coroutine and each coroutine it awaits stand, outermost first
    (Task.print_stack shows only the outermost frame of a suspended coroutine)."""
    lines: list[str] = []
    for _ in range(50):
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "gi_frame", None)
        if frame is None:
            break
        lines.append(
            f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, in '
            f"{frame.f_code.co_name}\n"
        )
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)
    return lines


pytest_timeout.dump_stacks = _dump_stacks_and_tasks
