"""`shoal-consumer status` from real etcd: stalled partitions (progress.py), unclaimed
and moving partitions, a group before its first assignment, and garbage times."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from shoal.clients.etcd import Etcd
from shoal.contracts.names import Keys
from shoal.contracts.values import TargetValue
from shoal.group.config import GroupConfig

pytestmark = pytest.mark.e2e


async def test_status_names_the_stalled_partitions(
    etcd: Etcd, group: str, etcd_endpoint: str
) -> None:
    """`shoal-consumer status` lists what members report stalled; garbage is ignored."""
    keys = GroupConfig(group=group, namespace="test", partitions=8).keys
    await etcd.put(keys.member("m-0"), json.dumps({"stalled": [3, 5], "rate": 1}).encode())
    await etcd.put(keys.member("m-1"), json.dumps({"stalled": "soon"}).encode())
    await etcd.put(keys.member("m-2"), json.dumps({"stalled": [True, 99, "4", 6]}).encode())
    env = {**os.environ, "ETCD_ENDPOINTS": etcd_endpoint}
    command = [sys.executable, "-m", "shoal.consumer", "status", "-g", group, "-n", "test"]
    shown = await asyncio.to_thread(
        subprocess.run, [*command, "-p", "8"], env=env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    assert "stalled partitions: 3 on m-0, 5 on m-0, 6 on m-2" in shown.stdout, shown.stdout
    as_json = await asyncio.to_thread(
        subprocess.run,
        [*command, "-p", "8", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(as_json.stdout)["stalled"] == {"3": "m-0", "5": "m-0", "6": "m-2"}


async def status(etcd_endpoint: str, namespace: str, group: str, *extra: str) -> Any:
    """`shoal-consumer status` of the group (the partitions its targets name)."""
    env = {**os.environ, "ETCD_ENDPOINTS": etcd_endpoint}
    command = [sys.executable, "-m", "shoal.consumer", "status", "-g", group, "-n", namespace]
    return await asyncio.to_thread(
        subprocess.run, [*command, *extra], env=env, capture_output=True, text=True, timeout=60
    )


async def owned_by_c0(etcd: Etcd, keys: Keys, partitions: int = 4) -> None:
    """c-0 leads and is every partition's target owner; nothing is claimed."""
    await etcd.put(keys.leader, b"c-0")
    await etcd.put(keys.member("c-0"), b"{}")
    for p in range(partitions):
        await etcd.put(keys.partition(p), TargetValue(owner="c-0", generation=1, epoch=1).to_json())


async def test_status_shows_unclaimed_partitions_and_every_claim(
    etcd: Etcd, etcd_endpoint: str, namespace: str, group: str
) -> None:
    """docs/operations.md sends ShoalPartitionsUnclaimed to `shoal-consumer status`
    ("unclaimed partitions"), and promises "every partition's target owner and claim";
    it showed neither, and --json had no claims."""
    keys = Keys(namespace, group)
    await owned_by_c0(etcd, keys)
    await etcd.put(keys.member("c-1"), b"{}")
    await etcd.put(keys.claim(0), b"c-0")
    await etcd.put(keys.claim(1), b"c-1")  # still c-1's: a hand-over going on
    shown = await status(etcd_endpoint, namespace, group)
    assert shown.returncode == 0, shown.stderr
    assert "  unclaimed partitions: 2\n" in shown.stdout, shown.stdout
    assert "claimed by another member than their target owner: 1 (c-1, target c-0)" in (
        shown.stdout
    )
    as_json = json.loads((await status(etcd_endpoint, namespace, group, "--json")).stdout)
    assert as_json["claims"] == {"0": "c-0", "1": "c-1"}
    assert as_json["unclaimed"] == [2, 3]


async def test_status_before_the_first_assignment_counts_no_partitions(
    etcd: Etcd, etcd_endpoint: str, namespace: str, group: str
) -> None:
    """A group whose member joined before any leader wrote targets showed "unowned
    partitions: 128" (DEFAULT_PARTITIONS), whatever its count: read_status counts the
    partitions the targets name, and there are none yet."""
    await etcd.put(Keys(namespace, group).member("c-0"), b"{}")
    shown = await status(etcd_endpoint, namespace, group)
    assert shown.returncode == 0, shown.stderr
    assert "no assignment yet" in shown.stdout, shown.stdout
    assert "unowned" not in shown.stdout and "unclaimed" not in shown.stdout
    as_json = json.loads((await status(etcd_endpoint, namespace, group, "--json")).stdout)
    assert (as_json["partitions"], as_json["unowned"], as_json["unclaimed"]) == (0, [], [])


@pytest.mark.parametrize("when", ["1e300", "1e17", "NaN", "-Infinity"])
async def test_status_survives_garbage_times(
    etcd: Etcd, etcd_endpoint: str, namespace: str, group: str, when: str
) -> None:
    """A pause record's time or a refused member's since that parses but is no time
    (1e300, 1e17, NaN) crashed the command (OverflowError, OSError from format_time),
    and --json wrote NaN, which no JSON reader takes."""
    keys = Keys(namespace, group)
    await owned_by_c0(etcd, keys)
    await etcd.put(keys.paused, b'{"by": "x", "time": %s, "source": "cli"}' % when.encode())
    await etcd.put(
        keys.problem("c-9"),
        b'{"reason": "NatsAuthFailed", "message": "m", "since": %s}' % when.encode(),
    )
    shown = await status(etcd_endpoint, namespace, group)
    assert shown.returncode == 0, shown.stderr
    assert "paused by x at an unknown time (cli)" in shown.stdout, shown.stdout
    assert "cannot connect to NATS since an unknown time: NatsAuthFailed: m" in shown.stdout
    as_json = await status(etcd_endpoint, namespace, group, "--json")
    assert as_json.returncode == 0, as_json.stderr
    strict = json.loads(as_json.stdout, parse_constant=lambda c: pytest.fail(f"{c} in --json"))
    assert strict["paused"]["time"] == 0.0 and strict["problems"]["c-9"]["since"] == 0.0
