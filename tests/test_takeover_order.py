"""Per-project order when a member dies holding messages (takeover.py), on real servers.

Two member processes run harness.handlers:scripted_ledger. The member that owns one
project's partition is killed (-9) while it holds that project's messages, delivered and
unacknowledged; more of the project's messages are published at once. Its partition's
next owner takes it once the dead member's lease has expired, while those deliveries
still run their ack_wait on the server:

- Strict (the default): the next owner holds the newer messages until the earlier ones
  are back, and runs the project in stream order: 0 inversions, and the wait it reported
  is within ack_wait and a second;
- Fast: it pulls at once and runs the newer messages first; the earlier ones come back
  after ack_wait, behind them. (What Shoal did before orderAfterFailure existed: the
  scenario shows the gate is what makes the difference.)
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from harness.audit import message_ids
from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER, partition_for
from shoal.contracts.values import TargetValue
from shoal.group.config import GroupConfig, config_env
from shoal.group.jetstream import ensure_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HANDLER = "harness.handlers:scripted_ledger"
PARTITIONS = 4
ACK_WAIT = 8.0
LEASE_TTL = 4
SETTINGS = ("handler", "partitions", "ledger", "ack_wait", "lease_ttl", "order_after_failure")


@dataclass
class Killed:
    """A group whose m-0 was killed holding one project's messages (kill_holding)."""

    config: GroupConfig
    fleet: Fleet
    victim: int  # m-0's partition of the project
    ids: set[str]  # every message of the project: 30 before the kill, 20 after
    killed: float  # monotonic

    async def recorded(self, js: Any) -> set[str]:
        ledger = await read_ledger(js, self.config.ledger_stream)
        return {r.message_id for r in ledger if r.message_id} & self.ids


async def kill_holding(
    members: tuple[str, ...],
    order: str,
    make_fleet: Callable[..., Fleet],
    etcd: Etcd,
    js: Any,
    make_config: Any,
) -> Killed:
    """Start `members` (m-0 among them); publish 30 messages of one project of m-0's; once
    m-0 has run a few (100 ms each) and holds the rest, delivered and unacknowledged,
    kill it (-9) and publish 20 more."""
    config = make_config(
        handler=HANDLER,
        partitions=PARTITIONS,
        ack_wait=ACK_WAIT,
        lease_ttl=LEASE_TTL,
        keepalive_interval=1.0,
        order_after_failure=order,
    )
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=PARTITIONS)
    for member in members:
        fleet.start(member, **config_env(config, SETTINGS), SHOAL_KEEPALIVE_INTERVAL="1.0")
    status = await wait_for_status(
        etcd, config.namespace, config.group, PARTITIONS, settled(set(members)), 30
    )
    victim = min(p for p, m in status.owners.items() if m == "m-0")
    project = next(
        f"order-{i}" for i in range(1000) if partition_for(f"order-{i}", PARTITIONS) == victim
    )

    def message(i: int) -> Outgoing:
        return Outgoing(project, b"wait:100", f"{project}-{i}", {SEQ_HEADER: str(i)})

    producer = Producer(js, config.subject_prefix, PARTITIONS)
    first = [message(i) for i in range(30)]
    await producer.publish_many(first)
    killed = Killed(config, fleet, victim, set(message_ids(first)), 0.0)
    await eventually_async(
        lambda: killed.recorded(js), 30, "m-0 to start on the project", until=lambda s: len(s) >= 3
    )
    fleet.kill("m-0")
    killed.killed = time.monotonic()
    later = [message(i) for i in range(30, 50)]
    await producer.publish_many(later)
    killed.ids |= set(message_ids(later))
    return killed


@pytest.mark.parametrize("order", ["Strict", "Fast"])
async def test_the_next_owner_of_a_dead_members_partition_keeps_project_order(
    order: str, make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    k = await kill_holding(("m-0", "m-1"), order, make_fleet, etcd, js, make_config)
    config, fleet, victim, ids, killed = k.config, k.fleet, k.victim, k.ids, k.killed
    await eventually_async(
        lambda: k.recorded(js),
        60,
        "m-1 to process every message",
        until=lambda s: s == ids,
        interval=0.5,
    )
    drained_s = time.monotonic() - killed
    records = [r for r in await read_ledger(js, config.ledger_stream) if r.message_id in ids]
    result = audit(records, ids)
    log = fleet.members["m-1"].log_text()
    taken = [line for line in log.splitlines() if f"Partition {victim} taken over" in line]
    print(f"{order}: {len(result.out_of_order)} inversions, done {drained_s:.1f} s after the kill")
    print("\n".join(taken))
    assert not result.lost
    if order == "Strict":
        assert result.out_of_order == [], result.out_of_order
        assert f"Partition {victim} taken over:" in log, log[-3000:]
        waited = float(
            log.split(f"Partition {victim} taken over:")[1].split(" after ")[1].split(" s")[0]
        )
        assert waited <= ACK_WAIT + 1.5, waited
    else:
        # Newer messages ran before the dead member's, which came back after ack_wait.
        assert result.out_of_order, "Fast: expected the earlier deliveries to come back late"


async def test_a_backlog_given_back_twice_runs_in_stream_order(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """Planned moves only. m-0 holds a backlog of one partition's projects and leaves: it
    gives back what it holds, in stream order. m-1 is slow (each message takes it 100 ms)
    and pulls only part of that at a time (a partition's first pulls hold 64), so most of
    it is still on the durable's redelivery queue when m-1 gives its own part back in
    turn. JetStream redelivers naks in the order they arrived: m-1's lower sequences
    queue behind m-0's higher ones. The next owner, m-2, must still run each project in
    stream order (takeover.py's gate for an orderly hand-over); before, it ran the rest
    of m-0's part first, then m-1's: inversions on planned moves alone."""
    config = make_config(
        handler=HANDLER, partitions=PARTITIONS, lease_ttl=LEASE_TTL, keepalive_interval=1.0
    )
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=PARTITIONS)
    base = {**config_env(config, SETTINGS), "SHOAL_KEEPALIVE_INTERVAL": "1.0"}
    # m-0 limited to about 2,000 a second (its half of 4,000): on a loaded machine it
    # ran the whole backlog before its SIGTERM, and nothing was left to give back.
    fleet.start("m-0", **base, SHOAL_MAX_CONCURRENCY="64", SHOAL_MAX_MESSAGES_PER_SECOND="4000")
    fleet.start("m-1", **base, SHOAL_MAX_CONCURRENCY="1")
    status = await wait_for_status(
        etcd, config.namespace, config.group, PARTITIONS, settled({"m-0", "m-1"}), 30
    )
    moved = min(p for p, m in status.owners.items() if m == "m-0")
    projects = [
        f"again-{i}" for i in range(200) if partition_for(f"again-{i}", PARTITIONS) == moved
    ]
    messages = [
        Outgoing(project, b"wait-on:m-1:100", f"{project}-{i}", {SEQ_HEADER: str(i)})
        for i in range(1000)
        for project in projects[:20]
    ]
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(messages)
    ids = set(message_ids(messages))

    async def recorded() -> set[str]:
        return {r.message_id for r in await read_ledger(js, config.ledger_stream)} & ids

    async def ledger_length() -> int:  # (reading the whole ledger would take too long)
        return int((await js.stream_info(config.ledger_stream)).state.messages)

    await eventually_async(
        ledger_length, 30, "m-0 to start on the backlog", until=lambda n: n >= 300, interval=0.05
    )
    fleet.term("m-0")
    await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, settled({"m-1"}), 30)
    fleet.start("m-2", **base, SHOAL_MAX_CONCURRENCY="64")
    status = await wait_for_status(
        etcd, config.namespace, config.group, PARTITIONS, settled({"m-1", "m-2"}), 30
    )
    if status.owners[moved] == "m-1":
        fleet.term("m-1")  # the join moved another partition: m-1 leaves instead
    await eventually_async(
        recorded, 90, "every message to be processed", until=lambda s: s == ids, interval=0.5
    )
    records = [r for r in await read_ledger(js, config.ledger_stream) if r.message_id in ids]
    result = audit(records, ids)
    by_member = Counter(r.member for r in records)
    print(f"processed by {dict(by_member)}; {len(result.out_of_order)} inversions")
    assert set(by_member) == {"m-0", "m-1", "m-2"}, by_member  # the backlog did move twice
    assert not result.lost
    assert result.out_of_order == [], result.out_of_order


async def test_a_partition_moved_while_its_takeover_waits_keeps_project_order(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """Strict. m-0 dies holding a project's messages; the partition's next owner holds
    the newer ones, waiting for m-0's deliveries to come back (after ack_wait), and the
    partition moves on before they do. The third owner must wait for those deliveries
    too. Before, the second gave back what it held and wrote an orderly hand-over record
    listing only that: the third took it for orderly, ran the newer messages at once,
    and m-0's earlier ones after them (inversions)."""
    k = await kill_holding(("m-0", "m-1", "m-2"), "Strict", make_fleet, etcd, js, make_config)
    config, victim, ids = k.config, k.victim, k.ids
    # The next owner claims it (its gate closed: m-0's deliveries run their ack_wait)...
    taken = await wait_for_status(
        etcd,
        config.namespace,
        config.group,
        PARTITIONS,
        lambda s: s.claims.get(victim) in ("m-1", "m-2"),
        LEASE_TTL + 10,
    )
    second = taken.claims[victim]
    third = "m-2" if second == "m-1" else "m-1"
    # ...and it moves on at once (as a leader's rebalance would move it).
    target = TargetValue(
        owner=third, generation=taken.generation + 1, epoch=taken.epoch or 0, ts=time.time()
    )
    await etcd.put(config.keys.partition(victim), target.to_json())
    await eventually_async(
        lambda: k.recorded(js),
        60,
        "every message processed",
        until=lambda s: s == ids,
        interval=0.5,
    )
    records = [r for r in await read_ledger(js, config.ledger_stream) if r.message_id in ids]
    result = audit(records, ids)
    assert not result.lost
    assert result.out_of_order == [], (second, third, result.out_of_order)
