"""`shoal-consumer status` shows stalled partitions (progress.py), from real etcd."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from shoal.clients.etcd import Etcd
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
