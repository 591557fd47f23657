"""A takeover gate's bounds under Strict (takeover.py), on real servers: the two ways a
review found for a project's newer messages to run before its earlier ones.

- At its deadline the gate read nothing: keep-alives the earlier owner wrote into a
  network gone silent reached the server when it healed and renewed its deliveries by
  ack_wait from then, past the gate's deadline. Now the gate reads the durable at its
  deadline and waits another ack_wait while deliveries are held elsewhere.
- The one read of the durable at the takeover failed (a timeout: JetStream under load,
  or electing a consumer leader after a node died): no gate at all. Now it is asked
  again, and nothing is pulled until it answers or ack_wait has passed.

In-process Workers with the membership the test controls (harness.inprocess).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from harness.inprocess import Handler, Member, assign, until
from harness.proxy import TcpProxy
from shoal.clients.etcd import Etcd
from shoal.clients.nats import connect
from shoal.contracts.names import PROJECT_HEADER, partition_subject
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group


class Run:
    """Two members and a project X on partition 0; what each handler ran, in order."""

    def __init__(self, config: GroupConfig, etcd: Etcd, admin: Any) -> None:
        self.config = config
        self.js = admin.jetstream()
        self.seen: list[tuple[str, int, int]] = []  # (member, stream sequence, delivery)
        self.go = asyncio.Event()  # A's handler of sequence 1 waits for it
        self.a = Member(config, etcd, self.handler_of("m-0"))
        self.b = Member(
            config.model_copy(update={"member_id": "m-1"}), etcd, self.handler_of("m-1")
        )

    def handler_of(self, name: str) -> Handler:
        async def handler(msg: Any) -> None:
            if name == "m-0" and msg.stream_sequence == 1:
                await self.go.wait()
            self.seen.append((name, msg.stream_sequence, msg.delivery_count))

        return handler

    async def publish(self, count: int) -> None:
        subject = partition_subject(self.config.subject_prefix, 0)
        for _ in range(count):
            await self.js.publish(subject, b"x", headers={PROJECT_HEADER: "X"})

    def ran_on_b(self) -> list[int]:
        return [seq for (member, seq, _) in self.seen if member == "m-1"]

    async def close(self) -> None:
        self.go.set()
        await self.a.close()
        await self.b.close()


@pytest.mark.timeout(120)
async def test_keep_alives_that_land_late_keep_the_gate_closed(
    etcd: Etcd, nats_url: str, group: str
) -> None:
    ack_wait = 10.0
    config = GroupConfig(
        group=group,
        namespace="test",
        member_id="m-0",
        partitions=1,
        ledger=False,
        ack_wait=ack_wait,
    )
    assert config.order_after_failure == "Strict"
    admin = await connect(nats_url, name="admin")
    await ensure_group(admin.jetstream(), config)
    run = Run(config, etcd, admin)
    proxy = TcpProxy(nats_url.removeprefix("nats://")).start()
    reachable = True
    try:
        await assign(etcd, config, "m-0", 1)
        await run.a.start(f"nats://{proxy.address}")
        run.a.worker.nats_reachable = lambda: reachable
        await run.b.start(nats_url)
        await until(lambda: 0 in run.a.worker.runners, 10, "m-0 to run partition 0")
        await run.publish(5)  # m-0 runs 1 (blocked) and holds 2..5, keeping them alive
        await until(lambda: run.a.worker.buffered == 5, 10, "m-0 to hold 5")
        await asyncio.sleep(ack_wait / 4 + 0.5)  # a round of keep-alives reached the server
        proxy.blackhole()  # m-0's NATS goes silent; nats-py still counts itself connected
        reachable = False  # (what NatsHealth says after its grace)
        await assign(etcd, config, "m-1", 2)  # the leader moves the partition
        await asyncio.sleep(3.0)  # m-0 waits for its handler; its keep-alives go nowhere
        run.go.set()  # done: m-0 lets go, NATS away, no hand-over record
        await until(lambda: 0 in run.b.worker.runners, 10, "m-1 to take the partition")
        await run.publish(3)  # 6..8
        await asyncio.sleep(1.5)
        proxy.pass_through()  # m-0's keep-alives land now: 2..5 renewed by ack_wait
        await until(lambda: len(run.ran_on_b()) >= 7, 60, "m-1 to run 2..8")
        await asyncio.sleep(0.5)
        assert run.ran_on_b() == sorted(run.ran_on_b()), run.seen
    finally:
        await run.close()
        await admin.close()
        proxy.stop()


@pytest.mark.timeout(90)
async def test_a_failed_read_at_the_takeover_still_keeps_order(
    etcd: Etcd, nats_url: str, group: str
) -> None:
    config = GroupConfig(
        group=group, namespace="test", member_id="m-0", partitions=1, ledger=False, ack_wait=4
    )
    admin = await connect(nats_url, name="admin")
    await ensure_group(admin.jetstream(), config)
    run = Run(config, etcd, admin)
    try:
        await assign(etcd, config, "m-0", 1)
        await run.a.start(nats_url)
        await run.b.start(nats_url)
        real_info = run.b.worker.js.consumer_info
        calls = 0

        async def first_read_times_out(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise TimeoutError("consumer info timed out")
            return await real_info(*args, **kwargs)

        run.b.worker.js.consumer_info = first_read_times_out
        await until(lambda: 0 in run.a.worker.runners, 10, "m-0 to run partition 0")
        await run.publish(5)
        await until(lambda: run.a.worker.buffered == 5, 10, "m-0 to hold 5")
        lease = run.a.membership.lease_id
        await run.a.close()  # m-0 dies (as with SIGKILL: nothing settled, nothing given back)
        await etcd.revoke_lease(lease)
        await assign(etcd, config, "m-1", 2)
        await until(lambda: 0 in run.b.worker.runners, 10, "m-1 to take the partition")
        await run.publish(3)
        await until(lambda: len(run.seen) >= 8, 30, "m-1 to run 1..8")
        await asyncio.sleep(0.3)
        assert run.ran_on_b() == sorted(run.ran_on_b()), run.seen
        assert calls >= 2  # asked again
    finally:
        await run.close()
        await admin.close()
