"""Processes the harness starts die with the process that started them, even by SIGKILL.

A parent process starts real servers (from a worker thread that ends at once, as
NatsCluster and asyncio.to_thread do), a real member and one process meant to outlive
it; the test SIGKILLs the parent and watches what is left (harness.children).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harness.children import dying_with_parent, spawn
from harness.localkube.plane import alive
from harness.waiting import eventually

PARENT = textwrap.dedent(
    """
    import json, os, sys, threading
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from harness.children import spawn
    from harness.fleet import Fleet
    from harness.servers import EtcdServer, NatsServer

    root = Path(sys.argv[1])
    nats, etcd = NatsServer(root / "nats"), EtcdServer(root / "etcd")
    # Started from pool threads that end right after: the kernel's parent-death signal
    # follows the thread that forked, so this is what must not kill them early.
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(nats.start), pool.submit(etcd.start)]:
            future.result()
    fleet = Fleet(
        root / "fleet", nats_url=nats.url, etcd_endpoint=etcd.endpoint,
        namespace="test", group="orphans",
    )
    member = fleet.start("m-0")
    keeper = spawn(["sleep", "120"], outlive=True, start_new_session=True)
    pids = {"dies": [nats.pid, etcd.pid, member.pid], "outlives": keeper.pid}
    (root / "pids.tmp").write_text(json.dumps(pids))
    os.replace(root / "pids.tmp", root / "pids.json")
    threading.Event().wait()
    """
)


def _kill(pid: int) -> None:
    """SIGKILL pid's process group (each child here leads its own) and pid itself."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.mark.e2e
def test_children_die_with_their_parent_even_by_sigkill(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids.json"
    with (tmp_path / "parent.log").open("wb") as out:
        parent = subprocess.Popen(
            [sys.executable, "-c", PARENT, str(tmp_path)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    pids: dict[str, Any] = {}
    try:

        def started() -> dict[str, Any] | None:
            if parent.poll() is not None:
                log = (tmp_path / "parent.log").read_text(errors="replace")
                raise AssertionError(f"the parent exited ({parent.returncode}): {log[-3000:]}")
            return json.loads(pids_file.read_text()) if pids_file.exists() else None

        found = eventually(started, 60, "the parent to start its children", interval=0.1)
        assert found is not None  # eventually returns only a truthy value
        pids = found
        # The pool threads that started the servers are gone: the servers are not (a
        # server's pid is None once it has exited).
        assert None not in pids["dies"], pids
        dies: list[int] = pids["dies"]
        time.sleep(1.0)
        assert all(alive(pid) for pid in dies), {pid: alive(pid) for pid in dies}

        parent.kill()
        parent.wait(10)
        eventually(
            lambda: [pid for pid in dies if alive(pid)],
            5,
            "the parent's children to die with it",
            until=lambda left: not left,
            interval=0.05,
        )
        assert alive(pids["outlives"]), "a child started with outlive=True died with its parent"
    finally:
        parent.kill()
        parent.wait(10)
        for pid in [*pids.get("dies", []), pids.get("outlives")]:
            if pid is not None:
                _kill(pid)


def test_spawn_from_a_thread_that_ends_outlives_the_thread() -> None:
    started: list[subprocess.Popen[bytes]] = []
    thread = threading.Thread(target=lambda: started.append(spawn(["sleep", "60"])))
    thread.start()
    thread.join()
    try:
        time.sleep(0.5)  # the thread's exit would have killed a child forked from it
        assert started[0].poll() is None
    finally:
        for process in started:
            process.kill()
            process.wait(10)


def test_dying_with_parent_only_from_the_main_thread() -> None:
    errors: list[BaseException] = []

    def outside() -> None:
        try:
            dying_with_parent(["true"])
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=outside)
    thread.start()
    thread.join()
    assert len(errors) == 1
    command = dying_with_parent(["true", "x"])
    assert command[-2:] == [shutil.which("true"), "x"], command


def test_spawn_takes_no_preexec_fn() -> None:
    with pytest.raises(TypeError):
        spawn(["true"], preexec_fn=lambda: None)


def test_a_missing_or_unrunnable_program_fails_in_the_caller_as_with_popen(
    tmp_path: Path,
) -> None:
    """The child runs setpriv first, which would only exit 127: spawn raises what Popen
    would have raised, before anything starts."""
    with pytest.raises(FileNotFoundError):
        spawn(["shoal-no-such-program"])
    with pytest.raises(FileNotFoundError):
        spawn([str(tmp_path / "missing")])
    plain = tmp_path / "not-executable"
    plain.write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError):
        spawn([str(plain)])
    with pytest.raises(FileNotFoundError):
        spawn(["true"], env={"PATH": str(tmp_path)})
    # Relative to cwd, as Popen resolves it.
    script = tmp_path / "hello"
    script.write_text("#!/bin/sh\necho hello\n")
    script.chmod(0o755)
    process = spawn(["./hello"], cwd=tmp_path, stdout=subprocess.PIPE)
    out, _ = process.communicate(timeout=10)
    assert out == b"hello\n"


def test_a_child_of_a_process_with_grpc_threads_runs_no_fork_handlers(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The etcd client's gRPC threads run in the benches and tests that spawn members. A
    child forked to run Python before its exec (a preexec_fn, until session 12) ran
    gRPC's fork handlers: the parent logged "skipping fork() handlers" on every start,
    some children "epoll_wait error: Bad file descriptor", and a bench's member once hung
    there. spawn's children exec at once (vfork), and no fork handler runs."""
    import grpc

    channel = grpc.insecure_channel("127.0.0.1:1")  # starts gRPC's threads
    try:
        grpc.channel_ready_future(channel).result(timeout=0.2)
    except grpc.FutureTimeoutError:
        pass
    children_err = tmp_path / "children.err"
    try:
        with children_err.open("ab") as err:
            for _ in range(50):
                process = spawn(["true"], stderr=err)
                assert process.wait(10) == 0
    finally:
        channel.close()
    assert "fork" not in capfd.readouterr().err
    assert children_err.read_text() == ""


BECOME = textwrap.dedent(
    """
    import ctypes, importlib.util, sys

    spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
    sandbox = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sandbox)

    def death_signal():
        value = ctypes.c_int(0)
        sandbox._libc.prctl(sandbox.PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
        return value.value

    before = death_signal()
    sandbox._become({"uid": 65534, "gid": 65534, "groups": []})
    print(before, death_signal())
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="changing to another user needs root")
def test_the_image_sandbox_keeps_the_death_signal_across_the_change_of_user() -> None:
    """The kernel clears it when the uid changes; the sandbox must set it again, or an
    image pod would outlive its kubelet."""
    from harness.localkube.image import SANDBOX

    with tempfile.TemporaryFile() as out:
        process = spawn([sys.executable, "-I", "-S", "-c", BECOME, str(SANDBOX)], stdout=out)
        try:
            assert process.wait(30) == 0
        finally:
            process.kill()
            process.wait(10)
        out.seek(0)
        assert out.read().split() == [str(int(signal.SIGKILL)).encode()] * 2
