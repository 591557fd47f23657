"""Importing Shoal changes nothing process-wide; `quiet_known_noise` does, when asked.

Importing the etcd client once replaced threading.excepthook for the whole process, and
the NATS connection's module added a filter to asyncio's logger (issue 28): whoever
imported them for one function got both. Now the commands install them through
setup_logging, and tests and benchmarks call quiet_known_noise themselves.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from types import SimpleNamespace
from typing import Any

from shoal.logs import quiet_known_noise

PRODUCT_MODULES = [
    "shoal.clients.etcd",
    "shoal.clients.nats",
    "shoal.group.jetstream",
    "shoal.consumer.worker",
    "shoal.consumer.runtime",
    "shoal.operator.reconciler",
    "shoal.operator.cli",
    "shoal.analytics.cli",
]


def test_importing_product_modules_installs_nothing_process_wide() -> None:
    script = (
        "import importlib, logging, threading\n"
        "hook = threading.excepthook\n"
        f"for name in {PRODUCT_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "assert threading.excepthook is hook, threading.excepthook\n"
        "assert not logging.getLogger('asyncio').filters, logging.getLogger('asyncio').filters\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _hook_args(name: str, exc: BaseException) -> Any:
    return SimpleNamespace(
        exc_type=type(exc), exc_value=exc, exc_traceback=None, thread=threading.Thread(name=name)
    )


def test_quiet_known_noise_is_idempotent_and_quiets_only_the_known_noise(
    monkeypatch: Any,
) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", seen.append)
    asyncio_log = logging.getLogger("asyncio")
    monkeypatch.setattr(asyncio_log, "filters", [])
    quiet_known_noise()
    quiet_known_noise()
    assert len(asyncio_log.filters) == 1
    closed = _hook_args("etcd3_watch_1", ValueError("Cannot invoke RPC: Channel closed!"))
    threading.excepthook(closed)
    assert seen == []  # the watcher of a closed etcd client: quiet
    other = _hook_args("etcd3_watch_1", ValueError("something else"))
    threading.excepthook(other)
    mine = _hook_args("worker", ValueError("Cannot invoke RPC: Channel closed!"))
    threading.excepthook(mine)
    assert seen == [other, mine]  # anything else goes to the hook it replaced
    eof = logging.LogRecord(
        "asyncio",
        logging.WARNING,
        "",
        0,
        "returning true from eof_received() has no effect",
        (),
        None,
    )
    assert not asyncio_log.filter(eof)
    assert asyncio_log.filter(
        logging.LogRecord("asyncio", logging.WARNING, "", 0, "Task was destroyed", (), None)
    )
