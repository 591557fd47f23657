"""The process kubelet's pod runner without a plane: crash-loop backoff and grace periods
(e2e/test_localkube*.py show the rest on real processes)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.localkube import podrunner
from harness.localkube.podrunner import ContainerState, PodRunner, pod_grace


def test_backoff_doubles_to_its_cap_and_starts_over_after_a_long_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    clock_module = SimpleNamespace(monotonic=lambda: clock[0])
    monkeypatch.setattr("harness.localkube.podrunner.time", clock_module)
    runner = PodRunner(kubelet=SimpleNamespace(), pod=SimpleNamespace())  # type: ignore[arg-type]
    state = ContainerState(spec=SimpleNamespace(name="main"), log_path=Path("/dev/null"))

    def crash_after(seconds: float) -> float:
        state.started_mono = clock[0]
        clock[0] += seconds
        return runner._backoff(state)

    assert [crash_after(1) for _ in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]
    # A run of BACKOFF_RESET (60 s, the kubelet's 10 min scaled as its backoff is): 1 s again.
    assert crash_after(podrunner.BACKOFF_RESET) == 1
    assert crash_after(1) == 2


@pytest.mark.parametrize(("given", "grace"), [(None, 30.0), (0, 0.0), (5, 5.0)])
def test_a_zero_grace_period_is_not_the_default(given: int | None, grace: float) -> None:
    pod = SimpleNamespace(spec=SimpleNamespace(termination_grace_period_seconds=given))
    assert pod_grace(pod) == grace


def test_grace_periods_only_shrink_and_never_below_a_second() -> None:
    meta = SimpleNamespace(namespace="ns", name="p")
    runner = PodRunner(kubelet=SimpleNamespace(), pod=SimpleNamespace(metadata=meta))  # type: ignore[arg-type]
    assert runner.set_grace(60) and runner.grace == 60
    assert not runner.set_grace(90) and runner.grace == 60
    version = runner.grace_version
    assert runner.set_grace(0) and runner.grace == podrunner.MIN_POD_GRACE
    assert runner.grace_version == version + 1


def test_a_failed_runs_message_is_the_end_of_its_own_log(tmp_path: Path) -> None:
    """FallbackToLogsOnError as the kubelet reads it: the last 80 lines, at most 2,048
    bytes, of this run's output only (runs append to one file)."""
    log = tmp_path / "c.log"
    log.write_bytes(b"the previous run said this\n")
    offset = log.stat().st_size
    assert podrunner.log_tail(log, offset) == ""
    with log.open("ab") as out:
        out.write(b"".join(b"line %d\n" % n for n in range(100)) + b"Error: the last word")
    tail = podrunner.log_tail(log, offset)
    assert tail.splitlines() == [f"line {n}" for n in range(21, 100)] + ["Error: the last word"]
    with log.open("ab") as out:
        out.write(b"x" * 5000 + "\nnon-ASCII \u00e9 and a cut ".encode() + b"\xe2")
    tail = podrunner.log_tail(log, offset)
    assert len(tail.encode()) <= podrunner.TERMINATION_LOG_BYTES + 3  # a replaced byte
    assert tail.endswith("non-ASCII \u00e9 and a cut \ufffd")
    assert podrunner.log_tail(tmp_path / "gone.log", 0) == ""


@pytest.mark.parametrize(
    ("policy", "code", "has_message"),
    [("FallbackToLogsOnError", 1, True), ("FallbackToLogsOnError", 0, False), ("File", 1, False)],
)
def test_only_a_failure_under_fallback_to_logs_takes_the_log(
    tmp_path: Path, policy: str, code: int, has_message: bool
) -> None:
    log = tmp_path / "c.log"
    log.write_bytes(b"Traceback ...\nValueError: no such port\n")
    kubelet = SimpleNamespace(forget_pid=lambda pod, name: None)
    meta = SimpleNamespace(namespace="ns", name="p")
    runner = PodRunner(kubelet=kubelet, pod=SimpleNamespace(metadata=meta))  # type: ignore[arg-type]
    spec = SimpleNamespace(name="c", termination_message_policy=policy)
    state = ContainerState(spec=spec, log_path=log)
    state.process = SimpleNamespace(pid=2**22 + 7)  # type: ignore[assignment]  # no such process
    runner._exited(state, code)
    assert state.terminated is not None and state.terminated["exitCode"] == code
    message = state.terminated.get("message")
    assert (message == "Traceback ...\nValueError: no such port\n") is has_message, message
