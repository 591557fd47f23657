"""The report's Spark driver memory: its default from the machine's memory, and the sizes
``--driver-memory`` takes (issue 30). No JVM: the sizing is pure, the command's check
runs before any session starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from shoal.analytics.cli import main as cli
from shoal.analytics.session import (
    DRIVER_MEMORY_MAX_MIB,
    DRIVER_MEMORY_MIN_MIB,
    default_driver_memory,
    driver_memory_mib,
    machine_memory,
)

GIB = 1024**3


@pytest.mark.parametrize(
    ("total", "want"),
    [
        (23 * GIB, "5888m"),  # this project's 23 GB bench machine: a quarter
        (16 * GIB, "4096m"),
        (2 * GIB, f"{DRIVER_MEMORY_MIN_MIB}m"),  # a quarter is 512m: Spark's 1g instead
        (512 * GIB, f"{DRIVER_MEMORY_MAX_MIB}m"),  # capped
        (0, f"{DRIVER_MEMORY_MIN_MIB}m"),  # unknown
    ],
)
def test_the_default_is_a_quarter_of_the_memory_within_bounds(total: int, want: str) -> None:
    assert default_driver_memory(total) == want


def test_the_default_of_this_machine_is_within_bounds() -> None:
    mib = driver_memory_mib(default_driver_memory())
    assert DRIVER_MEMORY_MIN_MIB <= mib <= DRIVER_MEMORY_MAX_MIB


def test_a_container_limit_below_the_machine_decides(tmp_path: Path) -> None:
    physical = machine_memory(tmp_path / "no-cgroup")
    assert physical is not None and physical > 0
    (tmp_path / "memory.max").write_text(f"{GIB}\n")
    assert machine_memory(tmp_path) == min(GIB, physical)
    (tmp_path / "memory.max").write_text("max\n")  # cgroup v2 without a limit
    assert machine_memory(tmp_path) == physical
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    # cgroup v1 says "no limit" with a huge number.
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert machine_memory(tmp_path) == physical
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    assert machine_memory(tmp_path) == min(2 * GIB, physical)


@pytest.mark.parametrize(
    ("size", "mib"), [("512m", 512), ("4g", 4096), ("4G", 4096), (" 6g ", 6144), ("1t", 1 << 20)]
)
def test_memory_sizes(size: str, mib: int) -> None:
    assert driver_memory_mib(size) == mib


@pytest.mark.parametrize(
    ("size", "said"),
    [
        ("4096", "is not a memory size"),  # bytes to the JVM
        ("4gb", "is not a memory size"),  # -Xmx4gb: no size to the JVM
        ("2.5g", "is not a memory size"),
        ("lots", "is not a memory size"),
        ("", "is not a memory size"),
        ("256m", "at least 512m"),
    ],
)
def test_bad_sizes_are_refused(size: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        driver_memory_mib(size)


def test_the_command_refuses_a_bad_size_before_starting_anything(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    runner = CliRunner()
    for size, said in (("2gb", "is not a memory size"), ("100m", "at least 512m")):
        done = runner.invoke(
            cli,
            ["report", "-i", str(logs), "-o", str(tmp_path / "out"), "--driver-memory", size],
        )
        assert done.exit_code == 2, done.output
        assert "Invalid value for '--driver-memory'" in done.output and said in done.output
        assert not (tmp_path / "out").exists()
    helped = runner.invoke(cli, ["report", "--help"])
    assert "a quarter of this machine's memory" in " ".join(helped.output.split())
