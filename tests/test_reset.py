"""`shoal-consumer reset` on real servers: nats-server, etcd and member processes.

1. --to-start: a group of two consumes a `limits` stream, the reset (the real CLI, in a
   process) replays every message once more: in the replay nothing is lost or twice,
   each project in stream order, and no partition had two members at once (the ledger).
2. --to-time between two batches replays only the second; --to-sequence from a
   sequence replays what follows it.
3. A group paused before the reset stays paused after it; --to-end there skips what was
   waiting, and what is published afterwards is consumed once resumed.
4. Refusals, each one line, exit status non-zero, nothing changed: workqueue and
   interest retention, a time in the future, a time that is no time, an unknown group,
   a sequence outside the stream, two positions at once.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from nats.js import api

from harness.fleet import Fleet, settled, wait_for_status
from harness.servers import free_port
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import LedgerRecord, audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group
from shoal.group.pause import read_pause

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PARTITIONS = 16
ENV = {
    "SHOAL_RETENTION": "limits",
    "SHOAL_LEASE_TTL": "5",
    "SHOAL_KEEPALIVE_INTERVAL": "1",
    "SHOAL_ACK_WAIT": "2",
    "SHOAL_STATS_INTERVAL": "1",
}
CLEAN = {"lost": 0, "duplicates": 0, "out_of_order": 0, "overlaps": 0}


@pytest.fixture
def config(group: str, namespace: str, nats_url: str, etcd_endpoint: str) -> GroupConfig:
    return GroupConfig(
        group=group,
        namespace=namespace,
        nats_url=nats_url,
        etcd_endpoints=etcd_endpoint,
        handler="shoal.consumer.handlers:ledger",
        ledger=True,
        partitions=PARTITIONS,
        retention="limits",
        ack_wait=2.0,
    )


@pytest.fixture
def fleet(tmp_path: Path, config: GroupConfig) -> Iterator[Fleet]:
    with Fleet.for_config(tmp_path / "members", config, env=ENV) as f:
        yield f


def traffic(tag: str, count: int, projects: int) -> list[Outgoing]:
    return [
        Outgoing(f"project-{i % projects}", b"x", f"{tag}-{i}", {SEQ_HEADER: str(i // projects)})
        for i in range(count)
    ]


async def reset_cli(config: GroupConfig, *args: str) -> tuple[int, str, str]:
    """`shoal-consumer reset` in a process of its own, as a user runs it."""
    where = ["-g", config.group, "-n", config.namespace, "--nats", config.nats_url]
    where += ["--etcd", config.etcd_endpoints]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shoal.consumer",
        "reset",
        *where,
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(90):
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def ok(done: tuple[int, str, str]) -> str:
    code, out, err = done
    assert code == 0, (code, out, err[-3000:])
    return out


async def ledger_count(js: Any, config: GroupConfig) -> int:
    return int((await js.stream_info(config.ledger_stream)).state.messages)


async def ledger_reaches(js: Any, config: GroupConfig, count: int, timeout: float = 40) -> None:
    await eventually_async(
        lambda: ledger_count(js, config),
        timeout,
        f"{count} ledger records",
        until=lambda n: n >= count,
        interval=0.1,
    )


async def stays(js: Any, config: GroupConfig, count: int, seconds: float) -> None:
    """Nothing more is processed for `seconds`."""
    await asyncio.sleep(seconds)
    assert await ledger_count(js, config) == count


async def started_group(fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig, **env: str) -> None:
    await ensure_group(js, config)
    members = {"c-0", "c-1"}
    for member in sorted(members):
        fleet.start(member, **env)
    await wait_for_status(
        etcd, config.namespace, config.group, config.partitions, settled(members), 30
    )


def audited(records: list[LedgerRecord], items: list[Outgoing]) -> dict[str, int]:
    result = audit(records, [item.message_id or "" for item in items]).summary()
    return {key: result[key] for key in ("expected", "processed", *CLEAN)}


def clean(items: list[Outgoing]) -> dict[str, int]:
    return {"expected": len(items), "processed": len(items), **CLEAN}


async def test_reset_to_start_replays_every_message_in_order(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    await started_group(fleet, etcd, js, config)
    items = traffic("a", 3000, 150)
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)
    await ledger_reaches(js, config, len(items))
    first = await read_ledger(js, config.ledger_stream)
    assert audited(first, items) == clean(items), fleet.logs()

    out = ok(await reset_cli(config, "--to-start", "--yes"))
    # What it said it would do, and did.
    assert f"Reset group {config.namespace}/{config.group}" in out
    assert f"stream {config.stream} (limits retention): 3,000 messages" in out
    assert f"partitions: {PARTITIONS} durables" in out
    assert "delivered from there: 3,000 messages (not yet consumed now: 0; about 3,000" in out
    assert f"{PARTITIONS} durables at the start of the stream" in out
    assert "Resumed: the members pull again" in out

    await ledger_reaches(js, config, 2 * len(items))
    await stays(js, config, 2 * len(items), 1.5)
    records = await read_ledger(js, config.ledger_stream)
    replay = records[len(first) :]
    assert audited(replay, items) == clean(items), fleet.logs()
    assert all(r.delivery_count == 1 for r in replay)
    # No two members on one partition at overlapping times, across the reset too.
    assert audit(records, []).overlaps == []
    assert await read_pause(etcd, config.keys) is None
    logs = fleet.logs()
    assert "durables were reset" in logs
    # Nobody recreated a durable with the old position in between.
    assert "Recreated the missing durable" not in logs


async def test_reset_to_a_time_or_a_sequence_replays_what_follows(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    await started_group(fleet, etcd, js, config)
    producer = Producer(js, config.subject_prefix, PARTITIONS)
    before, after = traffic("b1", 1000, 80), traffic("b2", 1000, 80)
    await producer.publish_many(before)
    await ledger_reaches(js, config, 1000)
    await asyncio.sleep(0.3)
    between = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    await asyncio.sleep(0.3)
    await producer.publish_many(after)
    await ledger_reaches(js, config, 2000)

    out = ok(await reset_cli(config, "--to-time", between, "--yes"))
    assert "delivered from there: 1,000 messages" in out, out
    await ledger_reaches(js, config, 3000)
    await stays(js, config, 3000, 1.5)
    records = await read_ledger(js, config.ledger_stream)
    assert audited(records[2000:], after) == clean(after), fleet.logs()

    # From a sequence: the stream's 1,500th message on (the second batch's last 500).
    out = ok(await reset_cli(config, "--to-sequence", "1501", "--yes"))
    assert "stream sequence 1501" in out and "delivered from there: 500 messages" in out
    await ledger_reaches(js, config, 3500)
    await stays(js, config, 3500, 1.5)
    records = await read_ledger(js, config.ledger_stream)
    tail = records[3000:]
    assert sorted(r.stream_sequence for r in tail) == list(range(1501, 2001))
    assert audited(tail, after[500:]) == clean(after[500:]), fleet.logs()


async def test_a_paused_group_stays_paused_and_to_end_skips_what_waits(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    from shoal.contracts.values import PauseRecord
    from shoal.group.pause import pause_group, resume_group

    await started_group(fleet, etcd, js, config)
    producer = Producer(js, config.subject_prefix, PARTITIONS)
    record = PauseRecord(by="test", time=time.time(), source="test", reason="hold")
    assert await pause_group(etcd, config.keys, record) is None
    waiting = traffic("w", 500, 40)
    await producer.publish_many(waiting)
    await stays(js, config, 0, 1.0)

    out = ok(await reset_cli(config, "--to-end", "--yes"))
    assert "(not yet consumed now: 500; about 500 waiting ones are skipped)" in out, out
    assert "stays paused" in out and "shoal-consumer resume" in out
    assert await read_pause(etcd, config.keys) == record  # the pause we found, untouched
    await stays(js, config, 0, 1.0)

    assert await resume_group(etcd, config.keys) == record
    later = traffic("l", 500, 40)
    await producer.publish_many(later)
    await ledger_reaches(js, config, 500)
    await stays(js, config, 500, 1.5)
    records = await read_ledger(js, config.ledger_stream)
    assert audited(records, later) == clean(later), fleet.logs()


async def test_to_end_skips_only_what_waited_when_the_command_ran(
    etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    """--to-end is "from now on": what is published after the command read the stream,
    while it waits for the members to pause, is delivered. (Before: the durables were
    recreated with deliver policy `new`, which counts from their creation, and 100
    messages published during the wait were skipped without a word.)"""
    from shoal.contracts.values import MemberStats

    await ensure_group(js, config)
    producer = Producer(js, config.subject_prefix, PARTITIONS)
    await producer.publish_many(traffic("old", 40, 8))  # what waits: skipped
    # A member that owns partition 0 and has not paused yet (a long handler).
    lease = await etcd.grant_lease(60)
    try:
        await etcd.put(config.keys.member("m-1"), MemberStats(owned=(0,)).to_json(), lease)
        await etcd.put(config.keys.claim(0), b"m-1", lease)
        reset = asyncio.create_task(reset_cli(config, "--to-end", "--yes", "--wait", "30"))
        try:
            await eventually_async(
                lambda: read_pause(etcd, config.keys),
                20,
                "the reset to pause the group",
                until=lambda record: record is not None,
                interval=0.05,
            )
            await producer.publish_many(traffic("new", 100, 8))
            paused = MemberStats(owned=(0,), paused=(0,))
            await etcd.put(config.keys.member("m-1"), paused.to_json(), lease)
            out = ok(await reset)
        finally:
            reset.cancel()
    finally:
        await etcd.revoke_lease(lease)
    assert "about 40 waiting ones are skipped" in out, out
    pending = 0
    for p in range(PARTITIONS):
        pending += int((await js.consumer_info(config.stream, f"p{p}")).num_pending or 0)
    assert pending == 100, out


async def test_a_reset_in_the_middle_of_a_backlog(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    """Reset while the members work through a backlog: the pause makes them finish what
    runs and give back what they fetched; after the reset every message is processed
    once more from the start, in order (what was given back to the old durables is
    not waited for)."""
    await started_group(fleet, etcd, js, config, SHOAL_HANDLER_DELAY_MS="10")
    items = traffic("m", 2400, 12)
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)
    await ledger_reaches(js, config, 300)
    out = ok(await reset_cli(config, "--to-start", "--yes"))
    assert "Resumed" in out
    _, kvs = await etcd.get_prefix(config.keys.reset)
    reset_at = json.loads(kvs[config.keys.reset].value)["time"]
    records = await read_ledger(js, config.ledger_stream)
    before = [r for r in records if r.started < reset_at]
    assert 300 <= len(before) < len(items), "the backlog was done before the reset: no test"
    await ledger_reaches(js, config, len(before) + len(items))
    await stays(js, config, len(before) + len(items), 1.5)
    records = await read_ledger(js, config.ledger_stream)
    replay = [r for r in records if r.started >= reset_at]
    assert audited(replay, items) == clean(items), fleet.logs()
    assert audit(records, []).overlaps == []


async def test_a_pause_during_the_replay_loses_nothing(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    """A pause in the middle of the replay gives back what the members fetched and had
    not started: it comes again as a second delivery of sequences they settled before
    the reset. Members that still remembered those (their settled ring) would take
    them for late redeliveries and ack them unhandled: lost to the replay."""
    from shoal.contracts.values import PauseRecord
    from shoal.group.pause import pause_group, resume_group

    # (A project's messages run one after another: 200 each of 10 ms take 2 s, so the
    # pause comes well before the replay's end.)
    await started_group(fleet, etcd, js, config, SHOAL_HANDLER_DELAY_MS="10")
    items = traffic("p", 2400, 12)
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)
    await ledger_reaches(js, config, len(items))
    ok(await reset_cli(config, "--to-start", "--yes"))
    await ledger_reaches(js, config, len(items) + 300)
    record = PauseRecord(by="test", time=time.time(), source="test", reason="mid-replay")
    assert await pause_group(etcd, config.keys, record) is None
    await asyncio.sleep(1.0)
    paused_at = await ledger_count(js, config)
    await stays(js, config, paused_at, 0.5)
    assert paused_at < 2 * len(items), "the replay ended before the pause: no test"
    assert await resume_group(etcd, config.keys) == record
    await ledger_reaches(js, config, 2 * len(items))
    await stays(js, config, 2 * len(items), 1.5)
    records = await read_ledger(js, config.ledger_stream)
    replay = records[len(items) :]
    assert audited(replay, items) == clean(items), fleet.logs()
    # (A member that still took replayed messages for its own late redeliveries says so.)
    assert "came back although this member had settled them" not in fleet.logs()


async def test_a_reset_run_again_finishes_an_interrupted_one(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    """A reset interrupted (Ctrl-C, etcd away at its end) after it paused the group and
    deleted a durable, before it created it again. Before, running it again, as its
    error said, found the pause and took it for someone else's (so the group stayed
    paused for good: the operator leaves a reset's pause alone), and planned only the
    durables it found (so partition 2 was consumed by nobody, or, where members
    recreate durables, from its old position)."""
    from shoal.contracts.values import PauseRecord
    from shoal.group.pause import RESET_SOURCE, pause_group

    await started_group(fleet, etcd, js, config)
    items = traffic("a", 400, 40)
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)
    await ledger_reaches(js, config, 400)
    # What the interrupted reset left: its pause, and p2 deleted.
    record = PauseRecord(by="someone", time=time.time(), source=RESET_SOURCE, reason="reset")
    assert await pause_group(etcd, config.keys, record) is None
    await asyncio.sleep(2)  # the members stop (a reset waits for that; this one did)
    await js.delete_consumer(config.stream, "p2")

    out = ok(await reset_cli(config, "--to-start", "--yes"))
    assert "missing durables, created at the new position: p2" in out, out
    assert "a reset that did not finish" in out, out
    assert "Resumed: the members pull again" in out, out
    assert await read_pause(etcd, config.keys) is None
    assert (await js.consumer_info(config.stream, "p2")).config.deliver_policy == (
        api.DeliverPolicy.ALL
    )
    await ledger_reaches(js, config, 800)
    records = await read_ledger(js, config.ledger_stream)
    assert audited(records[400:], items) == clean(items), fleet.logs()


async def test_a_reset_that_fails_before_its_work_keeps_an_inherited_pause(
    etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    """An interrupted reset left its pause, with p3 deleted. A second reset that gives up
    before it resets anything (a member that does not say it paused) must leave that
    pause: lifting it let members consume a group half reset."""
    from shoal.contracts.values import MemberStats, PauseRecord
    from shoal.group.pause import RESET_SOURCE, pause_group

    await ensure_group(js, config)
    record = PauseRecord(by="someone", time=time.time(), source=RESET_SOURCE, reason="reset")
    assert await pause_group(etcd, config.keys, record) is None
    await js.delete_consumer(config.stream, "p3")
    lease = await etcd.grant_lease(30)
    try:
        await etcd.put(config.keys.member("old-1"), MemberStats(owned=(0,)).to_json(), lease)
        await etcd.put(config.keys.claim(0), b"old-1", lease)
        line = await refused(config, "--to-start", "--yes", "--wait", "1")
        assert "stays paused by this reset" in line, line
        assert await read_pause(etcd, config.keys) == record
    finally:
        await etcd.revoke_lease(lease)


async def test_one_reset_at_a_time(etcd: Etcd, js: Any, config: GroupConfig) -> None:
    """A reset running (its `resetting` key, on its lease): a second one refuses and
    changes nothing. Before, both recreated durables at once, and whichever ended
    first resumed the group while the other still deleted and created."""
    await ensure_group(js, config)
    before = await durables_created(js, config)
    lease = await etcd.grant_lease(30)
    try:
        await etcd.put(config.keys.resetting, b'{"by": "ops@host"}', lease)
        line = await refused(config, "--to-start", "--yes")
        assert "another reset of the group is running" in line and "ops@host" in line, line
        assert await durables_created(js, config) == before
        assert await read_pause(etcd, config.keys) is None
    finally:
        await etcd.revoke_lease(lease)
    # Its process gone (the lease with it), a reset runs.
    ok(await reset_cli(config, "--to-start", "--yes"))
    _, kvs = await etcd.get_prefix(config.keys.resetting)
    assert config.keys.resetting not in kvs


async def test_an_unreachable_etcd_is_one_line(config: GroupConfig) -> None:
    """Before: a traceback (EtcdUnavailable)."""
    config = config.model_copy(update={"etcd_endpoints": f"127.0.0.1:{free_port()}"})
    line = await refused(config, "--to-start", "--yes")
    assert "etcd" in line, line


# -- refusals -----------------------------------------------------------------------------
# -- refusals -----------------------------------------------------------------------------


async def durables_created(js: Any, config: GroupConfig) -> dict[str, Any]:
    return {c.name: c.created for c in await js.consumers_info(config.stream)}


async def refused(config: GroupConfig, *args: str) -> str:
    """The reset refuses: exit status non-zero, one line saying why."""
    code, out, err = await reset_cli(config, *args)
    assert code != 0, (out, err)
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("Error: "), err
    return lines[-1]


async def test_a_server_without_jetstream_is_one_line(config: GroupConfig, tmp_path: Path) -> None:
    """reset and dlq against a NATS server with JetStream off say what is wrong (before:
    reset printed "Error: JetStream refused: None", nats-py's error having no
    description)."""
    from harness.servers import NatsServer

    server = NatsServer(tmp_path / "plain", jetstream=False).start()
    try:
        plain = config.model_copy(update={"nats_url": server.url})
        line = await refused(plain, "--to-start", "--yes")
        assert line.startswith(f"Error: nobody answers JetStream's API at {server.url}"), line
        assert "is JetStream enabled on that server" in line, line
        dlq = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "shoal.consumer", "dlq", "list", "-g", config.group, "-n", config.namespace),
            *("--nats", server.url),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(60):
            _, err = await dlq.communicate()
        assert dlq.returncode == 1, err
        assert (
            err.decode()
            .strip()
            .splitlines()[-1]
            .startswith(f"Error: nobody answers JetStream's API at {server.url}")
        ), err
    finally:
        server.stop()


@pytest.mark.parametrize("retention", ["workqueue", "interest"])
async def test_a_stream_that_deletes_acked_messages_is_refused(
    etcd: Etcd, js: Any, config: GroupConfig, retention: str
) -> None:
    config = config.model_copy(update={"retention": retention})
    await ensure_group(js, config)
    before = await durables_created(js, config)
    for position in ("--to-start", "--to-end"):
        line = await refused(config, position, "--yes")
        assert f"has {retention} retention" in line and "nothing to replay" in line
        assert "spec.nats.stream.retention: limits" in line
    assert await durables_created(js, config) == before
    assert await read_pause(etcd, config.keys) is None


async def test_bad_positions_and_unknown_groups_are_refused(
    etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    unknown = config.model_copy(update={"group": config.group + "x"})
    line = await refused(unknown, "--to-start", "--yes")
    assert f"unknown group {config.namespace}/{config.group}x: no stream" in line

    await ensure_group(js, config)
    items = traffic("r", 20, 4)
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)
    await js.purge_stream(config.stream, keep=10)  # the stream holds 11..20
    before = await durables_created(js, config)

    line = await refused(config, "--to-time", "2999-01-01T00:00:00Z", "--yes")
    assert "is in the future" in line
    line = await refused(config, "--to-time", "yesterday at noon", "--yes")
    assert "is no time" in line and "RFC 3339" in line
    for seq in ("10", "21"):
        line = await refused(config, "--to-sequence", seq, "--yes")
        assert f"sequence {seq} is not in stream {config.stream}: it holds 11..20" in line
    line = await refused(config, "--to-start", "--to-end", "--yes")
    assert "exactly one of" in line
    line = await refused(config, "--yes")
    assert "exactly one of" in line
    assert await durables_created(js, config) == before
    assert await read_pause(etcd, config.keys) is None

    # Relative times are accepted (an hour ago is before every message: all 10).
    code, out, _ = await reset_cli(config, "--to-time", "1h ago")  # no --yes: it asks
    assert code != 0 and "delivered from there: 10 messages" in out and "Aborted" in _


async def test_members_that_do_not_say_they_paused_leave_everything_as_it_was(
    etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    """A member that never reports its partitions paused (an older version, one cut from
    etcd): after --wait the reset gives up, resumes the group it paused, and has touched
    no durable."""
    from shoal.contracts.values import MemberStats

    await ensure_group(js, config)
    lease = await etcd.grant_lease(30)
    try:
        await etcd.put(config.keys.member("old-1"), MemberStats(owned=(0, 1)).to_json(), lease)
        for p in (0, 1):
            await etcd.put(config.keys.claim(p), b"old-1", lease)
        before = await durables_created(js, config)
        line = await refused(config, "--to-start", "--yes", "--wait", "1")
        assert "did not report their partitions paused within 1 s" in line
        assert "(old-1: partition(s) 0, 1)" in line and "nothing was reset" in line
        assert await durables_created(js, config) == before
        assert await read_pause(etcd, config.keys) is None
    finally:
        await etcd.revoke_lease(lease)


async def test_ensure_group_keeps_a_reset_durables_position(js: Any, config: GroupConfig) -> None:
    """The operator and starting members update durables whose settings changed: a
    durable the reset moved keeps its deliver policy (JetStream refuses to change it:
    error 10012, and ensure_group used to send `all`)."""
    from nats.js import api

    from shoal.group.reset import Position, recreate_durable

    await ensure_group(js, config)
    current = (await js.consumer_info(config.stream, "p0")).config
    await recreate_durable(js, config.stream, current, Position("sequence", seq=1))
    await ensure_group(js, config.model_copy(update={"ack_wait": 3.0}))
    info = await js.consumer_info(config.stream, "p0")
    assert info.config.deliver_policy == api.DeliverPolicy.BY_START_SEQUENCE
    assert info.config.opt_start_seq == 1 and info.config.ack_wait == 3.0


# -- pure parts -----------------------------------------------------------------------------


def test_reset_times_rfc3339_and_relative() -> None:
    from shoal.group.reset import parse_reset_time

    now = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
    hour_ago = datetime(2026, 11, 21, 11, 0, tzinfo=UTC)
    for text in ("1h", "-1h", "1h ago", " 1h  ago ", "60m"):
        assert parse_reset_time(text, now) == hour_ago, text
    assert parse_reset_time("2026-11-21T11:00:00Z", now) == hour_ago
    assert parse_reset_time("2026-11-21T12:00:00+01:00", now) == hour_ago
    assert parse_reset_time("2026-11-21T11:00:00", now) == hour_ago  # UTC unless it says
    for bad in ("yesterday", "1 hour ago", "-", "2026-13-01T00:00:00Z", ""):
        with pytest.raises(ValueError, match="is no time"):
            parse_reset_time(bad, now)


def test_times_out_of_range_are_usage_errors() -> None:
    """A time before year 1 or a duration past it is a usage error naming the range
    (before: an OverflowError's traceback, from timedelta or astimezone)."""
    from click.testing import CliRunner

    from shoal.consumer.cli import main

    for args in (
        ["reset", "-g", "orders", "--to-time", "99999999999d", "--yes"],
        ["reset", "-g", "orders", "--to-time", "0001-01-01T00:00:00+01:00", "--yes"],
        ["dlq", "list", "-g", "orders", "--since", "800000d"],
        ["dlq", "redrive", "-g", "orders", "--since", "99999999999d"],
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, (args, result.output, result.exception)
        assert "Invalid value" in result.output and "out of range" in result.output, args


def test_a_position_is_a_deliver_policy_on_the_same_config() -> None:
    from nats.js import api

    from shoal.group.jetstream import consumer_config
    from shoal.group.reset import Position

    base = consumer_config(GroupConfig(group="g", namespace="n", retention="limits"), 3)
    when = datetime(2026, 11, 21, 11, 0, tzinfo=UTC)
    cases = {
        Position("start"): (api.DeliverPolicy.ALL, None, None),
        Position("end"): (api.DeliverPolicy.NEW, None, None),
        Position("end", seq=7): (api.DeliverPolicy.BY_START_SEQUENCE, 7, None),
        Position("time", time=when): (api.DeliverPolicy.BY_START_TIME, None, when),
        Position("sequence", seq=42): (api.DeliverPolicy.BY_START_SEQUENCE, 42, None),
    }
    for position, (policy, seq, start) in cases.items():
        moved = position.apply(base)
        assert (moved.deliver_policy, moved.opt_start_seq, moved.opt_start_time) == (
            policy,
            seq,
            start,
        )
        # Everything else is the durable's own.
        assert moved.durable_name == "p3" and moved.filter_subject == base.filter_subject
        assert (moved.ack_wait, moved.max_deliver, moved.max_ack_pending) == (
            base.ack_wait,
            base.max_deliver,
            base.max_ack_pending,
        )
