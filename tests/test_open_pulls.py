"""A partition never has more than one pull request of a member open on the server.

The member reads every pull's replies on one subscription, and a JetStream message keeps
its own subject: it reaches the partition's runner by the durable in its ack reply
subject, and the runner counts it against its open request (partition.py's docstring).
That is exact only while no other request of the member for the partition is open on
the server; these tests break that in the ways a review found, against a real
nats-server and etcd, with in-process Workers whose membership the test controls:

- a fence ends a runner's open request here only: the worker must not start its
  successor (the claim is still ours once the lease is renewed) until the server has
  ended it, and what it brought meanwhile goes back in order;
- while NATS is away, a pull published into nats-py's reconnect buffer goes out on
  reconnecting, live, beside every one asked for since: none may be published then;

and, with the fence too, a handler deaf to the fence's cancel that finishes later must
not take its message off the member's count a second time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from harness.inprocess import Handler, Member, assign, until
from harness.proxy import TcpProxy
from shoal.clients.etcd import Etcd
from shoal.clients.nats import connect
from shoal.contracts.names import PROJECT_HEADER, durable_name, partition_subject
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(90)
async def test_a_fenced_runners_open_pull_is_outlasted_before_its_successor_pulls(
    etcd: Etcd, nats_url: str, group: str
) -> None:
    # fetch_expires 5 s (the most allowed): the fenced runner's request stays open on the
    # server for seconds after the fence, so what happens meanwhile is deterministic.
    config = GroupConfig(
        group=group,
        namespace="test",
        member_id="m-0",
        partitions=1,
        fetch_expires=5.0,
        ledger=False,
    )
    admin = await connect(nats_url, name="admin")
    js = admin.jetstream()
    await ensure_group(js, config)
    seen: list[tuple[str, int, int]] = []  # (member, stream sequence, delivery count)

    def handler_of(name: str) -> Handler:
        async def handler(msg: Any) -> None:
            seen.append((name, msg.stream_sequence, msg.delivery_count))

        return handler

    a = Member(config, etcd, handler_of("m-0"))
    b = Member(config.model_copy(update={"member_id": "m-1"}), etcd, handler_of("m-1"))
    subject = partition_subject(config.subject_prefix, 0)

    async def publish(first: int, count: int) -> None:
        for i in range(first, first + count):
            await js.publish(subject, f"m{i}".encode(), headers={PROJECT_HEADER: "X"})

    async def open_pulls() -> int:
        info = await js.consumer_info(config.stream, durable_name(0))
        return int(info.num_waiting or 0)

    try:
        await assign(etcd, config, "m-0", 1)
        await a.start(nats_url)
        await until(
            lambda: 0 in a.worker.runners and a.worker.runners[0].request is not None,
            10,
            "the first runner to pull",
        )
        first = a.worker.runners[0]
        await asyncio.sleep(0.2)

        # A fence for a moment: the claim is still ours once the member is safe again.
        a.fence(True)
        await until(lambda: first.fenced, 5, "the fence")
        a.fence(False)
        # The fenced request is still open on the server, and takes what comes now.
        await asyncio.sleep(0.3)
        await publish(1, 4)

        await until(
            lambda: (
                (r := a.worker.runners.get(0)) is not None
                and r is not first
                and r.request is not None
            ),
            15,
            "the successor to pull",
        )
        second = a.worker.runners[0]
        # It pulled only once the fenced request was over: one request open, its own.
        assert await open_pulls() == 1
        # What the fenced request brought was given back and runs now, in order.
        await until(lambda: len(seen) == 4, 10, "the 4 messages to be handled")
        assert [s for (_, s, _) in seen] == [1, 2, 3, 4], seen
        await asyncio.sleep(0.3)
        # Pulling on, it still has one request open on the server: the one it believes.
        assert second.request is not None and not second.request.end.done()
        assert await open_pulls() == 1

        # Hand the partition over: the member releases it only with no request open,
        # so the next messages all go to the new owner, which runs them in order.
        await b.start(nats_url)
        await assign(etcd, config, "m-1", 2)
        await until(lambda: 0 not in a.worker.runners, 15, "m-0 to release the partition")
        await until(lambda: 0 in b.worker.runners, 10, "m-1 to take the partition")
        await publish(5, 10)
        await until(lambda: len(seen) >= 14, 20, "all 14 messages to be handled")
        await asyncio.sleep(0.5)  # (anything handled twice would show now)
        later = [(m, s) for (m, s, _) in seen[4:]]
        assert later == [("m-1", s) for s in range(5, 15)], seen
    finally:
        await a.close()
        await b.close()
        await admin.close()


@pytest.mark.timeout(120)
async def test_a_pull_sent_into_a_silent_network_is_outlasted_once_the_server_read_it(
    etcd: Etcd, nats_url: str, group: str
) -> None:
    """A fence often comes of a network gone silent while nats-py still counts itself
    connected. The fenced runner's request, written into the silence, reaches the server
    only when the network heals, and is open from then on: a successor that pulled as
    soon as the request's local expiry had passed had two requests open on the partition
    (the old one's messages counted against the new one), and a hand-over then gave back
    messages that had never run with an attempt used up (with maxDeliver 1, never run)."""
    config = GroupConfig(
        group=group,
        namespace="test",
        member_id="m-0",
        partitions=1,
        fetch_expires=5.0,
        ledger=False,
        ack_wait=4,
    )
    admin = await connect(nats_url, name="admin")
    js = admin.jetstream()
    await ensure_group(js, config)
    seen: list[tuple[str, int, int]] = []  # (member, stream sequence, delivery count)

    def handler_of(name: str) -> Handler:
        async def handler(msg: Any) -> None:
            seen.append((name, msg.stream_sequence, msg.delivery_count))

        return handler

    subject = partition_subject(config.subject_prefix, 0)

    async def publish(count: int) -> None:
        for _ in range(count):
            await js.publish(subject, b"x", headers={PROJECT_HEADER: "X"})

    async def open_pulls() -> int:
        info = await js.consumer_info(config.stream, durable_name(0))
        return int(info.num_waiting or 0)

    proxy = TcpProxy(nats_url.removeprefix("nats://")).start()
    a = Member(config, etcd, handler_of("m-0"))
    b = Member(config.model_copy(update={"member_id": "m-1"}), etcd, handler_of("m-1"))
    try:
        await a.start(f"nats://{proxy.address}")
        w = a.worker
        await asyncio.sleep(0.5)
        proxy.blackhole()  # silent: nats-py still counts itself connected
        await assign(etcd, config, "m-0", 1)
        await until(lambda: 0 in w.runners and w.runners[0].request is not None, 15, "a pull")
        first = w.runners[0]
        a.fence(True)
        await until(lambda: first.fenced, 5, "the fence")
        a.fence(False)
        # Past the request's local expiry (5 s) and margin: still not read by the server.
        await asyncio.sleep(7.0)
        assert a.nc.is_connected
        assert w.runners.get(0) is first, "a successor started before the server read ours"
        proxy.pass_through()
        await until(
            lambda: (r := w.runners.get(0)) is not None and r is not first and r.request,
            20,
            "the successor to pull",
        )
        for _ in range(10):
            assert await open_pulls() <= 1
            await asyncio.sleep(0.1)
        await publish(4)
        await until(lambda: len(seen) == 4, 10, "4 messages handled")

        # Hand over: the messages that come meanwhile run once, at the next owner, in order.
        await b.start(nats_url)
        await assign(etcd, config, "m-1", 2)
        await until(lambda: w.runners[0].letting_go, 5, "m-0 to let go")
        await publish(4)
        await until(lambda: 0 not in w.runners, 15, "m-0 to release the partition")
        await until(lambda: 0 in b.worker.runners, 10, "m-1 to take it")
        await publish(4)
        await until(lambda: len(seen) >= 12, 30, "12 messages handled")
        await asyncio.sleep(0.5)  # (anything handled twice would show now)
        assert [s for (_, s, _) in seen] == list(range(1, 13)), seen
        assert all(count == 1 for (_, _, count) in seen), seen
    finally:
        await a.close()
        await b.close()
        await admin.close()
        proxy.stop()


@pytest.mark.timeout(120)
async def test_no_pull_is_sent_while_nats_is_away(etcd: Etcd, nats_url: str, group: str) -> None:
    config = GroupConfig(
        group=group,
        namespace="test",
        member_id="m-0",
        partitions=1,
        fetch_batch=16,
        max_buffered=20,
        ledger=False,
        ack_wait=30,
    )
    admin = await connect(nats_url, name="admin")
    js = admin.jetstream()
    await ensure_group(js, config)
    await assign(etcd, config, "m-0", 1)
    release = asyncio.Event()

    async def handler(msg: Any) -> None:
        await release.wait()  # nothing settles: what the member holds stays visible

    proxy = TcpProxy(nats_url.removeprefix("nats://")).start()
    member = Member(config, etcd, handler)
    try:
        await member.start(f"nats://{proxy.address}")
        worker, nc = member.worker, member.nc
        await until(lambda: 0 in worker.runners, 10, "the runner")
        await asyncio.sleep(1.0)
        reconnects = nc.stats["reconnects"]
        proxy.reset()  # NATS away for this member (a network cut, with resets)
        # Long enough for many pulls to expire and be taken for lost.
        for _ in range(80):
            await asyncio.sleep(0.1)
            pending = b"".join(nc._pending)
            assert b"CONSUMER.MSG.NEXT" not in pending, "a pull waits in the reconnect buffer"
        proxy.pass_through()
        await until(
            lambda: nc.is_connected and nc.stats["reconnects"] > reconnects, 20, "the reconnect"
        )
        await asyncio.sleep(0.05)
        info = await js.consumer_info(config.stream, durable_name(0))
        assert (info.num_waiting or 0) <= 1, info.num_waiting

        subject = partition_subject(config.subject_prefix, 0)
        for i in range(300):
            await js.publish(subject, b"x", headers={PROJECT_HEADER: f"p{i}"})
        await until(lambda: worker.buffered > 0, 10, "the member to pull again")
        await asyncio.sleep(1.0)
        assert worker.buffered <= config.max_buffered, (worker.buffered, worker.budget())
        assert worker.runners[0].buffered == worker.buffered
    finally:
        release.set()
        await member.close()
        await admin.close()
        proxy.stop()


@pytest.mark.timeout(60)
async def test_a_deaf_handler_finishing_after_a_fence_is_counted_off_once(
    etcd: Etcd, nats_url: str, group: str
) -> None:
    config = GroupConfig(group=group, namespace="test", member_id="m-0", partitions=1, ledger=False)
    admin = await connect(nats_url, name="admin")
    js = admin.jetstream()
    await ensure_group(js, config)
    await assign(etcd, config, "m-0", 1)
    go = asyncio.Event()
    running = asyncio.Event()
    done: list[int] = []

    async def handler(msg: Any) -> None:
        running.set()
        while not go.is_set():
            try:
                await asyncio.shield(go.wait())
            except asyncio.CancelledError:
                pass  # deaf to the cancel (a cleanup that must finish, say)
        done.append(msg.stream_sequence)

    member = Member(config, etcd, handler)
    try:
        await member.start(nats_url)
        worker = member.worker
        await until(lambda: 0 in worker.runners, 10, "the runner")
        await js.publish(
            partition_subject(config.subject_prefix, 0), b"x", headers={PROJECT_HEADER: "X"}
        )
        await until(running.is_set, 10, "the handler to start")
        assert worker.buffered == 1
        member.fence(True)
        await until(lambda: 0 not in worker.runners, 5, "the fence")
        assert worker.buffered == 0  # the fenced runner's messages are no longer ours
        go.set()
        await until(lambda: bool(done), 5, "the deaf handler to finish")
        await asyncio.sleep(0.2)
        assert worker.buffered == 0
    finally:
        go.set()
        await member.close()
        await admin.close()
