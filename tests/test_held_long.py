"""A project whose head cannot finish, while its partition's other projects move on, is no
stalled partition, yet it waits: the member exports the oldest held message's age
(`shoal_oldest_held_seconds`) and logs it once past ten stall periods, with what it waits
on. In-process member (harness.inprocess), real servers."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from harness.inprocess import Member, assign, until
from shoal.clients.etcd import Etcd
from shoal.clients.nats import connect
from shoal.contracts.names import PROJECT_HEADER, partition_subject
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(90)
async def test_a_head_that_never_finishes_is_measured_and_said(
    etcd: Etcd, nats_url: str, group: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = GroupConfig(
        group=group,
        namespace="test",
        member_id="m-0",
        partitions=1,
        ledger=False,
        stall_after=1,
        ack_wait=2,
        max_deliver=1000,
        backoff=(0.2,),
    )
    admin = await connect(nats_url, name="admin")
    js = admin.jetstream()
    await ensure_group(js, config)
    handled: list[str] = []

    async def handler(msg: Any) -> None:
        if msg.project_id.startswith("stuck"):
            raise RuntimeError("this one never works")
        handled.append(msg.project_id)

    member = Member(config, etcd, handler)
    subject = partition_subject(config.subject_prefix, 0)
    caplog.set_level(logging.WARNING, logger="shoal.consumer.worker")

    def oldest() -> float:
        value = member.worker.metrics.registry.get_sample_value("shoal_oldest_held_seconds")
        return float(value or 0.0)

    try:
        await assign(etcd, config, "m-0", 1)
        await member.start(nats_url)
        await js.publish(subject, b"x", headers={PROJECT_HEADER: "stuck"})
        await js.publish(subject, b"x", headers={PROJECT_HEADER: "stuck-too"})
        for i in range(24):  # the partition moves on meanwhile: no stall
            await js.publish(subject, b"x", headers={PROJECT_HEADER: f"flows-{i % 3}"})
            await asyncio.sleep(0.5)
        assert len(handled) >= 20
        await until(
            lambda: caplog.text.count("has been held here for") == 2, 10, "the long waits said"
        )
        assert 10 <= oldest() < 30, oldest()
        lines = [r.getMessage() for r in caplog.records if "held here" in r.getMessage()]
        # Each project's head, not only the oldest one.
        assert "of project 'stuck', partition 0" in lines[0], lines
        assert "of project 'stuck-too', partition 0" in lines[1], lines
        assert all("waiting on a retry after" in line for line in lines), lines
        assert member.worker.stalled() == []
        await asyncio.sleep(1)
        assert caplog.text.count("has been held here for") == 2  # once per message
    finally:
        await member.close()
        await admin.close()
