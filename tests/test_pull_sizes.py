"""How much a partition asks for, on real servers: the pull requests a member sends are
read off the wire (a plain subscriber on the JetStream API subject sees each of them).

A partition that settles fast holds up to fetch_batch, so its pulls grow (each pull costs
the server about as much as a message or two); one whose handler is slow keeps to
PULL_FLOOR, so that it does not take the member's budget from the others; an idle one
asks for IDLE_BATCH (its open pulls reserve what they ask for). holding.py, partition.py.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import nats
import pytest

from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.partition import IDLE_BATCH, PULL_FLOOR
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER, durable_name, partition_for
from shoal.group.config import GroupConfig, config_env
from shoal.group.jetstream import ensure_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HANDLER = "harness.handlers:scripted_ledger"
PARTITIONS = 4
SETTINGS = ("handler", "partitions", "ledger", "max_concurrency")


@pytest.fixture
def fleet(make_fleet: Callable[..., Fleet]) -> Fleet:
    return make_fleet(handler=HANDLER, partitions=PARTITIONS)


def projects_of(partition: int, count: int) -> list[str]:
    found = (f"p{i}" for i in range(100_000) if partition_for(f"p{i}", PARTITIONS) == partition)
    return [next(found) for _ in range(count)]


async def test_a_backlog_is_pulled_in_full_batches_and_a_slow_partition_keeps_to_the_floor(
    fleet: Fleet, etcd: Etcd, js: Any, make_config: Any, nats_url: str
) -> None:
    config: GroupConfig = make_config(handler=HANDLER, partitions=PARTITIONS, max_concurrency=200)
    await ensure_group(js, config)
    # Partition 0: 3,000 messages of 20 projects, handled at once. Partition 1: 2 projects
    # of 20 ms messages, at most 100 a second. Partitions 2 and 3: nothing.
    fast = projects_of(0, 20)
    slow = projects_of(1, 2)
    items = [Outgoing(p, b"ok", f"{p}-{i}", {SEQ_HEADER: str(i)}) for i in range(150) for p in fast]
    items += [
        Outgoing(p, b"wait:20", f"{p}-{i}", {SEQ_HEADER: str(i)}) for i in range(150) for p in slow
    ]
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)

    asked: dict[str, list[int]] = defaultdict(list)
    watcher = await nats.connect(nats_url)

    async def on_pull(msg: Any) -> None:
        asked[msg.subject.rsplit(".", 1)[1]].append(json.loads(msg.data)["batch"])

    await watcher.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}.*", cb=on_pull)
    await watcher.flush()
    try:
        fleet.start("m-0", **config_env(config, SETTINGS))
        await wait_for_status(
            etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 30
        )

        async def left() -> int:
            return int((await js.stream_info(config.stream)).state.messages)

        await eventually_async(left, 60, "the stream to drain", until=lambda n: n == 0)
        await asyncio.sleep(0.5)  # the idle partitions' pulls keep coming meanwhile
    finally:
        await watcher.close()

    busy, slowed = asked[durable_name(0)], asked[durable_name(1)]
    # 3,000 messages: once the partition's rate is known it holds up to fetch_batch and
    # asks again when half is free, so its pulls outgrow the floor: fewer than the 94 of
    # 32 messages that a fixed hold of 64 took (about 30 in practice).
    assert max(busy) > PULL_FLOOR, busy
    assert len(busy) < 3000 / PULL_FLOOR, busy
    # 300 messages at 100 a second: never more than the floor at a time.
    assert max(slowed) <= PULL_FLOOR, slowed
    for idle in (durable_name(2), durable_name(3)):
        assert asked[idle] and max(asked[idle]) <= IDLE_BATCH, asked[idle]
