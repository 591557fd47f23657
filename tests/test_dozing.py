"""Idle partitions doze: no pull requests while nothing is published, woken at once
when something is (alarm.py), and never while a message is still out with someone else.

Real nats-server, etcd and member processes; the test counts the members' pull requests
by subscribing to the JetStream API subject they are sent to.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.audit import message_ids
from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER, durable_name, partition_for
from shoal.group.config import GroupConfig, config_env
from shoal.group.jetstream import ensure_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HANDLER = "harness.handlers:scripted_ledger"
PARTITIONS = 8
SETTINGS = ("handler", "partitions", "ledger", "ack_wait")


@pytest.fixture
def fleet(make_fleet: Callable[..., Fleet]) -> Fleet:
    return make_fleet(handler=HANDLER, partitions=PARTITIONS)


def one_project_per_partition() -> dict[int, str]:
    projects: dict[int, str] = {}
    i = 0
    while len(projects) < PARTITIONS:
        projects.setdefault(partition_for(f"project-{i}", PARTITIONS), f"project-{i}")
        i += 1
    return projects


class PullCounter:
    """Counts the pull requests sent to the stream's durables (a plain subscription to
    the API subject sees each request as the server's JetStream does), while in use as
    an async context manager."""

    def __init__(self, nc: Any, stream: str) -> None:
        self.count = 0
        self._nc = nc
        self._subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>"
        self._sub: Any = None

    async def __aenter__(self) -> PullCounter:
        async def seen(_: Any) -> None:
            self.count += 1

        self._sub = await self._nc.subscribe(self._subject, cb=seen)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._sub.unsubscribe()

    async def during(self, seconds: float) -> int:
        before = self.count
        await asyncio.sleep(seconds)
        return self.count - before

    async def until_none(self, what: str) -> None:
        """Until 2 s pass without a pull request (awake, 8 partitions send ~27 a second)."""
        await eventually_async(lambda: self.during(2.0), 30, what, until=lambda n: n == 0)


async def start_one(fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig, member: str) -> None:
    fleet.start(member, **config_env(config, SETTINGS))
    await wait_for_status(
        etcd, config.namespace, config.group, config.partitions, settled({member}), 30
    )


async def test_an_idle_group_stops_pulling_and_wakes_when_a_message_comes(
    fleet: Fleet, etcd: Etcd, js: Any, make_config: Any
) -> None:
    config = make_config(handler=HANDLER, partitions=PARTITIONS)
    await ensure_group(js, config)
    async with PullCounter(js._nc, config.stream) as pulls:
        await start_one(fleet, etcd, js, config, "m-0")
        await pulls.until_none("the idle partitions to doze")

        projects = one_project_per_partition()
        items = [
            Outgoing(project, b"", f"{project}-0", {SEQ_HEADER: "0"})
            for project in projects.values()
        ]
        published_at = time.time()
        await Producer(js, config.subject_prefix, config.partitions).publish_many(items)

        async def records() -> list[Any]:
            return await read_ledger(js, config.ledger_stream)

        done = await eventually_async(
            records, 30, "every partition to consume", until=lambda rs: len(rs) >= PARTITIONS
        )
        assert audit(done, message_ids(items)).summary()["lost"] == 0
        assert sorted(r.partition for r in done) == list(range(PARTITIONS))
        # The alarm woke each one at once (a missed alarm waits for the 60 s sweep).
        slowest = max(r.started for r in done) - published_at
        assert slowest < 5.0, f"a dozing partition took {slowest:.1f} s to wake"

        # And they doze again.
        await pulls.until_none("the partitions to doze again")
    assert "Traceback" not in fleet.logs()


async def test_a_partition_does_not_doze_while_a_dead_owners_message_is_unacked(
    fleet: Fleet, etcd: Etcd, js: Any, make_config: Any
) -> None:
    """A crashed owner's unacked message comes back after ack_wait, with no publish to
    ring an alarm: the next owner must still be pulling then."""
    # ack_wait well beyond the take-over (lease_ttl, 10 s), so that the next owner finds the
    # partition empty for a while before the message comes back.
    config = make_config(handler=HANDLER, partitions=PARTITIONS, ack_wait=25.0)
    await ensure_group(js, config)
    await start_one(fleet, etcd, js, config, "m-0")
    project = one_project_per_partition()[0]
    item = Outgoing(project, b"wait:3000", f"{project}-0", {SEQ_HEADER: "0"})
    await Producer(js, config.subject_prefix, config.partitions).publish_many([item])

    async def unacked() -> int:
        info = await js.consumer_info(config.stream, durable_name(0))
        return int(info.num_ack_pending)

    await eventually_async(unacked, 10, "m-0 to take the message", until=lambda n: n == 1)
    fleet.kill("m-0")
    killed_at = time.time()
    fleet.start("m-1", **config_env(config, SETTINGS))
    await wait_for_status(
        etcd, config.namespace, config.group, config.partitions, settled({"m-1"}), 30
    )

    async def records() -> list[Any]:
        return await read_ledger(js, config.ledger_stream)

    # Redelivered at most ack_wait after m-0's last in-progress ack; a dozing m-1 would
    # only find it at its 60 s sweep.
    done = await eventually_async(records, 45, "m-1 to process the message", until=len)
    assert [(r.member, r.message_id) for r in done] == [("m-1", item.message_id)]
    assert done[0].started - killed_at < 25.0 + 10.0


async def test_a_dozing_partition_notices_its_durable_deleted(
    fleet: Fleet, etcd: Etcd, js: Any, make_config: Any
) -> None:
    """A dozing partition pulls nothing; the deletion advisory rouses it, so the member
    recreates the durable at once instead of at the next publish or safety sweep."""
    config = make_config(handler=HANDLER, partitions=PARTITIONS)
    await ensure_group(js, config)
    async with PullCounter(js._nc, config.stream) as pulls:
        await start_one(fleet, etcd, js, config, "m-0")
        await pulls.until_none("the idle partitions to doze")
    await js.delete_consumer(config.stream, durable_name(3))

    async def recreated() -> bool:
        return "Recreated the missing durable consumer of partition 3" in fleet.logs()

    await eventually_async(recreated, 20, "m-0 to recreate the deleted durable")
    project = one_project_per_partition()[3]
    item = Outgoing(project, b"", f"{project}-0", {SEQ_HEADER: "0"})
    await Producer(js, config.subject_prefix, config.partitions).publish_many([item])

    async def records() -> list[Any]:
        return await read_ledger(js, config.ledger_stream)

    done = await eventually_async(records, 20, "the message to be consumed", until=len)
    assert [r.message_id for r in done] == [item.message_id]


async def test_a_message_naked_while_the_partition_dozes_is_pulled_again(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any, tmp_path: Path
) -> None:
    """A partition may doze while it holds messages (the durable has nothing else for
    it). One of them fails and is naked (NakAndContinue): JetStream redelivers it only to
    a pull, and no publish rings the alarm. It must not wait for the 60 s sweep."""
    config = make_config(handler=HANDLER, partitions=PARTITIONS, retry_policy="NakAndContinue")
    fleet = make_fleet(
        handler=HANDLER, partitions=PARTITIONS, env={"SHOAL_TEST_STATE_DIR": str(tmp_path)}
    )
    await ensure_group(js, config)
    fleet.start("m-0", **config_env(config, (*SETTINGS, "retry_policy")))
    await wait_for_status(
        etcd, config.namespace, config.group, config.partitions, settled({"m-0"}), 30
    )
    project = one_project_per_partition()[2]
    items = [
        Outgoing(project, b"wait:4000", f"{project}-0", {SEQ_HEADER: "0"}),
        Outgoing(project, b"fail-runs:1", f"{project}-1", {SEQ_HEADER: "1"}),
    ]
    published_at = time.time()
    await Producer(js, config.subject_prefix, config.partitions).publish_many(items)

    async def records() -> list[Any]:
        return await read_ledger(js, config.ledger_stream)

    done = await eventually_async(records, 90, "both messages", until=lambda rs: len(rs) >= 2)
    # 4 s of the first, the second's failure, its 1 s nak delay: about 5 s. A partition
    # left dozing finds it at its sweep, 60 s later.
    took = max(r.finished for r in done) - published_at
    assert took < 20.0, f"the naked message was handled {took:.1f} s after the publish"
    assert audit(done, message_ids(items)).summary()["lost"] == 0
