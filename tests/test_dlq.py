"""`shoal-consumer dlq` (list, show, redrive, purge) on a real nats-server, as users run it.

1. A real member dead-letters the messages of chosen projects (scripted_ledger's
   ``permanent-runs:1``: PermanentError on the first run); list, show and the filters see
   them; a redrive moves them back and the same member processes them, each project in
   order, nothing lost or twice (the ledger's audit).
2. Dead letters written as a member writes them (dead_letter_headers), by the thousand:
   the filters and --json; a redrive stopped after N (the hidden --stop-after, which
   stops as Ctrl-C does) or killed with SIGKILL mid-way, run again, moves each once, in
   per-project order; a republish whose delete failed is not published twice.
3. purge, with and without --yes; bad input: an unknown group, a group without its
   dead-letter stream, a --since that is no time.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from nats.js import api

from harness.fleet import Fleet, settled, wait_for_status
from harness.servers import NatsServer, _http_get
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.deadletter import dead_letter_headers
from shoal.consumer.ledger import audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import (
    MSG_ID_HEADER,
    ORIGINAL_MSG_ID_HEADER,
    PROJECT_HEADER,
    REDRIVEN_FROM_HEADER,
    SEQ_HEADER,
    dlq_subject,
    partition_for,
    partition_subject,
)
from shoal.group import deadletters
from shoal.group.config import GroupConfig, config_env
from shoal.group.deadletters import Redrive, dead_letter_count
from shoal.group.jetstream import delete_message, ensure_group

PARTITIONS = 8
HANDLER = "harness.handlers:scripted_ledger"


def dlq(
    config: GroupConfig, command: str, *args: str, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """`shoal-consumer dlq <command>` for the config's group, as a user runs it."""
    where = ["-g", config.group, "-n", config.namespace, "--nats", config.nats_url]
    return subprocess.run(
        [sys.executable, "-m", "shoal.consumer", "dlq", command, *where, *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=120,
    )


def start_redrive(config: GroupConfig) -> subprocess.Popen[bytes]:
    where = ["-g", config.group, "-n", config.namespace, "--nats", config.nats_url]
    return subprocess.Popen(
        [sys.executable, "-m", "shoal.consumer", "dlq", "redrive", *where],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def ok(done: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    return done


def json_of(done: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(ok(done).stdout)


async def write_dead_letters(
    js: Any, config: GroupConfig, items: list[tuple[str, int]], reason: str = "permanent error: x"
) -> None:
    """Dead letters as a member writes them: (project, its seq) each, data b"<project>:<seq>",
    in this order."""
    prefix = config.subject_prefix
    for start in range(0, len(items), 500):
        publishes = []
        for project, seq in items[start : start + 500]:
            p = partition_for(project, config.partitions)
            original = {
                PROJECT_HEADER: project,
                MSG_ID_HEADER: f"{project}-{seq}",
                SEQ_HEADER: str(seq),
            }
            headers = dead_letter_headers(original, partition_subject(prefix, p), reason, "m-0")
            data = f"{project}:{seq}".encode()
            publishes.append(js.publish(dlq_subject(prefix, p), data, headers=headers))
        await asyncio.gather(*publishes)  # sent in order on one connection: stored in order


async def partition_messages(js: Any, config: GroupConfig) -> list[Any]:
    """Every message of the group's partition stream, in stream order."""
    info = await js.stream_info(config.stream)
    total = int(info.state.messages)
    if not total:
        return []
    sub = await js.pull_subscribe(
        f"{config.subject_prefix}.*",
        stream=config.stream,
        config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, mem_storage=True),
    )
    out: list[Any] = []
    try:
        while len(out) < total:
            out.extend(await sub.fetch(min(1000, total - len(out)), timeout=5))
    finally:
        await sub.unsubscribe()
    return out


def check_moved_once_in_order(
    messages: list[Any], items: list[tuple[str, int]], config: GroupConfig
) -> None:
    """Each dead letter of `items` is in the partition stream once, on its partition, with
    its original data and headers plus the redrive's, and each project's in their order."""
    ids = [m.headers[ORIGINAL_MSG_ID_HEADER] for m in messages]
    assert len(ids) == len(set(ids)), "a dead letter was redriven twice"
    assert sorted(ids) == sorted(f"{p}-{s}" for p, s in items)
    seqs: dict[str, list[int]] = defaultdict(list)
    for m in messages:
        project = m.headers[PROJECT_HEADER]
        partition = partition_for(project, config.partitions)
        assert m.subject == partition_subject(config.subject_prefix, partition)
        assert m.data == f"{project}:{m.headers[SEQ_HEADER]}".encode()
        source = m.headers[REDRIVEN_FROM_HEADER]
        assert m.headers[MSG_ID_HEADER] == f"redrive-{config.dlq_stream}-{source}"
        assert "Shoal-Dead-Letter-Reason" not in m.headers
        seqs[project].append(int(m.headers[SEQ_HEADER]))
    for project, got in seqs.items():
        assert got == sorted(got), (project, got)


@pytest.fixture
async def members_config(make_config: Callable[..., GroupConfig], js: Any) -> GroupConfig:
    """A group for members (a work-queue stream, as by default)."""
    config = make_config(partitions=PARTITIONS, handler=HANDLER, max_deliver=3, backoff=(0.2,))
    await ensure_group(js, config)
    return config


@pytest.fixture
async def config(make_config: Callable[..., GroupConfig], js: Any) -> GroupConfig:
    """A group without members: its partition stream keeps what is redriven to it
    (limits retention, so that the test may read it with a consumer of its own)."""
    config = make_config(partitions=PARTITIONS, retention="limits")
    await ensure_group(js, config)
    return config


# -- 1. the real path ------------------------------------------------------------------------------


async def test_a_members_dead_letters_listed_shown_redriven_and_processed_in_order(
    make_fleet: Callable[..., Fleet],
    etcd: Etcd,
    js: Any,
    members_config: GroupConfig,
    tmp_path: Path,
) -> None:
    config = members_config
    state = tmp_path / "state"
    state.mkdir()
    fleet = make_fleet(
        handler=HANDLER, partitions=PARTITIONS, env={"SHOAL_TEST_STATE_DIR": str(state)}
    )
    fleet.start("m-0", **config_env(config, ("max_deliver", "backoff")))
    await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 30)

    bad = [f"bad-{i}" for i in range(3)]
    good = [f"good-{i}" for i in range(4)]
    items = [
        Outgoing(p, b"permanent-runs:1" if p in bad else b"ok", f"{p}-{s}", {SEQ_HEADER: str(s)})
        for s in range(10)
        for p in bad + good
    ]
    await Producer(js, config.subject_prefix, PARTITIONS).publish_many(items)
    await eventually_async(
        lambda: dead_letter_count(js, config), 30, "30 dead letters", until=lambda n: n == 30
    )

    listed = json_of(dlq(config, "list", "--json"))
    assert listed["stream"] == config.dlq_stream
    assert listed["count"] == 30
    assert listed["by_reason"] == [{"reason": "permanent error", "count": 30}]
    assert listed["by_project"] == [{"project": p, "count": 10} for p in bad]
    assert listed["oldest"]["seq"] < listed["newest"]["seq"]
    table = ok(dlq(config, "list")).stdout
    assert "30 dead letters" in table and "permanent error" in table, table
    assert "'bad-0'" in table and "oldest: #" in table, table

    shown = json_of(dlq(config, "show", "--project", "bad-1", "--json"))
    assert not shown["more"]
    letters = shown["messages"]
    assert [m["headers"][SEQ_HEADER] for m in letters] == [str(s) for s in range(10)]
    first = letters[0]
    assert first["project"] == "bad-1" and first["data"] == "permanent-runs:1"
    assert first["reason"].startswith("permanent error: run 1 of bad-1-0")
    assert first["headers"][ORIGINAL_MSG_ID_HEADER] == "bad-1-0"
    assert first["headers"]["Shoal-Member"] == "m-0"
    assert first["partition"] == partition_for("bad-1", PARTITIONS)
    assert first["headers"]["Shoal-Original-Subject"] == partition_subject(
        config.subject_prefix, first["partition"]
    )
    text = ok(dlq(config, "show", "--limit", "2")).stdout
    assert text.count("reason: permanent error") == 2 and "(the first 2; --limit" in text, text

    # Redriven: the member runs them again (their second run succeeds), in order.
    moved = json_of(dlq(config, "redrive", "--json"))
    assert (moved["selected"], moved["moved"], moved["failed"], moved["stopped"]) == (
        30,
        30,
        [],
        False,
    )
    assert await dead_letter_count(js, config) == 0
    expected = [item.message_id or "" for item in items]
    records = await eventually_async(
        lambda: read_ledger(js, config.ledger_stream),
        30,
        "every message processed",
        until=lambda records: len(records) >= len(items),
        describe=lambda records: f"{len(records)} records",
    )
    result = audit(records, expected)
    assert result.summary() == {
        "expected": 70,
        "processed": 70,
        "lost": 0,
        "duplicates": 0,
        "out_of_order": 0,
        "overlaps": 0,
    }
    for project in bad:  # processed after the good ones' and after each other's, in order
        mine = [r.seq for r in records if r.project_id == project]
        assert mine == list(range(10)), (project, mine)
    # Nothing is dead-lettered again: the second runs succeeded.
    await asyncio.sleep(0.5)
    assert await dead_letter_count(js, config) == 0


# -- 2. many dead letters, written as a member writes them -----------------------------------


async def test_filters_and_json_of_list_and_show(js: Any, config: GroupConfig) -> None:
    await write_dead_letters(js, config, [("a", s) for s in range(3)], "permanent error: A")
    await asyncio.sleep(1.1)
    await write_dead_letters(js, config, [("b", s) for s in range(2)], "failed 5 times, last: E()")
    await write_dead_letters(js, config, [("a", 3)], "failed 5 times, last: E()")

    everything = json_of(dlq(config, "list", "--json"))
    assert everything["count"] == 6
    assert everything["by_reason"] == [
        {"reason": "failed 5 times, last: E", "count": 3},
        {"reason": "permanent error", "count": 3},
    ]
    assert everything["by_project"] == [{"project": "a", "count": 4}, {"project": "b", "count": 2}]
    assert everything["bytes"] == sum(len(f"{p}:{s}") for p, s in [("a", 0)] * 4 + [("b", 0)] * 2)

    def shown(*args: str) -> list[str]:
        out = json_of(dlq(config, "show", "--json", *args))["messages"]
        return [m["headers"][ORIGINAL_MSG_ID_HEADER] for m in out]

    assert shown() == ["a-0", "a-1", "a-2", "b-0", "b-1", "a-3"]
    assert shown("--project", "a") == ["a-0", "a-1", "a-2", "a-3"]
    assert shown("--reason", "FAILED 5") == ["b-0", "b-1", "a-3"]
    assert shown("--project", "a", "--reason", "failed") == ["a-3"]
    assert shown("--since", "1h") == shown()
    assert shown("--since", "2099-01-01") == []
    newest = json_of(dlq(config, "list", "--json"))["newest"]["time"]
    assert shown("--since", newest) == ["b-0", "b-1", "a-3"]  # whole seconds: 1.1 s apart
    limited = json_of(dlq(config, "show", "--json", "--limit", "2"))
    assert limited["more"] and len(limited["messages"]) == 2
    assert json_of(dlq(config, "list", "--json", "--project", "b"))["count"] == 2
    assert "no dead letters of project 'c'" in ok(dlq(config, "show", "--project", "c")).stdout
    assert "no dead letters" in ok(dlq(config, "list", "--project", "c")).stdout


async def test_a_redrive_stopped_midway_and_run_again_moves_each_once_in_order(
    js: Any, config: GroupConfig
) -> None:
    items = [(f"p-{i % 40}", i // 40) for i in range(2000)]
    await write_dead_letters(js, config, items)

    first = dlq(config, "redrive", "--json", "--stop-after", "300")
    assert first.returncode == 130, first.stderr
    assert "run it again to move the rest" in first.stderr
    stopped = json.loads(first.stdout)
    assert stopped["stopped"] and 300 <= stopped["moved"] < 2000, stopped
    left = await dead_letter_count(js, config)
    assert left == 2000 - stopped["moved"]
    assert len(await partition_messages(js, config)) == stopped["moved"]

    again = json_of(dlq(config, "redrive", "--json"))
    assert (again["selected"], again["moved"], again["stopped"]) == (left, left, False)
    assert await dead_letter_count(js, config) == 0
    check_moved_once_in_order(await partition_messages(js, config), items, config)
    # And a third run has nothing to do.
    assert json_of(dlq(config, "redrive", "--json"))["moved"] == 0


async def test_a_redrive_killed_midway_and_run_again_duplicates_nothing(
    js: Any, config: GroupConfig
) -> None:
    items = [(f"p-{i % 50}", i // 50) for i in range(10000)]
    await write_dead_letters(js, config, items)
    process = start_redrive(config)
    try:
        await eventually_async(
            lambda: js.stream_info(config.stream),
            60,
            "the redrive under way",
            until=lambda info: info.state.messages >= 1000,
            interval=0.05,
        )
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    left = await dead_letter_count(js, config)
    assert left is not None and 0 < left < 10000, left
    moved_before = len(await partition_messages(js, config))
    # Killed between a publish and its delete, some are in both places: the run again
    # publishes them again, and JetStream drops those publishes (the same Nats-Msg-Id).
    assert 10000 - left <= moved_before <= 10000 - left + 64
    again = json_of(dlq(config, "redrive", "--json"))
    assert again["moved"] == left and not again["failed"]
    assert again["duplicates"] == moved_before - (10000 - left)
    check_moved_once_in_order(await partition_messages(js, config), items, config)


async def test_a_republish_whose_delete_failed_is_not_published_twice(
    js: Any, config: GroupConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = [(f"p-{i % 3}", i // 3) for i in range(30)]
    await write_dead_letters(js, config, items)
    real_delete = delete_message

    async def failing(nc: Any, api_prefix: str, stream: str, seq: int, **kw: Any) -> None:
        if seq % 4 == 0:
            raise TimeoutError("the delete timed out")
        await real_delete(nc, api_prefix, stream, seq, **kw)

    monkeypatch.setattr(deadletters, "delete_message", failing)
    nc = js._nc
    first = await Redrive(nc, js, config, retry_delay=0.01).run()
    assert first.moved == 30 and len(first.failed) == 7  # seqs 4, 8, ..., 28
    assert all("republished to" in why and "not deleted" in why for _, why in first.failed)
    assert first.held_back == 0  # republished in order: their projects went on
    assert await dead_letter_count(js, config) == 7

    monkeypatch.setattr(deadletters, "delete_message", delete_message)
    second = await Redrive(nc, js, config).run()
    assert (second.moved, second.duplicates, second.failed) == (7, 7, [])
    assert await dead_letter_count(js, config) == 0
    check_moved_once_in_order(await partition_messages(js, config), items, config)


async def test_a_project_whose_republish_fails_keeps_its_later_dead_letters(
    js: Any, config: GroupConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = [(p, s) for s in range(5) for p in ("stuck", "fine")]
    await write_dead_letters(js, config, items)
    real_publish = js.publish

    async def publish(subject: str, data: bytes, **kw: Any) -> Any:
        if data == b"stuck:2":
            raise TimeoutError("no answer")
        return await real_publish(subject, data, **kw)

    monkeypatch.setattr(js, "publish", publish)
    result = await Redrive(js._nc, js, config, retry_delay=0.01).run()
    assert result.moved == 5 + 2  # fine's five, stuck's first two
    assert [seq for seq, _ in result.failed] == [5]  # stuck:2, the fifth dead letter
    assert result.held_back == 2
    left = json_of(dlq(config, "show", "--json"))["messages"]
    assert [m["data"] for m in left] == ["stuck:2", "stuck:3", "stuck:4"]


# -- 3. purge and bad input ---------------------------------------------------------------------


async def test_purge_asks_first_and_deletes_only_what_was_counted(
    js: Any, config: GroupConfig
) -> None:
    await write_dead_letters(js, config, [(p, s) for s in range(3) for p in ("a", "b", "c")])

    refused = dlq(config, "purge", stdin="n\n")
    assert refused.returncode == 1 and "Aborted" in refused.stderr, refused
    assert "Delete 9 dead letters of group" in refused.stdout
    assert await dead_letter_count(js, config) == 9
    no_answer = dlq(config, "purge")  # no terminal, no --yes: nothing deleted
    assert no_answer.returncode == 1
    assert await dead_letter_count(js, config) == 9

    one = ok(dlq(config, "purge", "--project", "b", stdin="y\n"))
    assert "Delete 3 dead letters of project 'b'" in one.stdout
    assert "purged 3 dead letters of project 'b'" in one.stdout
    assert json_of(dlq(config, "list", "--json"))["by_project"] == [
        {"project": "a", "count": 3},
        {"project": "c", "count": 3},
    ]
    assert "purged 2 dead letters" in ok(dlq(config, "purge", "--limit", "2", "--yes")).stdout
    rest = ok(dlq(config, "purge", "--yes"))
    assert "purged 4 dead letters" in rest.stdout and "Delete" not in rest.stdout
    assert await dead_letter_count(js, config) == 0
    assert "nothing to purge" in ok(dlq(config, "purge", "--yes")).stdout


async def test_bad_input_is_one_clear_line(js: Any, config: GroupConfig) -> None:
    unknown = config.model_copy(update={"group": "nosuchgroup", "stream": "shoal_test_nosuchgroup"})
    for command in ("list", "show", "redrive", "purge"):
        done = dlq(unknown, command, "--yes") if command == "purge" else dlq(unknown, command)
        assert done.returncode == 1, done
        assert "Error: unknown group test/nosuchgroup: no stream shoal_test_nosuchgroup" in (
            done.stderr
        ), done.stderr
        assert "Traceback" not in done.stderr

    await js.delete_stream(config.dlq_stream)
    done = dlq(config, "redrive")
    assert done.returncode == 1
    assert (
        f"Error: group test/{config.group} has no dead letters stream: {config.dlq_stream} "
        "does not exist"
    ) in done.stderr, done.stderr
    assert await dead_letter_count(js, config) is None

    since = dlq(config, "show", "--since", "last tuesday")
    assert since.returncode == 2
    assert "Invalid value for '--since': 'last tuesday': expected an RFC 3339 time" in (
        since.stderr
    ), since.stderr


def test_an_unreachable_nats_is_one_clear_line() -> None:
    command = [sys.executable, "-m", "shoal.consumer", "dlq", "list", "-g", "x"]
    done = subprocess.run(
        [*command, "--nats", "nats://127.0.0.1:1"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "unreachable" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


async def test_a_read_nats_stops_answering_in_is_an_error_not_a_short_list(
    nats_url: str, config: GroupConfig
) -> None:
    """Before: a fetch that timed out was taken for "nothing more", so a brief NATS
    outage cut `dlq list` (and what redrive and purge count) short without a word."""
    from harness.proxy import TcpProxy
    from shoal.clients.nats import connect

    direct = await connect(nats_url, name="dlq-fill", attempts=5)
    try:
        js = direct.jetstream()
        await ensure_group(js, config)
        for i in range(30):
            await js.publish(dlq_subject(config.subject_prefix, 0), f"d{i}".encode())
    finally:
        await direct.close()
    with TcpProxy(nats_url.removeprefix("nats://"), name="nats") as proxy:
        nc = await connect(f"nats://{proxy.address}", name="dlq-read", attempts=5)
        try:
            got: list[int] = []
            with pytest.raises(deadletters.DeadLetterError, match="incomplete"):
                async for letters in deadletters.read(
                    nc.jetstream(), config, batch=10, fetch_timeout=0.5
                ):
                    got += [letter.seq for letter in letters]
                    proxy.blackhole()
            assert got == list(range(1, 11))
        finally:
            proxy.pass_through()
            await nc.close()


class _NatsWithoutJetStream(NatsServer):
    """A nats-server with JetStream off (a core NATS deployment)."""

    def _command(self) -> list[str]:
        return [c for c in super()._command() if c != "-js"]

    def _is_ready(self) -> bool:
        try:
            status, _ = _http_get(f"{self.monitor_url}/healthz")
        except (OSError, ValueError):
            return False
        return bool(status == 200)


def test_a_server_without_jetstream_is_one_clear_line(tmp_path: Path) -> None:
    """Before: a traceback (ServiceUnavailableError, an APIError)."""
    server = _NatsWithoutJetStream(tmp_path / "core").start()
    try:
        command = [sys.executable, "-m", "shoal.consumer", "dlq", "list", "-g", "x"]
        done = subprocess.run(
            [*command, "--nats", server.url], capture_output=True, text=True, timeout=60
        )
    finally:
        server.stop()
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and "JetStream" in last, last


def test_help_has_an_example_of_each_command() -> None:
    for command in ("list", "show", "redrive", "purge"):
        done = subprocess.run(
            [sys.executable, "-m", "shoal.consumer", "dlq", command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert f"shoal-consumer dlq {command} -g orders" in done.stdout, done.stdout
        assert "--stop-after" not in done.stdout


async def test_redrive_rate(js: Any, config: GroupConfig) -> None:
    """The figure the README gives: 10,000 dead letters of 100 projects, redriven by the
    command (a fresh process, as users run it)."""
    items = [(f"p-{i % 100}", i // 100) for i in range(10000)]
    await write_dead_letters(js, config, items)
    started = time.monotonic()
    result = json_of(dlq(config, "redrive", "--json"))
    wall = time.monotonic() - started
    assert result["moved"] == 10000
    print(
        json.dumps(
            {
                "redrive_per_second": result["per_second"],
                "seconds": result["seconds"],
                "wall_seconds": round(wall, 2),
            }
        )
    )
