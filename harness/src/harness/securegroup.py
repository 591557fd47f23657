"""A ledger group on a secured nats-server whose users have only what Shoal gives them
(tests/test_nats_permissions.py, tests/test_nats_accounts.py).

As under the operator, the operator's user makes the streams and durables and the members
do not (`ensure_jetstream=False`); the test produces at a pace while members join and
leave, then waits for the work stream to drain and audits the ledger.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from harness.waiting import eventually_async
from shoal.consumer.ledger import LedgerRecord, audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.group.config import GroupConfig

__all__ = ["drain_and_audit", "operator_made_config", "produce_paced"]


def operator_made_config(group: str, etcd_endpoint: str, partitions: int) -> GroupConfig:
    """A ledger group whose streams and durables someone else (the operator) makes."""
    return GroupConfig(
        group=group,
        namespace="test",
        etcd_endpoints=etcd_endpoint,
        partitions=partitions,
        handler="shoal.consumer.handlers:ledger",
        ledger=True,
        ack_wait=2.0,
        ensure_jetstream=False,
    )


async def produce_paced(producer: Producer, items: Sequence[Outgoing]) -> None:
    """Publish `items` 150 at a time, 0.4 s apart: spread over the joins and leaves the
    test makes meanwhile, rather than all waiting before the first of them."""
    for start in range(0, len(items), 150):
        await producer.publish_many(items[start : start + 150])
        await asyncio.sleep(0.4)


async def drain_and_audit(
    js: Any,
    config: GroupConfig,
    message_ids: Sequence[str],
    what: str,
    logs: Callable[[], str],
) -> list[LedgerRecord]:
    """Wait (60 s at most) for the work stream to empty and the ledger to hold a record per
    published id, then assert that each was processed exactly once (`logs()`: the members'
    logs, read only to show with a failure). Returns the ledger's records."""

    async def counts() -> tuple[int, int]:
        work = await js.stream_info(config.stream)
        ledger = await js.stream_info(config.ledger_stream)
        return work.state.messages, ledger.state.messages

    await eventually_async(
        counts,
        60,
        what,
        until=lambda n: n[0] == 0 and n[1] >= len(message_ids),
        interval=0.3,
    )
    records = await read_ledger(js, config.ledger_stream)
    result = audit(records, message_ids)
    assert result.summary()["lost"] == 0, logs()
    assert result.summary()["duplicates"] == 0, logs()
    assert result.summary()["processed"] == len(message_ids)
    return records
