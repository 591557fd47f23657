"""Child processes that die with the process that started them, even by SIGKILL.

A test, bench or demo that is killed (SIGKILL, or SIGTERM/SIGINT before its teardown
runs) never gets to stop the servers and members it started: without help they live on
as orphans, holding ports and CPU. On Linux a child can ask the kernel for a signal when
its parent dies: ``prctl(PR_SET_PDEATHSIG)``, set here between fork and exec, and kept
across exec (the kernel clears it only for set-user-ID binaries and credential changes).
The signal is SIGKILL: nobody is left to wait for a graceful stop, and a process whose
SIGTERM handler hangs would otherwise still be an orphan.

The catch: the kernel's "parent" is the *thread* that forked the child, and the signal
comes when that thread exits, not the process. Servers are started from executor
threads (NatsCluster, EtcdCluster, ``asyncio.to_thread``) that end long before the
servers should, so `spawn` forks every child from one daemon thread of its own that
lives exactly as long as the process (it waits for work without holding the GIL, so
interpreter shutdown does not end it early either). ``die_with_parent()`` is the same
preexec hook for a starter that must call Popen itself (asyncio's subprocess API): only
from the main thread, which also lives as long as the process.

Only the direct child gets the signal. A child that execs through a wrapper (spark-class
is a bash script ending in ``exec java``) stays the same process, so that is fine; a
child that forks its own long-lived children must make them die with it (the local
kubelet starts its pods with `spawn` too). ``outlive=True`` is for the processes of
`make cluster-up` and the demo, which are meant to outlive the command.

    process = spawn([binary, "--flag"], stdout=log, start_new_session=True)
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

__all__ = ["die_with_parent", "spawn"]

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
DEATH_SIGNAL = signal.SIGKILL

# Looked up once here: the child, between fork and exec, should do as little as it can.
_prctl: Any = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child get SIGKILL when this process dies.

    Only from the main thread (see the module docstring); `spawn` uses it from its own
    thread. Elsewhere than Linux the child is started without it.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("die_with_parent() outside the main thread: use spawn()")
    return _preexec()


def _preexec() -> Callable[[], None]:
    parent = os.getpid()
    sig = int(DEATH_SIGNAL)
    prctl = _prctl

    def preexec() -> None:
        # Runs in the child between fork and exec: no logging, no locks.
        if prctl is None:
            return
        if prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
        if os.getppid() != parent:
            # The parent died between fork and prctl: the signal will never come.
            os.kill(os.getpid(), sig)

    return preexec


_Request = tuple[Sequence[str], dict[str, Any], "Future[subprocess.Popen[bytes]]"]


class _Spawner:
    """The one thread every child is forked from (one per process: a fork starts anew)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()

    def submit(self, args: Sequence[str], kwargs: dict[str, Any]) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._requests = queue.SimpleQueue()
                threading.Thread(target=self._run, name="harness-spawner", daemon=True).start()
            future: Future[subprocess.Popen[bytes]] = Future()
            self._requests.put((args, kwargs, future))
        try:
            return future.result()
        except BaseException:
            # Interrupted while waiting (e.g. KeyboardInterrupt): nobody will stop a
            # child started after all, so stop it as soon as it exists.
            future.add_done_callback(_kill_unclaimed)
            raise

    def _run(self) -> None:
        requests = self._requests
        while True:
            args, kwargs, future = requests.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                process: subprocess.Popen[bytes] = subprocess.Popen(
                    args, **{**kwargs, "preexec_fn": _preexec()}
                )
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(process)


def _kill_unclaimed(future: Future[subprocess.Popen[bytes]]) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    process = future.result()
    log.warning("killing pid %d: its starter was interrupted", process.pid)
    process.kill()
    process.wait()


_spawner = _Spawner()
# A forked child of this process has no spawner thread, and maybe a lock held by another
# thread at the fork: it starts anew.
os.register_at_fork(after_in_child=_spawner.reset)


def spawn(
    args: Sequence[str], *, outlive: bool = False, **popen_kwargs: Any
) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(args, **popen_kwargs)`` whose child dies with this process.

    The child gets SIGKILL when this process ends, however it ends (see the module
    docstring). With ``outlive=True`` it is a plain Popen from the calling thread: for
    processes meant to outlive this one, stopped later by pid.
    """
    if "preexec_fn" in popen_kwargs:
        raise TypeError("spawn() sets preexec_fn itself")
    if outlive:
        log.debug("starting %s (outlives this process)", args[0])
        return subprocess.Popen(args, **popen_kwargs)
    log.debug("starting %s (dies with this process)", args[0])
    return _spawner.submit(args, popen_kwargs)
