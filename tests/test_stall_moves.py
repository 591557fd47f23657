"""A stalled partition is noticed, reported and moved (progress.py, election.py).

Real nats-server, etcd and two member processes running harness.handlers:scripted_ledger.
The stall is real, not injected: on one member only, the handler of one project never
returns (a pod whose downstream connection is wedged), with no handler timeout; the
project's later messages fill its partition's buffer, so the partition pulls, settles and
receives nothing while messages wait. Nothing else would ever move it: the member is
alive, holds its lease and reaches NATS.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.consumer.progress import WEDGED_AFTER_STALLS
from shoal.consumer.ready import check, check_live
from shoal.contracts.names import SEQ_HEADER, partition_for
from shoal.group.config import GroupConfig, config_env
from shoal.group.jetstream import ensure_group
from shoal.group.status import GroupStatus

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HANDLER = "harness.handlers:scripted_ledger"
PARTITIONS = 4
STALL_AFTER = 5
SETTINGS = ("handler", "partitions", "ledger", "handler_timeout", "stall_after")
MEMBERS = ("m-0", "m-1")


async def start_two_members(
    make_fleet: Callable[..., Fleet],
    etcd: Etcd,
    js: Any,
    config: GroupConfig,
    ready: dict[str, Path] | None = None,
) -> tuple[Fleet, GroupStatus]:
    """The group's streams, then m-0 and m-1 (each writing its readiness to `ready[m]`, if
    given), once they hold every partition between them."""
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=PARTITIONS)
    for member in MEMBERS:
        probe = {"SHOAL_READY_FILE": str(ready[member])} if ready else {}
        fleet.start(member, **config_env(config, SETTINGS), **probe)
    status = await wait_for_status(
        etcd, config.namespace, config.group, PARTITIONS, settled(set(MEMBERS)), 30
    )
    return fleet, status


def project_in(partition: int, prefix: str) -> str:
    """The first project `<prefix>-<i>` whose messages go to `partition`."""
    return next(
        f"{prefix}-{i}"
        for i in range(1000)
        if partition_for(f"{prefix}-{i}", PARTITIONS) == partition
    )


async def processed(js: Any, config: GroupConfig, ids: set[str | None]) -> set[str]:
    """Which of `ids` the ledger shows processed."""
    return {r.message_id for r in await read_ledger(js, config.ledger_stream)} & ids


async def test_a_stalled_partition_is_moved_and_consumed_elsewhere(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any, tmp_path: Path
) -> None:
    config = make_config(
        handler=HANDLER, partitions=PARTITIONS, handler_timeout=0, stall_after=STALL_AFTER
    )
    ready = {m: tmp_path / f"{m}.ready" for m in MEMBERS}
    fleet, status = await start_two_members(make_fleet, etcd, js, config, ready)
    victim = min(p for p, m in status.owners.items() if m == "m-0")
    project = project_in(victim, "wedged")
    # More than the partition may hold (64 at first): its buffer fills behind the hang.
    items = [
        Outgoing(project, b"hang-on:m-0", f"{project}-{i}", {SEQ_HEADER: str(i)})
        for i in range(150)
    ]
    published = time.monotonic()
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)

    # Probe m-0 as the kubelet would, every 0.1 s, until it reports the stall: while it
    # holds the stalled partition it is not ready (the leader moves it seconds later).
    unready: list[str] = []

    async def probed() -> str:
        ok, why = check(str(ready["m-0"]))
        if not ok:
            unready.append(why)
        return _log(fleet, "m-0")

    await eventually_async(
        probed,
        STALL_AFTER + 15,
        "m-0 to report the partition stalled",
        until=lambda text: f"Partition {victim} is stalled" in text,
        describe=lambda text: text[-2000:],
    )
    stalled_in = time.monotonic() - published
    await eventually_async(
        probed, 5, "m-0 to turn unready", until=lambda _: bool(unready), interval=0.1
    )
    ids = {i.message_id for i in items}

    await eventually_async(
        lambda: processed(js, config, ids),
        STALL_AFTER + 30,
        "the stalled partition's messages to be processed by m-1",
        until=lambda got: got == ids,
    )
    consumed_in = time.monotonic() - published
    final = await wait_for_status(
        etcd, config.namespace, config.group, PARTITIONS, settled({"m-0", "m-1"}), 30
    )
    records = [r for r in await read_ledger(js, config.ledger_stream) if r.message_id in ids]
    print(f"stalled after {stalled_in:.1f} s, all consumed after {consumed_in:.1f} s")
    assert {r.member for r in records} == {"m-1"}
    # Given back in stream order (the hung run cancelled, its message first): m-1 ran
    # them in the project's order, nothing waited for ack_wait behind newer ones.
    in_run_order = [r.seq for r in sorted(records, key=lambda r: r.started) if r.seq is not None]
    assert len(in_run_order) == len(records)  # every message carried its sequence number
    assert in_run_order == sorted(in_run_order)
    assert final.owners[victim] == "m-1"
    assert final.skew <= 1
    assert any(f"stalled partition(s) [{victim}]" in why for why in unready), unready
    # Moved away, m-0 holds no stalled partition: ready again (its state file is
    # rewritten every second), and never wedged.
    await eventually_async(
        lambda: _probe(ready["m-0"]), 5, "m-0 to be ready again", until=lambda r: r[0]
    )
    assert check_live(str(ready["m-0"]))[0]
    leader_log = _log(fleet, final.leader or "")
    assert "Moved stalled partitions" in leader_log


async def test_one_hung_message_on_a_quiet_partition_is_a_stall(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """One message whose handler never returns (no handler timeout) and nothing else on
    its partition: the partition has room, so it pulls on, each pull answered with
    nothing, then dozes holding the message. Neither is progress for the held message:
    reported stalled, moved, consumed by m-1. (Before, the empty answers counted as
    progress and a dozing partition had no work: never reported, the project blocked
    for good, every probe green.)"""
    config = make_config(
        handler=HANDLER, partitions=PARTITIONS, handler_timeout=0, stall_after=STALL_AFTER
    )
    fleet, status = await start_two_members(make_fleet, etcd, js, config)
    victim = min(p for p, m in status.owners.items() if m == "m-0")
    project = project_in(victim, "quiet")
    item = Outgoing(project, b"hang-on:m-0", f"{project}-0", {SEQ_HEADER: "0"})
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many([item])
    await eventually_async(
        lambda: asyncio.to_thread(_log, fleet, "m-0"),
        STALL_AFTER + 20,
        "m-0 to report the partition stalled",
        until=lambda text: f"Partition {victim} is stalled" in text,
        describe=lambda text: text[-2000:],
    )
    await eventually_async(
        lambda: processed(js, config, {item.message_id}),
        STALL_AFTER + 30,
        "the hung message to be processed by m-1",
        until=lambda got: got == {item.message_id},
    )
    [record] = [
        r for r in await read_ledger(js, config.ledger_stream) if r.message_id == item.message_id
    ]
    assert record.member == "m-1"


async def _probe(path: Path) -> tuple[bool, str]:
    return check(str(path))


def _log(fleet: Fleet, member: str) -> str:
    return fleet.members[member].log_text()


async def test_a_long_handler_within_its_timeout_is_no_stall(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """A handler that takes longer than stallAfterSeconds, but not handlerTimeoutSeconds,
    with its partition's buffer full of its project's later messages: nothing moves
    (every stall_after the partition would move and its handler be cancelled, for ever)."""
    config = make_config(
        handler=HANDLER, partitions=PARTITIONS, handler_timeout=60, stall_after=STALL_AFTER
    )
    fleet, status = await start_two_members(make_fleet, etcd, js, config)
    items = [Outgoing("long", b"wait:9000", "long-0", {})]
    items += [Outgoing("long", b"ok", f"long-{i}", {}) for i in range(1, 100)]
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)
    ids = {i.message_id for i in items}

    await eventually_async(
        lambda: processed(js, config, ids), 40, "every message", until=lambda got: got == ids
    )
    owner = status.owners[partition_for("long", PARTITIONS)]
    records = [r for r in await read_ledger(js, config.ledger_stream) if r.message_id in ids]
    assert {r.member for r in records} == {owner}
    logs = _log(fleet, "m-0") + _log(fleet, "m-1")
    assert "is stalled" not in logs
    assert "Moved stalled" not in logs


async def test_a_handler_deaf_to_cancellation_keeps_its_partition_reported_until_restart(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any, tmp_path: Path
) -> None:
    """The stalled partition is moved, but its handler ignores being cancelled: the member
    must keep the claim while the handler runs (never two runs of one partition), so only
    ending the process frees the partition. That must not be silent: the member goes on
    reporting the partition stalled (not ready), fails liveness once it is wedged (the
    kubelet would restart it), and a SIGTERM then lets m-1 consume everything."""
    config = make_config(
        handler=HANDLER, partitions=PARTITIONS, handler_timeout=0, stall_after=STALL_AFTER
    )
    ready = {m: tmp_path / f"{m}.ready" for m in MEMBERS}
    fleet, status = await start_two_members(make_fleet, etcd, js, config, ready)
    victim = min(p for p, m in status.owners.items() if m == "m-0")
    project = project_in(victim, "deaf")
    items = [Outgoing(project, b"deaf-on:m-0", f"{project}-0", {SEQ_HEADER: "0"})]
    items += [
        Outgoing(project, b"ok", f"{project}-{i}", {SEQ_HEADER: str(i)}) for i in range(1, 150)
    ]
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)

    await eventually_async(
        lambda: _log_async(fleet, "m-0"),
        STALL_AFTER + 15,
        "m-0 to abort the moved partition's handlers",
        until=lambda text: "ignores its cancellation" in text,
        describe=lambda text: text[-2000:],
    )
    # Moved in the leader's target, but m-0 keeps the claim while the handler runs: it
    # still reports the partition stalled, so it is not ready, and soon not live.
    await eventually_async(
        lambda: _probe_live(ready["m-0"]),
        (WEDGED_AFTER_STALLS + 3) * STALL_AFTER,
        "m-0 to fail liveness (wedged)",
        until=lambda r: not r[0],
        describe=repr,
    )
    ok, why = check(str(ready["m-0"]))
    assert not ok and f"stalled partition(s) [{victim}]" in why, why
    claims = (
        await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, lambda s: True, 5)
    ).claims
    assert claims.get(victim) == "m-0"  # never released beside a running handler
    assert "still run" in _log(fleet, "m-0")

    # The kubelet's restart: SIGTERM. The deaf handler dies with the process.
    fleet.term("m-0")
    ids = {i.message_id for i in items[1:]}

    await eventually_async(
        lambda: processed(js, config, ids),
        45,
        "m-1 to process the partition's messages",
        until=lambda got: got == ids,
    )


async def _log_async(fleet: Fleet, member: str) -> str:
    return _log(fleet, member)


async def _probe_live(path: Path) -> tuple[bool, str]:
    return check_live(str(path))
