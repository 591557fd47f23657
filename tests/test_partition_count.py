"""The group's partition count is its stream's (metadata shoal.partitions, written by the
operator and the members), for `run` and `status` as for `produce`; real nats-server and
etcd, the CLI as users run it.

`run --partitions 64` on a 128-partition group joined, took partitions 0-63, left 64-127
to nobody, logged a warning per foreign target at every resync, and (ensure_group)
rewrote the stream's count to 64 for every producer. `status -p 64` of that group showed
a healthy group of 64; `status` without -p counted what the assignment names.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.contracts.names import Keys
from shoal.contracts.values import TargetValue
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group, stream_partitions

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

RECORDED = 32


def member(
    config: GroupConfig, tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """`shoal-consumer run` of the group, as a user starts it."""
    argv = [sys.executable, "-m", "shoal.consumer", "run", "-g", config.group]
    argv += ["-n", config.namespace, "--nats", config.nats_url, "--etcd", config.etcd_endpoints]
    with open(tmp_path / "member.log", "w") as log:  # the process has its own copy
        return subprocess.Popen(
            [*argv, "--member-id", "m-0", "--lease-ttl", "5", *args],
            env={**os.environ, "SHOAL_KEEPALIVE_INTERVAL": "1", **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )


def ended(process: subprocess.Popen[str], timeout: float) -> int | None:
    """The exit status within `timeout` s; None (and the process stopped) if it ran on."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        return None


@pytest.mark.parametrize("how", ["flag", "env"])
async def test_run_refuses_a_count_the_stream_does_not_record(
    how: str, js: Any, etcd: Etcd, make_config: Callable[..., GroupConfig], tmp_path: Path
) -> None:
    config = make_config(partitions=RECORDED, ledger=False)
    await ensure_group(js, config)
    given = RECORDED // 2
    if how == "flag":
        process = member(config, tmp_path, "--partitions", str(given))
    else:
        process = member(config, tmp_path, env={"SHOAL_PARTITIONS": str(given)})
    status = await asyncio.to_thread(ended, process, 30)
    log = (tmp_path / "member.log").read_text()
    assert status is not None and status != 0, f"the member ran on (status {status}):\n{log}"
    assert f"records {RECORDED} partitions for group {config.namespace}/{config.group}" in log
    assert f"not the {given} given (--partitions, env SHOAL_PARTITIONS)" in log, log
    assert f"--partitions {RECORDED}" in log and "Traceback" not in log, log
    # Nothing written: not the stream's count, not a member key.
    assert stream_partitions(await js.stream_info(config.stream)) == RECORDED
    _, kvs = await etcd.get_prefix(config.keys.members)
    assert kvs == {}


async def test_run_accepts_its_own_count_and_an_older_stream(
    js: Any, etcd: Etcd, make_config: Callable[..., GroupConfig], tmp_path: Path
) -> None:
    """The count the stream records starts as before; so does any count on a stream
    without it (an older Shoal's): it gets the member's, as ensure_group always wrote."""
    config = make_config(partitions=RECORDED, ledger=False)
    await ensure_group(js, config)
    # An older Shoal's stream: no metadata (what ensure_group wrote, taken away).
    info = await js.stream_info(config.stream)
    info.config.metadata = None
    await js.update_stream(config=info.config)
    assert stream_partitions(await js.stream_info(config.stream)) is None
    process = member(config, tmp_path, "--partitions", "8")

    async def joined() -> dict[str, Any]:
        return (await etcd.get_prefix(config.keys.members))[1]

    try:
        await eventually_async(joined, 30, "the member's key", until=bool)
        assert stream_partitions(await js.stream_info(config.stream)) == 8
    finally:
        ran_on = await asyncio.to_thread(ended, process, 0.1) is None
    assert ran_on, (tmp_path / "member.log").read_text()
    log = (tmp_path / "member.log").read_text()
    assert "Ignored etcd key" not in log and "records" not in log, log


def status(config: GroupConfig, *args: str) -> Any:
    """`status` of the group; NATS where a user's environment says (NATS_URL)."""
    from shoal.consumer.cli import main

    argv = ["status", "-g", config.group, "-n", config.namespace]
    argv += ["--etcd", config.etcd_endpoints, *args]
    return CliRunner().invoke(main, argv, env={"NATS_URL": config.nats_url})


async def test_status_counts_the_partitions_the_stream_records(
    js: Any, etcd: Etcd, make_config: Callable[..., GroupConfig]
) -> None:
    """A 32-partition group whose leader (run with -p 16) assigned 16: `status` counted
    16 (from the assignment) and `status -p 16` agreed, a healthy group, while 16
    partitions had no consumer. The stream's count is used now, and -p 16 refused."""
    config = make_config(partitions=RECORDED, ledger=False)
    await ensure_group(js, config)
    keys = Keys(config.namespace, config.group)
    half = RECORDED // 2
    await etcd.put(keys.leader, b"m-0")
    await etcd.put(keys.member("m-0"), b'{"nats_ok": true}')
    for p in range(half):
        await etcd.put(keys.partition(p), TargetValue(owner="m-0", generation=1, epoch=1).to_json())
        await etcd.put(keys.claim(p), b"m-0")
    shown = await asyncio.to_thread(status, config, "--json")
    assert shown.exit_code == 0, shown.output
    found = json.loads(shown.stdout)
    assert found["unowned"] == list(range(half, RECORDED)), found
    table = await asyncio.to_thread(status, config)
    assert f"unowned partitions: {half}" in table.stdout, table.output
    refused = await asyncio.to_thread(status, config, "-p", str(half))
    assert refused.exit_code == 2, refused.output
    assert f"records {RECORDED} partitions for the group, not --partitions {half}" in (
        refused.output
    )
    agreed = await asyncio.to_thread(status, config, "-p", str(RECORDED), "--json")
    assert agreed.exit_code == 0 and json.loads(agreed.stdout) == found, agreed.output
    # NATS out of reach: said, and counted as before (the assignment, or -p).
    away = ["--nats", "nats://127.0.0.1:1"]
    alone = await asyncio.to_thread(status, config, *away, "--json")
    assert alone.exit_code == 0, alone.output
    assert "could not read stream" in alone.stderr, alone.stderr
    assert json.loads(alone.stdout)["unowned"] == []
