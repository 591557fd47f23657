"""Brisk pulls: short pull requests while a membership change is being answered, and
only until the leader's assignment for it arrives.

A member that sees a join or a leave cannot know yet which of its partitions will move,
so every partition pulls briskly (BRISK_EXPIRES) for up to BRISK_FOR: a moved partition
is released only once its open pull ended. Once the assignment that answers the change
is in the view, what moves is stopping already and what stays gains nothing from short
pulls; they only cost CPU while the host is busy with the hand-over (measured: the
unmoved partitions' extra pause p99 went from 15-74 ms to 17-37 ms, bench/handover.py).
Meanwhile no partition dozes (its last pull before a doze is a full-length one). A
member leaving on SIGTERM pulls briskly first, and leaves once its full-length pulls have
ended. The last two tests run on real servers.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import KV, Etcd
from shoal.consumer.metrics import Metrics
from shoal.consumer.producer import Outgoing, Producer
from shoal.consumer.worker import BRISK_EXPIRES, BRISK_FOR, Worker
from shoal.contracts.names import SEQ_HEADER, partition_for
from shoal.group.config import GroupConfig, config_env
from shoal.group.jetstream import ensure_group
from shoal.group.view import GroupView

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
    """Every pull request sent to the stream's durables, with when it was seen, the
    expiry it asked for and its reply subject (a plain subscriber on the JetStream API
    subject sees each)."""

    def __init__(self) -> None:
        self.pulls: list[tuple[float, float]] = []  # (loop time, expires in seconds)
        # By reply subject (a partition's, for all its pulls: one is open at a time).
        self.by_reply: dict[str, list[tuple[float, float]]] = defaultdict(list)

    async def seen(self, msg: Any) -> None:
        pull = (asyncio.get_running_loop().time(), json.loads(msg.data).get("expires", 0) / 1e9)
        self.pulls.append(pull)
        self.by_reply[msg.reply].append(pull)

    def since(self, start: float) -> list[float]:
        return [expires for at, expires in self.pulls if at >= start]


def one_project_each(partitions: int) -> list[str]:
    """A project id for every partition."""
    projects: dict[int, str] = {}
    for i in range(10_000):
        projects.setdefault(partition_for(f"p{i}", partitions), f"p{i}")
    return list(projects.values())


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
        projects = one_project_each(partitions)
        items = [Outgoing(p, b"ok", f"{p}-0", {SEQ_HEADER: "0"}) for p in projects]
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


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_leaving_member_ends_its_full_length_pulls_before_it_leaves(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """Once its member key is gone, a member stops its partitions, and each is released
    when its open pull has ended. So on SIGTERM it first pulls briskly and lets the
    full-length pulls it has open end (still consuming), and only then leaves."""
    partitions = 4
    config: GroupConfig = make_config(handler=HANDLER, partitions=partitions)
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=partitions)
    loop = asyncio.get_running_loop()
    log = PullLog()
    ends: dict[str, list[float]] = defaultdict(list)  # by reply subject: end statuses seen

    async def on_inbox(msg: Any) -> None:
        # Statuses come on the request's own reply subject (messages keep theirs).
        if msg.headers and msg.headers.get("Status") in ("404", "408", "409"):
            ends[msg.subject].append(loop.time())

    def pulls() -> list[tuple[float, float, float]]:
        """(seen at, expires, end seen at: inf if none) of every pull so far."""
        out = []
        for reply, requests in log.by_reply.items():
            for at, expires in requests:
                end = min((t for t in ends[reply] if t >= at), default=float("inf"))
                out.append((at, expires, end))
        return out

    nc = js._nc
    subs = [
        await nc.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}.*", cb=log.seen),
        await nc.subscribe("_INBOX.>", cb=on_inbox),
    ]
    projects = one_project_each(partitions)
    producer = Producer(js, config.subject_prefix, partitions)

    async def trickle() -> None:
        # One message per partition every 0.2 s: each stays awake, and its pulls (of
        # IDLE_BATCH or more) end at their expiry, with a status we can see.
        for n in range(10_000):
            await producer.publish_many(
                [Outgoing(p, b"ok", f"{p}-{n}", {SEQ_HEADER: str(n)}) for p in projects]
            )
            await asyncio.sleep(0.2)

    feeding: asyncio.Task[None] | None = None
    try:
        fleet.start("m-0", **config_env(config, SETTINGS))
        await wait_for_status(
            etcd, config.namespace, config.group, partitions, settled({"m-0"}), 30
        )
        feeding = asyncio.create_task(trickle())
        await asyncio.sleep(1.5)
        termed_at = loop.time()
        assert any(e == config.fetch_expires for at, e, _ in pulls() if at > termed_at - 0.5)
        fleet.term("m-0")

        async def member_key() -> int:
            _, kvs = await etcd.get_prefix(config.keys.member("m-0"))
            return len(kvs)

        await eventually_async(
            member_key, 10, "m-0 to leave", until=lambda n: n == 0, interval=0.01
        )
        left_at = loop.time()
        assert await asyncio.to_thread(fleet.wait_exit, "m-0", 30) == 0
        await asyncio.sleep(0.5)  # the statuses of pulls still open when it left
    finally:
        if feeding is not None:
            feeding.cancel()
        for sub in subs:
            await sub.unsubscribe()

    seen = pulls()
    late = [
        round(end - left_at, 3)
        for at, expires, end in seen
        if expires > BRISK_EXPIRES and at < left_at and end > left_at + 0.02
    ]
    assert not late, f"full-length pulls that ended after the member left (s after): {late}"
    # It went on consuming meanwhile, with brisk pulls.
    assert any(e <= BRISK_EXPIRES for at, e, _ in seen if termed_at < at < left_at)
    assert "Traceback" not in fleet.logs()
