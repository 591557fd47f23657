"""Key-ordered concurrency and in-order retries, on real servers with ledger audits.

A member runs messages of different projects at once (up to maxConcurrency) and the
messages of one project one after another, in stream order; a failing message is retried
in place before any later message of its project, while other projects go on
(DESIGN "JetStream and the data path"). The members run harness.handlers:scripted_ledger,
which does what each message's data says (wait, fail n times, always fail) and then
records it in the ledger.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from harness.audit import message_ids
from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import LedgerRecord, audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import (
    DEAD_LETTER_REASON_HEADER,
    SEQ_HEADER,
    dlq_subjects,
    partition_for,
)
from shoal.group.config import GroupConfig, config_env
from shoal.group.jetstream import ensure_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HANDLER = "harness.handlers:scripted_ledger"
PARTITIONS = 8
# What the members and the durables agree on (the members get it through config_env).
SETTINGS = (
    "handler",
    "partitions",
    "ledger",
    "max_concurrency",
    "max_deliver",
    "backoff",
    "retry_policy",
)


@pytest.fixture
def fleet(make_fleet: Callable[..., Fleet]) -> Fleet:
    return make_fleet(handler=HANDLER, partitions=PARTITIONS)


async def run_group(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig, items: list[Outgoing], **env: str
) -> list[LedgerRecord]:
    """One member consumes `items`; returns the ledger once every message is settled."""
    await ensure_group(js, config)
    fleet.start("m-0", **config_env(config, SETTINGS), **env)
    await wait_for_status(
        etcd, config.namespace, config.group, config.partitions, settled({"m-0"}), 30
    )
    await Producer(js, config.subject_prefix, config.partitions).publish_many(items)

    async def left() -> int:
        return int((await js.stream_info(config.stream)).state.messages)

    await eventually_async(left, 90, "the stream to drain", until=lambda n: n == 0, interval=0.2)
    return await read_ledger(js, config.ledger_stream)


def message(project: str, index: int, data: bytes) -> Outgoing:
    return Outgoing(project, data, f"{project}-{index}", {SEQ_HEADER: str(index)})


def peak_concurrency(records: list[LedgerRecord]) -> int:
    edges = sorted([(r.started, 1) for r in records] + [(r.finished, -1) for r in records])
    peak = running = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


async def dead_letters(js: Any, config: GroupConfig) -> list[Any]:
    sub = await js.pull_subscribe(dlq_subjects(config.subject_prefix)[0], stream=config.dlq_stream)
    try:
        return list(await sub.fetch(100, timeout=2))
    except TimeoutError:
        return []
    finally:
        await sub.unsubscribe()


async def test_projects_run_concurrently_each_in_stream_order(
    fleet: Fleet, etcd: Etcd, js: Any, make_config: Any
) -> None:
    config = make_config(handler=HANDLER, partitions=PARTITIONS, max_concurrency=40)
    items = [message(f"p{p}", i, b"wait:20") for i in range(15) for p in range(120)]
    records = await run_group(fleet, etcd, js, config, items)

    result = audit(records, message_ids(items))
    assert result.summary() == {
        "expected": 1800,
        "processed": 1800,
        "lost": 0,
        "duplicates": 0,
        "out_of_order": 0,  # also: no two messages of a project ran at the same time
        "overlaps": 0,
    }
    # Projects ran side by side, within one partition too, and never more than the limit.
    peak = peak_concurrency(records)
    assert 10 <= peak <= 40, peak
    by_partition: dict[int, list[LedgerRecord]] = defaultdict(list)
    for r in records:
        by_partition[r.partition].append(r)
    assert max(peak_concurrency(rs) for rs in by_partition.values()) > 1


async def test_poison_message_blocks_only_its_project(
    fleet: Fleet, etcd: Etcd, js: Any, make_config: Any
) -> None:
    config = make_config(
        handler=HANDLER, partitions=PARTITIONS, max_deliver=4, backoff=(0.4,), max_concurrency=20
    )
    poisoned = "p0"
    # Projects that share the poisoned project's partition: they must go on meanwhile.
    neighbours = [
        f"p{i}"
        for i in range(1, 200)
        if partition_for(f"p{i}", PARTITIONS) == partition_for(poisoned, PARTITIONS)
    ][:6]
    items = [message(poisoned, 0, b"wait:10"), message(poisoned, 1, b"poison")]
    items += [message(poisoned, i, b"wait:10") for i in range(2, 10)]
    items += [message(p, i, b"wait:100") for i in range(20) for p in neighbours]
    records = await run_group(fleet, etcd, js, config, items)

    # Only the poison is missing from the ledger: it is in the dead-letter stream, after
    # max_deliver attempts, and the rest of its project followed it, in order.
    result = audit(records, message_ids(items))
    assert result.lost == [f"{poisoned}-1"]
    assert result.summary()["duplicates"] == result.summary()["out_of_order"] == 0
    dlq = await dead_letters(js, config)
    assert len(dlq) == 1, [m.headers for m in dlq]
    assert "failed 4 times" in dlq[0].headers[DEAD_LETTER_REASON_HEADER]
    dead_at = dlq[0].metadata.timestamp.timestamp()

    ours = sorted((r for r in records if r.project_id == poisoned), key=lambda r: r.started)
    assert [r.message_id for r in ours] == [f"{poisoned}-{i}" for i in range(10) if i != 1]
    first_attempt = ours[0].finished
    # Three retries 0.4 s apart: its later messages waited for the dead-letter.
    assert dead_at - first_attempt >= 1.1
    assert all(r.started >= dead_at - 0.05 for r in ours[1:])
    # Its neighbours in the same partition went on meanwhile.
    during = [
        r for r in records if r.project_id in neighbours and first_attempt < r.started < dead_at
    ]
    assert len(during) >= 5, len(during)


async def test_failed_message_is_retried_before_its_project_goes_on(
    fleet: Fleet, etcd: Etcd, js: Any, make_config: Any
) -> None:
    config = make_config(handler=HANDLER, partitions=PARTITIONS, max_deliver=5, backoff=(0.2,))
    items = [
        message(f"p{p}", i, b"fail:2" if i == 3 else b"wait:5") for i in range(8) for p in range(30)
    ]
    records = await run_group(fleet, etcd, js, config, items)

    result = audit(records, message_ids(items))
    assert result.summary() == {
        "expected": 240,
        "processed": 240,
        "lost": 0,
        "duplicates": 0,
        "out_of_order": 0,
        "overlaps": 0,
    }
    # Each failing message succeeded on its third attempt, retried in place (JetStream
    # delivered it once: the attempts were counted here).
    third = {r.message_id: r.delivery_count for r in records if r.message_id.endswith("-3")}
    assert Counter(third.values()) == {3: 30}
    assert await dead_letters(js, config) == []


async def test_nak_and_continue_lets_later_messages_overtake(
    fleet: Fleet, etcd: Etcd, js: Any, make_config: Any
) -> None:
    """The old behaviour, as an explicit choice: JetStream redelivers the failed message
    after the backoff, and its project's later messages go first."""
    config = make_config(
        handler=HANDLER,
        partitions=PARTITIONS,
        max_deliver=5,
        backoff=(0.5,),
        retry_policy="NakAndContinue",
    )
    items = [message("p0", 0, b"fail:1")] + [message("p0", i, b"wait:1") for i in range(1, 5)]
    records = await run_group(fleet, etcd, js, config, items)

    result = audit(records, message_ids(items))
    assert result.summary()["lost"] == result.summary()["duplicates"] == 0
    order = [r.message_id for r in sorted(records, key=lambda r: r.started)]
    assert order[-1] == "p0-0", order
    assert next(r.delivery_count for r in records if r.message_id == "p0-0") == 2
    async with asyncio.timeout(10):
        assert await dead_letters(js, config) == []
