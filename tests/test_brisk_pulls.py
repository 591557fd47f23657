"""Brisk pulls: short pull requests while a membership change is being answered, and
only until the leader's assignment for it arrives.

A member that sees a join or a leave cannot know yet which of its partitions will move,
so every partition pulls briskly (BRISK_EXPIRES) for up to BRISK_FOR: a moved partition
is released only once its open pull ended. Once the assignment that answers the change
is in the view, what moves is stopping already and what stays gains nothing from short
pulls; they only cost CPU while the host is busy with the hand-over (measured: the
unmoved partitions' extra pause p99 went from 15-74 ms to 17-37 ms, bench/handover.py).
Meanwhile no partition dozes (its last pull before a doze is a full-length one): the
last test, on real servers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.consumer.config import GroupConfig, config_env
from shoal.consumer.etcd import KV, Etcd
from shoal.consumer.jetstream import ensure_group
from shoal.consumer.metrics import Metrics
from shoal.consumer.producer import Outgoing, Producer
from shoal.consumer.view import GroupView
from shoal.consumer.worker import BRISK_EXPIRES, BRISK_FOR, Worker
from shoal.contracts.names import SEQ_HEADER, partition_for

CONFIG = GroupConfig(group="g", namespace="ns", member_id="m-0", partitions=4)


class Membership:
    lease_id = 7
    incarnation = 0

    def safe(self) -> bool:
        return True


def member(member_id: str) -> KV:
    return KV(CONFIG.keys.member(member_id), b"{}", 2, 2, 7)


def targets(generation: int, owners: list[str]) -> list[KV]:
    return [
        KV(
            CONFIG.keys.partition(p),
            json.dumps({"owner": o, "generation": generation, "epoch": 1, "ts": 1.0}).encode(),
            3,
            3,
            0,
        )
        for p, o in enumerate(owners)
    ]


def load(worker: Worker, revision: int, *kvs: KV) -> None:
    worker.view.load(revision, {kv.key: kv for kv in kvs})
    worker._notice_members()


def a_worker() -> Worker:
    view = GroupView(None, CONFIG.keys, CONFIG.partitions)  # type: ignore[arg-type]
    membership: Any = Membership()
    return Worker(CONFIG, None, view, membership, None, None, None, Metrics())  # type: ignore[arg-type]


def test_pulls_are_brisk_from_a_join_until_the_assignment_that_answers_it() -> None:
    worker = a_worker()
    settled = targets(1, ["m-0", "m-1", "m-0", "m-1"])
    load(worker, 10, member("m-0"), member("m-1"), *settled)
    assert worker.pull_expires() == CONFIG.fetch_expires  # the first view is no change

    load(worker, 11, member("m-0"), member("m-1"), member("m-2"), *settled)
    assert worker.pull_expires() == BRISK_EXPIRES  # a join: partitions may move

    # Other keys change (claims, stats): still the old generation, still brisk.
    load(worker, 12, member("m-0"), member("m-1"), member("m-2"), *settled)
    assert worker.pull_expires() == BRISK_EXPIRES

    answered = targets(2, ["m-0", "m-1", "m-2", "m-1"])
    load(worker, 13, member("m-0"), member("m-1"), member("m-2"), *answered)
    assert worker.pull_expires() == CONFIG.fetch_expires


def test_a_leave_makes_pulls_brisk_too() -> None:
    worker = a_worker()
    settled = targets(4, ["m-0", "m-1", "m-0", "m-1"])
    load(worker, 10, member("m-0"), member("m-1"), *settled)
    load(worker, 11, member("m-0"), *settled)
    assert worker.pull_expires() == BRISK_EXPIRES
    load(worker, 12, member("m-0"), *targets(5, ["m-0"] * 4))
    assert worker.pull_expires() == CONFIG.fetch_expires


# -- on real servers -------------------------------------------------------------------

HANDLER = "harness.handlers:scripted_ledger"
SETTINGS = ("handler", "partitions", "ledger")


class PullLog:
    """Every pull request sent to the stream's durables, with when it was seen and the
    expiry it asked for (a plain subscriber on the JetStream API subject sees each)."""

    def __init__(self) -> None:
        self.pulls: list[tuple[float, float]] = []  # (loop time, expires in seconds)

    async def seen(self, msg: Any) -> None:
        expires = json.loads(msg.data).get("expires", 0) / 1e9
        self.pulls.append((asyncio.get_running_loop().time(), expires))

    def since(self, start: float) -> list[float]:
        return [expires for at, expires in self.pulls if at >= start]


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_awake_partitions_do_not_doze_while_members_change(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """A partition that dozes sends one last pull of the full fetch_expires with its alarm
    armed; caught in it when its partition moves, it is released only once that pull
    ends (up to 0.3 s). So while members change, partitions pull briskly and doze only
    after."""
    partitions = 4
    config: GroupConfig = make_config(handler=HANDLER, partitions=partitions)
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=partitions)
    log = PullLog()
    sub = await js._nc.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}.*", cb=log.seen)
    loop = asyncio.get_running_loop()

    async def pulls_in(seconds: float) -> int:
        start = loop.time()
        await asyncio.sleep(seconds)
        return len(log.since(start))

    try:
        fleet.start("m-0", **config_env(config, SETTINGS))
        await wait_for_status(
            etcd, config.namespace, config.group, partitions, settled({"m-0"}), 30
        )
        await eventually_async(
            lambda: pulls_in(1.5), 30, "the idle partitions to doze", until=lambda n: n == 0
        )

        # A member key appears, with stats nobody can read: m-0 pulls briskly for
        # BRISK_FOR, and the leader (m-0) moves nothing to it (it ignores the key), so
        # no new assignment ends that early.
        await etcd.put(config.keys.member("m-x"), b"not JSON")
        joined_at = loop.time()
        # One message per partition wakes each (its alarm rings); then its pulls come
        # back empty, which would make it doze again.
        projects: dict[int, str] = {}
        for i in range(10_000):
            projects.setdefault(partition_for(f"p{i}", partitions), f"p{i}")
        items = [Outgoing(p, b"ok", f"{p}-0", {SEQ_HEADER: "0"}) for p in projects.values()]
        await Producer(js, config.subject_prefix, partitions).publish_many(items)
        woken_at = loop.time()
        await asyncio.sleep(BRISK_FOR - 0.5 - (woken_at - joined_at))
        during = log.since(woken_at)
        # Awake, each partition pulls every 50 ms; a doze would show as a pull of the
        # full fetch_expires (its last), then none.
        assert len(during) >= 4 * partitions, during
        assert max(during) <= BRISK_EXPIRES, str(
            [(round(at - joined_at, 3), e) for at, e in log.pulls if at >= joined_at]
        )

        # Afterwards the idle partitions doze again.
        await eventually_async(
            lambda: pulls_in(1.5), 30, "the partitions to doze again", until=lambda n: n == 0
        )
        assert max(log.since(joined_at)) == config.fetch_expires  # the doze's last pulls
    finally:
        await sub.unsubscribe()
        await etcd.delete(config.keys.member("m-x"))
    assert "Traceback" not in fleet.logs()
