"""Bad input never stops a group: garbage in etcd, bad messages, unreachable servers."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.fleet import Fleet, settled, wait_for_status
from harness.servers import free_port
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import read_ledger
from shoal.consumer.producer import Producer
from shoal.contracts.names import (
    DEAD_LETTER_REASON_HEADER,
    PROJECT_HEADER,
    Keys,
    dlq_subject,
    partition_for,
    partition_subject,
)
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture
def fleet(make_fleet: Callable[..., Fleet]) -> Fleet:
    return make_fleet(partitions=16, env={"SHOAL_LEASE_TTL": "5", "SHOAL_KEEPALIVE_INTERVAL": "1"})


@pytest.fixture
def make_config(make_config: Callable[..., GroupConfig]) -> Callable[..., GroupConfig]:
    """The config the fleet's members run with (16 partitions), plus overrides."""
    return functools.partial(make_config, partitions=16)


async def wait_for_log(fleet: Fleet, member: str, text: str, timeout: float) -> str:
    async def log() -> str:
        return fleet.members[member].log_text()

    return await eventually_async(
        log,
        timeout,
        f"{text!r} in the log of {member}",
        until=lambda log: text in log,
        describe=lambda log: "\n" + log[-3000:],
    )


async def stream_messages(js: Any, stream: str) -> int:
    return int((await js.stream_info(stream)).state.messages)


async def dead_letters(js: Any, stream: str, expected: int, timeout: float = 20) -> list[Any]:
    await eventually_async(
        lambda: stream_messages(js, stream),
        timeout,
        f"{expected} dead letters in {stream}",
        until=lambda n: n >= expected,
    )
    info = await js.stream_info(stream)
    return [
        await js.get_msg(stream, seq)
        for seq in range(info.state.first_seq, info.state.last_seq + 1)
    ]


async def processed(js: Any, ledger_stream: str, expected: int, timeout: float) -> None:
    await eventually_async(
        lambda: stream_messages(js, ledger_stream),
        timeout,
        f"{expected} messages processed (ledger records)",
        until=lambda n: n >= expected,
        interval=0.2,
    )


async def test_garbage_in_etcd_is_logged_and_ignored(
    fleet: Fleet, etcd: Etcd, group: str, namespace: str
) -> None:
    keys = Keys(namespace, group)
    await etcd.put(keys.member("ghost"), b"{not json")
    await etcd.put(keys.partition(3), b"\xff\xfe garbage")
    await etcd.put(keys.partition(5), json.dumps({"owner": 7}).encode())
    await etcd.put(keys.partitions + "not-a-number", b"{}")
    fleet.start("c-0")
    fleet.start("c-1")
    status = await wait_for_status(etcd, namespace, group, 16, settled({"c-0", "c-1"}), 30)
    assert "ghost" not in status.counts
    log = "".join(fleet.members[m].log_text() for m in ("c-0", "c-1"))
    assert "Ignored etcd key" in log
    assert "Traceback" not in log


async def test_garbage_that_broke_readers_is_ignored_too(
    fleet: Fleet,
    etcd: Etcd,
    js: Any,
    group: str,
    namespace: str,
    make_config: Callable[..., GroupConfig],
) -> None:
    """Values each of which, before, stopped the group without a word that said why:
    "²" passes str.isdigit but not int() (a claim or target key with it crashed every
    member's reconcile); JSON nested past Python's recursion limit raised RecursionError
    where parsers caught only ValueError (in a member's stats it crashed each leader in
    turn; in a hand-back record it killed the partition's runner before the code that
    lets a claim go, so the partition stayed claimed and consumed by nobody); a key that
    is not UTF-8 failed every listing of the group, so no member's view ever synced."""
    config = make_config()
    await ensure_group(js, config)
    keys = Keys(namespace, group)
    deep = b"[" * 5000 + b"]" * 5000
    producer = Producer(js, config.subject_prefix, 16)
    project_of = {
        p: next(f"x{i}" for i in range(1000) if partition_for(f"x{i}", 16) == p) for p in (7, 9)
    }
    await etcd.put(keys.member("deep"), deep)
    await etcd.put(keys.claims + "\u00b2", b"c-0")
    await etcd.put(keys.partitions + "\u00b2", b"{}")
    await etcd.put(keys.handback(7), b'{"\\u00b2": 1}')  # the JSON of {"²": 1}
    await etcd.put(keys.handback(9), deep)
    not_utf8 = keys.claims.encode() + b"\xff\xfe"
    await etcd.put(not_utf8, b"c-1")  # type: ignore[arg-type]  # bytes go through as they are
    fleet.start("c-0")
    fleet.start("c-1")
    await wait_for_status(etcd, namespace, group, 16, settled({"c-0", "c-1"}), 30)
    for p, project in project_of.items():
        await producer.publish(project, b"after garbage", message_id=f"g-{p}")
    await eventually_async(
        lambda: stream_messages(js, config.stream), 20, "both consumed", until=lambda n: n == 0
    )
    log = "".join(fleet.members[m].log_text() for m in ("c-0", "c-1"))
    assert "Ignored etcd key" in log
    assert "Traceback" not in log
    for m in ("c-0", "c-1"):
        assert fleet.members[m].alive(), f"{m} exited"


async def test_a_target_deleted_or_spoiled_is_written_again(
    fleet: Fleet, etcd: Etcd, group: str, namespace: str
) -> None:
    """Two members settled; partition 5's target deleted, partition 6's spoiled, while
    the membership stays as it is. Their owners let them go; the leader writes them
    again and the group settles with every partition claimed. (Before, the leader wrote
    targets only on a membership change or a stall: both stayed unowned for good, and
    the autoscaler held every decision for a "rebalance in progress".)"""
    keys = Keys(namespace, group)
    fleet.start("c-0")
    fleet.start("c-1")
    await wait_for_status(etcd, namespace, group, 16, settled({"c-0", "c-1"}), 30)
    await etcd.delete(keys.partition(5))
    await etcd.put(keys.partition(6), b"{not a target")
    status = await wait_for_status(etcd, namespace, group, 16, settled({"c-0", "c-1"}), 30)
    assert status.owners[5] in {"c-0", "c-1"} and status.owners[6] in {"c-0", "c-1"}
    log = "".join(fleet.members[m].log_text() for m in ("c-0", "c-1"))
    assert "have no target naming a member" in log
    # (Not its own write, seen before the view caught up with it: that wrote each
    # generation twice.)
    assert log.count("Wrote generation 1 (initial)") == 1, log


async def test_unreachable_etcd_is_retried_and_reported(fleet: Fleet) -> None:
    fleet.etcd_endpoint = f"127.0.0.1:{free_port()}"
    fleet.start("lonely")
    log = await wait_for_log(fleet, "lonely", "retrying", 20)
    assert "unreachable" in log and "Traceback" not in log
    fleet.term("lonely")
    assert fleet.wait_exit("lonely", 15) == 0


async def test_unreachable_nats_is_retried_and_reported(fleet: Fleet) -> None:
    fleet.nats_url = f"nats://127.0.0.1:{free_port()}"
    fleet.start("lonely")
    log = await wait_for_log(fleet, "lonely", "retrying", 20)
    assert "NATS" in log and "Traceback" not in log
    fleet.term("lonely")
    assert fleet.wait_exit("lonely", 15) == 0


async def test_bad_messages_go_to_the_dead_letter_subject(
    fleet: Fleet,
    etcd: Etcd,
    js: Any,
    group: str,
    namespace: str,
    make_config: Callable[..., GroupConfig],
) -> None:
    config = make_config()
    await ensure_group(js, config)
    fleet.start("c-0")
    await wait_for_status(etcd, namespace, group, 16, settled({"c-0"}), 30)
    p = partition_for("project-1", 16)
    # No project header at all, then a project that hashes to another partition.
    await js.publish(partition_subject(config.subject_prefix, p), b"anonymous")
    wrong = next(f"x{i}" for i in range(100) if partition_for(f"x{i}", 16) != p)
    await js.publish(
        partition_subject(config.subject_prefix, p),
        b"misrouted",
        headers={PROJECT_HEADER: wrong},
    )
    letters = await dead_letters(js, config.dlq_stream, 2)
    reasons = sorted(m.headers[DEAD_LETTER_REASON_HEADER] for m in letters)
    assert "missing Shoal-Project-Id header" in reasons[0]
    assert f"belongs to partition {partition_for(wrong, 16)}" in reasons[1]
    assert {m.subject for m in letters} == {dlq_subject(config.subject_prefix, p)}
    # The originals are terminated after their dead letter is stored: a work-queue stream
    # then drops them (the +TERM is applied asynchronously, so allow it a moment).
    await eventually_async(
        lambda: stream_messages(js, config.stream), 10, "the originals gone", until=lambda n: n == 0
    )


@pytest.mark.parametrize(
    ("handler", "reason"),
    [
        ("shoal.consumer.handlers:reject", "permanent error"),
        ("shoal.consumer.handlers:fail", "failed 2 times"),
    ],
)
async def test_failing_handlers_retry_then_dead_letter(
    fleet: Fleet,
    etcd: Etcd,
    js: Any,
    group: str,
    namespace: str,
    handler: str,
    reason: str,
    make_config: Callable[..., GroupConfig],
) -> None:
    config = make_config(max_deliver=2)
    await ensure_group(js, config)
    fleet.start("c-0", SHOAL_HANDLER=handler, SHOAL_MAX_DELIVER="2")
    await wait_for_status(etcd, namespace, group, 16, settled({"c-0"}), 30)
    producer = Producer(js, config.subject_prefix, 16)
    await producer.publish("project-9", b"payload", message_id="m-1")
    [letter] = await dead_letters(js, config.dlq_stream, 1)
    assert reason in letter.headers[DEAD_LETTER_REASON_HEADER]
    assert letter.headers[PROJECT_HEADER] == "project-9"
    assert letter.data == b"payload"
    # The original is acked or terminated after its dead letter is stored, and the server
    # applies that asynchronously: the work-queue stream drops it a moment later.
    await eventually_async(
        lambda: stream_messages(js, config.stream), 10, "the original gone", until=lambda n: n == 0
    )


async def test_metrics_endpoint(fleet: Fleet, etcd: Etcd, group: str, namespace: str) -> None:
    port = free_port()
    fleet.start("c-0", SHOAL_METRICS_PORT=str(port))
    await wait_for_status(etcd, namespace, group, 16, settled({"c-0"}), 30)

    async def metrics() -> str:
        body: bytes = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
        )
        return body.decode()

    text = await eventually_async(
        metrics,
        10,
        "16 partitions owned in the metrics",
        until=lambda text: "shoal_partitions_owned 16.0" in text,
        interval=0.2,
        describe=lambda text: repr(
            [line for line in text.splitlines() if line.startswith("shoal_partitions_owned")]
        ),
    )
    assert "shoal_is_leader 1.0" in text
    assert "shoal_rebalances_total 1.0" in text
    assert "shoal_handover_seconds_bucket" in text


async def test_a_handler_slower_than_ack_wait_is_not_redelivered(
    fleet: Fleet,
    etcd: Etcd,
    js: Any,
    group: str,
    namespace: str,
    make_config: Callable[..., GroupConfig],
) -> None:
    # 2.5 s of work against a 1 s ack_wait: only in-progress acks keep the message ours.
    config = make_config(ack_wait=1.0)
    await ensure_group(js, config)
    fleet.start("c-0", SHOAL_HANDLER_DELAY_MS="2500", SHOAL_ACK_WAIT="1")
    await wait_for_status(etcd, namespace, group, 16, settled({"c-0"}), 30)
    producer = Producer(js, config.subject_prefix, 16)
    for i in range(3):
        await producer.publish(f"project-{i}", b"slow", message_id=f"slow-{i}")
    await processed(js, config.ledger_stream, 3, timeout=30)
    records = await read_ledger(js, config.ledger_stream)
    assert sorted(r.message_id for r in records) == ["slow-0", "slow-1", "slow-2"]
    assert {r.delivery_count for r in records} == {1}
    assert all(r.finished - r.started >= 2.4 for r in records)


async def test_cli_produce_and_status_on_a_live_group(
    fleet: Fleet,
    etcd: Etcd,
    js: Any,
    group: str,
    namespace: str,
    nats_url: str,
    etcd_endpoint: str,
    make_config: Callable[..., GroupConfig],
) -> None:
    config = make_config()
    await ensure_group(js, config)
    fleet.start("c-0")
    fleet.start("c-1")
    await wait_for_status(etcd, namespace, group, 16, settled({"c-0", "c-1"}), 30)
    env = {**os.environ, "NATS_URL": nats_url, "ETCD_ENDPOINTS": etcd_endpoint}
    base = [sys.executable, "-m", "shoal.consumer"]
    produced = await asyncio.to_thread(
        subprocess.run,
        [
            *base,
            "produce",
            "-g",
            group,
            "-n",
            namespace,
            "-p",
            "16",
            "--projects",
            "50",
            "--messages",
            "500",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert produced.returncode == 0, produced.stderr
    assert json.loads(produced.stdout.strip().splitlines()[-1])["published"] == 500
    shown = await asyncio.to_thread(
        subprocess.run,
        # No -p: the partitions the group's targets name (before, the option's default
        # 128 made 112 of them "unowned").
        [*base, "status", "-g", group, "-n", namespace, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert set(status["members"]) == {"c-0", "c-1"}
    assert status["counts"] == {"c-0": 8, "c-1": 8}
    assert status["skew"] == 0 and status["unowned"] == []
    assert status["leader"] in {"c-0", "c-1"}
    misspelt = await asyncio.to_thread(
        subprocess.run,
        [*base, "status", "-g", group + "x", "-n", namespace],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert misspelt.returncode == 0, misspelt.stderr  # scripts poll groups not started yet
    assert f"not one key under /shoal/{namespace}/{group}x/" in misspelt.stderr, misspelt


async def test_status_of_a_group_only_a_refused_member_knows(
    etcd: Etcd, etcd_endpoint: str, group: str, namespace: str
) -> None:
    """A member NATS refuses never joins: its problems/ key is all the group has. That
    group is there (exit 0, the reason shown), not a misspelt one."""
    keys = Keys(namespace, group)
    problem = {"reason": "NatsAuthFailed", "message": "authorization violation", "since": 1.0}
    lease = await etcd.grant_lease(30)
    try:
        await etcd.put(keys.problem("m-1"), json.dumps(problem).encode(), lease)
        base = [sys.executable, "-m", "shoal.consumer", "status", "-n", namespace]
        shown = await asyncio.to_thread(
            subprocess.run,
            [*base, "-g", group, "--etcd", etcd_endpoint],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, shown.stderr
        assert "cannot connect to NATS" in shown.stdout and "NatsAuthFailed" in shown.stdout
    finally:
        await etcd.revoke_lease(lease)


async def test_ready_file_tracks_membership(
    fleet: Fleet, etcd: Etcd, group: str, namespace: str, tmp_path: Path
) -> None:
    ready_file = tmp_path / "c-0" / "ready"
    command = [sys.executable, "-m", "shoal.consumer", "ready", "--file", str(ready_file)]
    before = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True)
    assert before.returncode == 1 and "not ready" in before.stderr
    fleet.start("c-0", SHOAL_READY_FILE=str(ready_file))
    await wait_for_status(etcd, namespace, group, 16, settled({"c-0"}), 30)
    after = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True)
    assert after.returncode == 0, after.stderr
    assert "c-0" in after.stdout
    fleet.term("c-0")
    assert fleet.wait_exit("c-0", 30) == 0
    assert not ready_file.exists()


async def test_a_message_jetstream_gave_up_on_is_dead_lettered(
    fleet: Fleet,
    etcd: Etcd,
    js: Any,
    group: str,
    namespace: str,
    make_config: Callable[..., GroupConfig],
) -> None:
    """Its only delivery dies with its member (kill -9 mid-handler, max_deliver 1): the
    next owner gets it again with every attempt made, and dead-letters it without
    running it. (The durables' own limit is off, so that hand-overs use no attempts:
    the members count them. Durables JetStream does limit, made by hand say, are covered
    by the leader's max-deliveries listener, deadletter.ExhaustedMessages.)"""
    config = make_config(max_deliver=1, ack_wait=1.0)
    await ensure_group(js, config)
    env = {"SHOAL_MAX_DELIVER": "1", "SHOAL_ACK_WAIT": "1", "SHOAL_HANDLER_DELAY_MS": "60000"}
    fleet.start("leader", **env)
    await wait_for_status(etcd, namespace, group, 16, settled({"leader"}), 30)
    fleet.start("doomed", **env)
    status = await wait_for_status(etcd, namespace, group, 16, settled({"leader", "doomed"}), 30)
    assert status.leader == "leader"
    project = next(
        f"p{i}" for i in range(1000) if status.owners[partition_for(f"p{i}", 16)] == "doomed"
    )
    await Producer(js, config.subject_prefix, 16).publish(project, b"stuck", message_id="s-1")
    durable = f"p{partition_for(project, 16)}"

    async def ack_pending() -> int:
        return int((await js.consumer_info(config.stream, durable)).num_ack_pending)

    await eventually_async(ack_pending, 10, f"the message to be delivered ({durable})")
    fleet.kill("doomed")
    [letter] = await dead_letters(js, config.dlq_stream, 1, timeout=30)
    reason = letter.headers[DEAD_LETTER_REASON_HEADER]
    assert "delivered 1 times without an answer (maxDeliver 1)" in reason, reason
    assert letter.headers[PROJECT_HEADER] == project
    assert letter.data == b"stuck"
    await eventually_async(
        lambda: stream_messages(js, config.stream), 10, "the original gone", until=lambda n: n == 0
    )
