"""Child processes that die with the process that started them, even by SIGKILL.

A test, bench or demo that is killed (SIGKILL, or SIGTERM/SIGINT before its teardown
runs) never gets to stop the servers and members it started: without help they live on
as orphans, holding ports and CPU. On Linux a child can ask the kernel for a signal when
its parent dies: ``prctl(PR_SET_PDEATHSIG)``, kept across exec (the kernel clears it only
for set-user-ID binaries and credential changes). The signal is SIGKILL: nobody is left
to wait for a graceful stop, and a process whose SIGTERM handler hangs would otherwise
still be an orphan.

The child sets it by running ``setpriv --pdeathsig KILL -- <command>`` (util-linux),
which execs the command in the same process. Not with a ``preexec_fn``: that makes
``subprocess`` fork instead of vfork and run Python, and the fork handlers of every
library loaded, in the child of a process with threads. gRPC's (the etcd client's) did
not survive it: a bench's member hung before its exec, its log a single gRPC line
("epoll_wait error: Bad file descriptor"), and the group never saw it join.

The catch: the kernel's "parent" is the *thread* that forked the child, and the signal
comes when that thread exits, not the process. Servers are started from executor
threads (NatsCluster, EtcdCluster, ``asyncio.to_thread``) that end long before the
servers should, so `spawn` forks every child from one daemon thread of its own that
lives exactly as long as the process (it waits for work without holding the GIL, so
interpreter shutdown does not end it early either). ``dying_with_parent(args)`` is the
same command line for a starter that must start the child itself (asyncio's subprocess
API): only from the main thread, which also lives as long as the process.

Only the direct child gets the signal. A child that execs through a wrapper (spark-class
is a bash script ending in ``exec java``) stays the same process, so that is fine; a
child that forks its own long-lived children must make them die with it (the local
kubelet starts its pods with `spawn` too). ``outlive=True`` is for the processes of
`make cluster-up` and the demo, which are meant to outlive the command.

    process = spawn([binary, "--flag"], stdout=log, start_new_session=True)
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, cast

__all__ = ["dying_with_parent", "spawn"]

log = logging.getLogger(__name__)

DEATH_SIGNAL = signal.SIGKILL


def _death_signal_prefix() -> list[str]:
    if sys.platform != "linux":
        return []  # no parent-death signal there: children are started plainly
    setpriv = shutil.which("setpriv") or shutil.which("setpriv", path="/usr/bin:/bin")
    if setpriv is None:
        raise RuntimeError(
            "setpriv not found: it comes with util-linux (Debian: apt-get install util-linux)"
        )
    return [setpriv, "--pdeathsig", DEATH_SIGNAL.name.removeprefix("SIG"), "--"]


_PREFIX: list[str] | None = None


def _with_death_signal(
    args: Sequence[str],
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> list[str]:
    global _PREFIX
    if _PREFIX is None:
        _PREFIX = _death_signal_prefix()
    command = [os.fspath(a) for a in args]
    if _PREFIX and command:
        command[0] = _executable(command[0], env, cwd)
    return [*_PREFIX, *command]


def _executable(head: str, env: dict[str, str] | None, cwd: str | os.PathLike[str] | None) -> str:
    """What Popen would run, or the OSError it would raise in this process (setpriv would
    only exit with 127 in the child)."""
    if "/" not in head:
        path = (os.environ if env is None else env).get("PATH", os.defpath)
        found = shutil.which(head, path=path)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), head)
        return found
    full = os.path.join(os.fspath(cwd) if cwd is not None else os.getcwd(), head)
    if not os.path.exists(full):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), head)
    if not os.access(full, os.X_OK) or os.path.isdir(full):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), head)
    return os.path.abspath(full)


def dying_with_parent(args: Sequence[str]) -> list[str]:
    """`args` as a command line whose process gets SIGKILL when this process dies.

    Only from the main thread (see the module docstring); `spawn` does it from its own
    thread. Elsewhere than Linux, `args` unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("dying_with_parent() outside the main thread: use spawn()")
    return _with_death_signal(args)


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
                command = _with_death_signal(args, kwargs.get("env"), kwargs.get("cwd"))
                # (kwargs may ask for text mode: the annotation is the common case)
                process = cast("subprocess.Popen[bytes]", subprocess.Popen(command, **kwargs))
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
        # Python in the child of a process with threads can hang there (module docstring).
        raise TypeError("spawn() takes no preexec_fn")
    if outlive:
        log.debug("starting %s (outlives this process)", args[0])
        return subprocess.Popen(args, **popen_kwargs)
    log.debug("starting %s (dies with this process)", args[0])
    return _spawner.submit(args, popen_kwargs)
