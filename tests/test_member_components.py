"""The member's components run for as long as it does: one that ends, with or without an
error, ends the member with a log line that names it (runtime.ConsumerProcess.wait), and
none ends because of a setting the configuration allows."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from harness.fleet import Fleet, settled, wait_for_status
from shoal.clients.etcd import Etcd
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group

PARTITIONS = 8


@pytest.mark.e2e
@pytest.mark.timeout(90)
async def test_a_member_with_malloc_trim_off_stays_in_its_group(
    make_fleet: Callable[..., Fleet],
    make_config: Callable[..., GroupConfig],
    etcd: Etcd,
    js: Any,
) -> None:
    """SHOAL_MALLOC_TRIM_INTERVAL=0 is documented as "never trim". The trim task then
    returned at once, and the member, which leaves when any component ends, left the
    group right after joining it, logging nothing that said why (before: gone within a
    second of settling, exit code 0, every restart the same)."""
    config = make_config(partitions=PARTITIONS)
    await ensure_group(js, config)
    fleet = make_fleet(partitions=PARTITIONS)
    member = fleet.start("m-0", SHOAL_MALLOC_TRIM_INTERVAL="0")
    await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 30)
    await asyncio.sleep(3)
    assert member.alive(), member.log_text()[-3000:]
    await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 5)
    assert "Leaving the group" not in member.log_text()
