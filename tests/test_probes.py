"""The consumer pod's probes: readiness follows the member's health, liveness its loop.

Unit tests of the checks on state files, then a real member (real etcd and nats-server,
reached through proxies the test owns) cut from NATS, cut from etcd, and frozen.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.fleet import Fleet
from harness.proxy import TcpProxy
from shoal.consumer import ready
from shoal.consumer.ready import (
    HealthFile,
    MemberState,
    check,
    check_live,
    read_state,
    write_state,
)

NOW = 1000.0
HEALTHY = MemberState(
    member="c-0",
    pid=42,
    mono=NOW - 1,
    ts=1.7e9,
    joined=True,
    safe=True,
    nats=True,
    leaving=False,
)


def _file(tmp_path: Path, state: MemberState) -> str:
    path = tmp_path / "c-0" / "ready"
    write_state(path, state)
    return str(path)


def test_a_healthy_fresh_member_is_ready_and_alive(tmp_path: Path) -> None:
    path = _file(tmp_path, HEALTHY)
    assert read_state(Path(path)) == HEALTHY
    ok, message = check(path, now=NOW)
    assert ok and message.startswith("ready: member c-0"), message
    ok, message = check_live(path, now=NOW)
    assert ok and message.startswith("alive: member c-0"), message


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"joined": False}, "has not joined its group yet"),
        ({"safe": False}, "is fenced"),
        ({"nats": False}, "cannot reach NATS"),
        ({"leaving": True}, "is leaving the group"),
        ({"mono": NOW - 6}, "has not refreshed its state for 6.0 s (> 5 s)"),
        # NATS refuses the member (natsauth.refusal): the reason, before "not joined".
        (
            {"joined": False, "problem": "NatsAuthFailed: NATS refused the credentials"},
            "member c-0: NatsAuthFailed: NATS refused the credentials",
        ),
    ],
)
def test_readiness_says_why_a_member_is_not_ready(
    tmp_path: Path, change: dict[str, object], why: str
) -> None:
    path = _file(tmp_path, HEALTHY._replace(**change))  # type: ignore[arg-type]
    ok, message = check(path, now=NOW)
    assert not ok and message.startswith("not ready: ") and why in message, message


@pytest.mark.parametrize(
    "change",
    [
        {"joined": False},
        {"safe": False},
        {"nats": False},
        {"leaving": True},
        {"mono": NOW - 59},
        {"problem": "NatsTLSFailed: the NATS server requires a client certificate"},
    ],
)
def test_liveness_ignores_etcd_and_nats(tmp_path: Path, change: dict[str, object]) -> None:
    # Fenced, cut from NATS, not joined (etcd down at start-up): all alive.
    path = _file(tmp_path, HEALTHY._replace(**change))  # type: ignore[arg-type]
    ok, message = check_live(path, now=NOW)
    assert ok, message


def test_liveness_fails_only_on_a_stale_state(tmp_path: Path) -> None:
    path = _file(tmp_path, HEALTHY._replace(mono=NOW - 61))
    ok, message = check_live(path, now=NOW)
    assert not ok and "event loop is stuck" in message and "61 s" in message, message
    assert check_live(path, max_age=90, now=NOW)[0]


def test_missing_and_garbage_files_are_not_ready(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    assert check(missing) == (
        False,
        f"not ready: {missing} does not exist (the member has not started yet)",
    )
    assert not check_live(missing)[0]
    garbage = tmp_path / "garbage"
    for text in ("c-0", "[]", json.dumps({"member": "c-0"})):
        garbage.write_text(text)
        ok, message = check(str(garbage))
        assert not ok and "is not a member state" in message, message


def test_the_cli_helps_and_exits_with_the_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ready.main(["--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "usage: shoal-ready" in shown and "--live" in shown and "--max-age" in shown
    assert "etcd or NATS being down never fails liveness" in shown
    assert ready.main(["--bogus"]) == 2
    fresh = HEALTHY._replace(mono=time.monotonic())
    path = _file(tmp_path, fresh)
    assert ready.main([path]) == 0
    assert ready.main([path, "--live"]) == 0
    write_state(Path(path), fresh._replace(mono=time.monotonic() - 10))
    assert ready.main([path]) == 1
    assert ready.main([path, "--live"]) == 0
    assert ready.main([path, "--live", "--max-age", "5"]) == 1


# -- a real member ---------------------------------------------------------------------------


def probe(state_file: Path, *args: str) -> tuple[bool, str]:
    """Run `shoal-ready` as the kubelet would: a fresh process."""
    result = subprocess.run(
        [sys.executable, "-m", "shoal.consumer.ready", str(state_file), *args],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return result.returncode == 0, (result.stdout + result.stderr).strip()


async def until(state_file: Path, want: bool, timeout: float, *args: str) -> tuple[float, str]:
    """Probe every 0.25 s until the verdict is `want`; (seconds it took, its message)."""
    started = time.monotonic()
    while True:
        ok, message = await asyncio.to_thread(probe, state_file, *args)
        if ok == want:
            return time.monotonic() - started, message
        if time.monotonic() - started > timeout:
            raise AssertionError(f"probe {args} still says {message!r} after {timeout:.0f} s")
        await asyncio.sleep(0.25)


@pytest.fixture
def proxies(nats_url: str, etcd_endpoint: str) -> Iterator[tuple[TcpProxy, TcpProxy]]:
    with (
        TcpProxy(nats_url.removeprefix("nats://"), name="nats") as nats_proxy,
        TcpProxy(etcd_endpoint, name="etcd") as etcd_proxy,
    ):
        yield nats_proxy, etcd_proxy


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_real_member_is_unready_while_cut_off_or_frozen_and_alive_unless_frozen(
    tmp_path: Path,
    nats_url: str,
    etcd_endpoint: str,
    namespace: str,
    group: str,
    proxies: tuple[TcpProxy, TcpProxy],
) -> None:
    nats_proxy, etcd_proxy = proxies
    state_file = tmp_path / "c-0" / "ready"
    figures: dict[str, float] = {}
    with Fleet(
        tmp_path / "members",
        nats_url=nats_url,
        etcd_endpoint=etcd_endpoint,
        namespace=namespace,
        group=group,
        partitions=8,
        env={"SHOAL_LEASE_TTL": "5", "SHOAL_KEEPALIVE_INTERVAL": "1", "SHOAL_ACK_WAIT": "2"},
    ) as fleet:
        fleet.start(
            "c-0",
            SHOAL_READY_FILE=str(state_file),
            NATS_URL=f"nats://{nats_proxy.address}",
            ETCD_ENDPOINTS=etcd_proxy.address,
        )
        try:
            figures["ready_after_start_s"], _ = await until(state_file, True, 30)

            # Cut from NATS: unready within a few seconds (NatsHealth's 3 s grace), alive.
            nats_proxy.blackhole()
            figures["unready_after_nats_cut_s"], why = await until(state_file, False, 15)
            assert "cannot reach NATS" in why, why
            assert (await asyncio.to_thread(probe, state_file, "--live"))[0]
            nats_proxy.pass_through()
            figures["ready_after_nats_heal_s"], _ = await until(state_file, True, 20)

            # Cut from etcd past the fence: unready (fenced), never dead.
            etcd_proxy.blackhole()
            figures["unready_after_etcd_cut_s"], why = await until(state_file, False, 15)
            assert "fenced" in why or "not joined" in why, why
            assert (await asyncio.to_thread(probe, state_file, "--live"))[0]
            await asyncio.sleep(3)  # past the lease TTL: the member must re-join
            assert (await asyncio.to_thread(probe, state_file, "--live"))[0]
            etcd_proxy.pass_through()
            figures["ready_after_etcd_heal_s"], _ = await until(state_file, True, 30)

            # Frozen: the state goes stale; readiness after 5 s, liveness after its
            # --max-age (60 s in pods; 8 s here, to keep the test short).
            fleet.signal("c-0", signal.SIGSTOP)
            frozen = time.monotonic()
            figures["unready_after_sigstop_s"], why = await until(state_file, False, 15)
            assert "has not refreshed its state" in why, why
            await until(state_file, False, 15, "--live", "--max-age", "8")
            figures["dead_after_sigstop_s"] = time.monotonic() - frozen
            assert (await asyncio.to_thread(probe, state_file, "--live"))[0]  # 60 s: alive
            fleet.signal("c-0", signal.SIGCONT)
            figures["ready_after_sigcont_s"], _ = await until(state_file, True, 30)

            fleet.term("c-0")
            assert await asyncio.to_thread(fleet.wait_exit, "c-0", 30) == 0
            assert not state_file.exists()
        finally:
            print("probe figures:", json.dumps({k: round(v, 2) for k, v in figures.items()}))
            if fleet.members["c-0"].alive():
                fleet.signal("c-0", signal.SIGCONT)


def test_a_state_left_by_an_ended_process_is_not_ready(tmp_path: Path) -> None:
    """A container restarted after a crash finds its predecessor's state, fresh for a
    few seconds: not ready until the new process writes its own (the pod was Ready
    before its process had started, and a SIGTERM then killed it unhandled)."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    start = ready.process_start()
    assert start is not None and start > 0
    mine = HEALTHY._replace(pid=os.getpid(), started=start, mono=time.monotonic())
    ok, message = check(_file(tmp_path, mine))
    assert ok, message
    # The pid of a process that has ended; and this process's pid with another start
    # time (the pid reused by a later process, e.g. pid 1 of a restarted container).
    for gone in (
        mine._replace(pid=ended.pid),
        mine._replace(started=start + 1),
    ):
        ok, message = check(_file(tmp_path, gone))
        assert not ok and f"(pid {gone.pid}) has ended" in message, message
        ok, message = check_live(_file(tmp_path, gone))
        assert ok, message  # a restarting container is not restarted again for it
    # Written before the field existed (or without /proc): not judged by it.
    ok, message = check(_file(tmp_path, mine._replace(pid=ended.pid, started=0)))
    assert ok, message


async def test_a_probe_that_raises_leaves_the_refresh_running_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A defect in the member's state function: the state file goes stale, so the probes
    fail, but the refresh task goes on (and recovers with the function) and the log says
    why, once. Before, the exception ended the task: the pod turned unready and was
    restarted with nothing in its log."""
    calls = 0

    def probe() -> MemberState:
        nonlocal calls
        calls += 1
        if calls <= 5:
            raise KeyError("partition 7")
        return MemberState(
            "m-0", os.getpid(), time.monotonic(), time.time(), True, True, True, False
        )

    health = HealthFile(str(tmp_path / "state.json"), probe, interval=0.01)
    task = asyncio.create_task(health.run())
    try:
        for _ in range(200):
            if calls > 6:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert calls > 6, "the refresh task ended"
    said = [r for r in caplog.records if "Cannot tell the member's state" in r.getMessage()]
    assert len(said) == 1 and "partition 7" in (said[0].exc_text or "")
    assert (tmp_path / "state.json").exists()
