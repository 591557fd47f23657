"""The group's stream deleted and created again under a running member (real nats-server,
etcd and a member process): the new stream's sequences start again at 1, so what the
member remembers of the old one's deliveries must not decide anything about the new
one's messages."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.values import PauseRecord
from shoal.group.config import GroupConfig, config_env
from shoal.group.jetstream import ensure_group
from shoal.group.pause import pause_group, resume_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HANDLER = "harness.handlers:scripted_ledger"
PARTITIONS = 4
SETTINGS = ("handler", "partitions", "ledger")


async def handled(js: Any, config: GroupConfig) -> set[str]:
    return {r.message_id or "" for r in await read_ledger(js, config.ledger_stream)}


async def stream_messages(js: Any, config: GroupConfig) -> int:
    return int((await js.stream_info(config.stream)).state.messages)


async def test_messages_of_a_recreated_stream_are_all_handled(
    make_fleet: Callable[..., Fleet],
    etcd: Etcd,
    js: Any,
    make_config: Callable[..., GroupConfig],
) -> None:
    """200 messages handled on the old stream; the stream deleted and created again; 20
    messages of one project on the new one, whose sequences (1-20) are those of old
    messages the member settled. A pause while they run gives the unstarted ones back,
    and they come again as redeliveries: each must be handled, not taken for a late
    redelivery of the old message with its sequence and acked unhandled (the member's
    settled ring, settled.py, was never told the stream changed)."""
    config = make_config(handler=HANDLER, partitions=PARTITIONS)
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=PARTITIONS)
    fleet.start("m-0", **config_env(config, SETTINGS))
    await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 30)
    producer = Producer(js, config.subject_prefix, PARTITIONS)
    old = [Outgoing("p", b"ok", f"old-{i}", {}) for i in range(200)]
    await producer.publish_many(old)
    old_ids = {f"old-{i}" for i in range(200)}
    await eventually_async(
        lambda: handled(js, config), 30, "the old messages", until=lambda h: old_ids <= h
    )

    await js.delete_stream(config.stream)
    # The member notices (the deletion advisory, or its next look at the stream, every
    # stats interval: 5 s) before the operator's status timer (a 5 s tick) puts it back.
    await eventually_async(
        lambda: asyncio.to_thread(fleet.members["m-0"].log_text),
        15,
        "the member to notice the deletion",
        until=lambda log: "forgetting its deliveries" in log,
    )
    await ensure_group(js, config)  # as the operator does
    new = [Outgoing("p", b"wait:100", f"new-{i}", {}) for i in range(20)]
    await producer.publish_many(new)
    new_ids = {f"new-{i}" for i in range(20)}
    await eventually_async(
        lambda: handled(js, config), 30, "a first new message", until=lambda h: h & new_ids
    )
    record = PauseRecord(by="test", time=0.0, source="test", reason="give back")
    assert await pause_group(etcd, config.keys, record) is None
    await asyncio.sleep(2)
    await resume_group(etcd, config.keys)

    await eventually_async(
        lambda: stream_messages(js, config), 30, "the new stream empty", until=lambda n: n == 0
    )
    missing = new_ids - await handled(js, config)
    assert not missing, f"acked without being handled: {sorted(missing)}"
    assert "forgetting its deliveries" in fleet.members["m-0"].log_text()
