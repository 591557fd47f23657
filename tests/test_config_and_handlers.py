"""Configuration validation, handler loading and the CLI, without any server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from shoal.consumer.cli import main
from shoal.consumer.handlers import (
    HandlerContext,
    HandlerError,
    Message,
    SimulatedWork,
    ledger,
    load_handler,
    noop,
    simulated_work,
)
from shoal.group.config import GroupConfig, config_from_env


def test_defaults_derive_names_from_namespace_and_group() -> None:
    config = GroupConfig(group="orders", namespace="prod", member_id="c-0")
    assert config.subject_prefix == "shoal.prod.orders"
    assert config.stream == "shoal_prod_orders"
    assert config.partitions == 128
    assert config.lease_ttl == 10
    assert config.fence_after == 8


def test_environment_then_flags() -> None:
    env = {
        "SHOAL_GROUP": "g",
        "NATS_URL": "nats://h:1",
        "SHOAL_LEASE_TTL": "6",
        "SHOAL_BACKOFF": "1,2,5",
        "SHOAL_MEMBER_ID": "m",
    }
    config = config_from_env(env, nats_url="nats://flag:2", lease_ttl=None)
    assert config.nats_url == "nats://flag:2"
    assert config.lease_ttl == 6
    assert config.backoff == (1.0, 2.0, 5.0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"handler": "nocolon"}, "must look like"),
        ({"group": "a.b"}, "NATS subject token"),
        ({"partitions": 0}, "greater than or equal to 1"),
        ({"lease_ttl": 3, "fence_margin": 3}, "fence_margin"),
        ({"lease_ttl": 5, "keepalive_interval": 4}, "keepalive_interval"),
    ],
)
def test_invalid_configs_say_what_is_wrong(fields: dict[str, object], message: str) -> None:
    values: dict[str, object] = {"group": "g", "member_id": "m", **fields}
    with pytest.raises(ValidationError, match=message):
        GroupConfig.model_validate(values)


def test_builtin_handlers_load() -> None:
    assert load_handler("shoal.consumer.handlers:noop") is noop
    assert load_handler("shoal.consumer.handlers:ledger") is ledger


@pytest.fixture
def fresh_simulated_work() -> Iterator[None]:
    """The simulated work is read once per process: forget it around the test."""
    simulated_work.cache_clear()
    yield
    simulated_work.cache_clear()


def a_message() -> Message:
    return Message(
        project_id="p",
        partition=0,
        data=b"",
        headers={},
        stream_sequence=1,
        delivery_count=1,
        subject="s.0",
        context=HandlerContext(member_id="m", subject_prefix="s", js=None),
    )


def test_simulated_work_comes_from_the_documented_variables() -> None:
    env = {"SHOAL_HANDLER_DELAY_MS": "2.5", "SHOAL_HANDLER_CPU_MS": "7"}
    assert SimulatedWork.from_env(env) == SimulatedWork(cpu_ms=7.0, delay_ms=2.5)
    assert SimulatedWork.from_env({"SHOAL_HANDLER_DELAY_MS": ""}) == SimulatedWork()
    assert SimulatedWork.from_env({}) == SimulatedWork()


async def test_noop_reads_the_environment_once_not_per_message(
    monkeypatch: pytest.MonkeyPatch, fresh_simulated_work: None
) -> None:
    monkeypatch.setenv("SHOAL_HANDLER_DELAY_MS", "50")
    monkeypatch.setenv("SHOAL_HANDLER_CPU_MS", "20")
    started, cpu = time.monotonic(), time.process_time()
    await noop(a_message())
    assert time.monotonic() - started >= 0.05
    assert time.process_time() - cpu >= 0.02
    # Read per message, these would fail the next message (float("per message")).
    monkeypatch.setenv("SHOAL_HANDLER_DELAY_MS", "per message")
    monkeypatch.setenv("SHOAL_HANDLER_CPU_MS", "per message")
    started = time.monotonic()
    await noop(a_message())
    assert time.monotonic() - started >= 0.05
    assert simulated_work() == SimulatedWork(cpu_ms=20.0, delay_ms=50.0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no.such.module:handle", "cannot import module"),
        ("shoal.consumer.handlers:missing", "has no 'missing'"),
        ("shoal.consumer.handlers:load_handler", "must be an 'async def'"),
        ("justaname", "must look like"),
    ],
)
def test_unusable_handlers_fail_with_one_clear_line(spec: str, message: str) -> None:
    with pytest.raises(HandlerError, match=message) as info:
        load_handler(spec)
    assert "\n" not in str(info.value)


def test_a_handler_package_in_the_current_directory_is_named_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shoal-consumer console script does not search the current directory (python
    -m does): a new user's `run --handler mycompany.orders:handle` beside mycompany/
    said only "No module named 'mycompany'"."""
    (tmp_path / "mycompany").mkdir()
    (tmp_path / "mycompany" / "orders.py").write_text("async def handle(msg): pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with pytest.raises(HandlerError, match=r"in the current directory.*PYTHONPATH=\.") as info:
        load_handler("mycompany.orders:handle")
    assert "\n" not in str(info.value)
    with pytest.raises(HandlerError, match="is its package installed"):
        load_handler("elsewhere.orders:handle")


def test_cli_help_lists_the_commands() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in ("run", "produce", "plan", "status"):
        assert command in result.output


def test_cli_plan_compares_sticky_and_modulo() -> None:
    result = CliRunner().invoke(main, ["plan", "--members", "a,b,c", "--to", "a,b,c,d", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["sticky"]["moves"] == plan["sticky"]["min_moves"] == 32
    assert plan["modulo"]["moves"] > 64
    assert plan["sticky"]["skew"] == 0


def test_cli_run_refuses_an_unknown_handler_with_one_line() -> None:
    result = CliRunner().invoke(
        main, ["run", "--group", "g", "--handler", "nope.nothing:handle", "--etcd", "127.0.0.1:1"]
    )
    assert result.exit_code != 0
    assert "cannot import module 'nope.nothing'" in result.output
    assert "Traceback" not in result.output


def test_a_bad_environment_variable_is_named_as_the_user_wrote_it() -> None:
    """It read "max_messages_per_second: Input should be greater than 0": a field name
    the documentation never uses."""
    result = CliRunner().invoke(
        main,
        ["run", "--group", "g", "--etcd", "127.0.0.1:1"],
        env={"SHOAL_MAX_MESSAGES_PER_SECOND": "0"},
    )
    assert result.exit_code == 2, result.output
    assert "SHOAL_MAX_MESSAGES_PER_SECOND (max_messages_per_second)" in result.output
    # An option is named as before (its field).
    result = CliRunner().invoke(main, ["run", "--group", "a.b"])
    assert "SHOAL_GROUP" not in result.output and "group" in result.output


def test_a_bad_option_value_from_the_environment_names_the_variable() -> None:
    """A member's options come from SHOAL_* variables (spec.env among them): "Invalid value
    for '--health-port'" named a flag nobody passed."""
    result = CliRunner().invoke(
        main, ["run", "--group", "g"], env={"SHOAL_HEALTH_PORT": "not-a-port"}
    )
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--health-port' (from SHOAL_HEALTH_PORT)" in result.output
    result = CliRunner().invoke(main, ["run", "--group", "g", "--health-port", "nope"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--health-port': 'nope'" in result.output


def test_cli_run_refuses_a_bad_config_with_a_usage_error() -> None:
    result = CliRunner().invoke(main, ["run", "--group", "a.b"])
    assert result.exit_code == 2
    assert "NATS subject token" in result.output


def test_the_readiness_probe_is_cheap_and_says_why(tmp_path: Path) -> None:
    from shoal.consumer import ready

    ready_file = tmp_path / "m" / "ready"
    assert ready.main([str(ready_file)]) == 1
    state = ready.MemberState("c-0", 1, time.monotonic(), time.time(), True, True, True, False)
    ready.write_state(ready_file, state)
    assert ready.check(str(ready_file)) == (
        True,
        "ready: member c-0 has joined, holds its lease and reaches NATS",
    )
    assert ready.main([str(ready_file)]) == 0
    # Only the standard library: a fresh interpreter imports no third-party module for it.
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, shoal.consumer.ready; print(list(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = probe.stdout
    for heavy in ("pydantic", "nats", "etcd3", "click", "kubernetes", "grpc"):
        assert f"'{heavy}'" not in loaded, heavy
