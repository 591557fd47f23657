"""`shoal-consumer produce --stdin`: `project_id<TAB>data` lines, published as the
Producer publishes, against a real nats-server; and the line parsing on its own."""

from __future__ import annotations

import base64
import io
import json
import signal
import subprocess
import sys
import time
import unicodedata
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from shoal.clients.natsclient import parse_headers
from shoal.consumer.producer import LineError, Producer, parse_line, read_lines
from shoal.contracts.names import (
    MSG_ID_HEADER,
    PROJECT_HEADER,
    SEQ_HEADER,
    partition_for,
    partition_subject,
)
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group

PARTITIONS = 7
e2e = pytest.mark.e2e


def produce(config: GroupConfig, data: bytes, *args: str) -> subprocess.CompletedProcess[bytes]:
    command = [sys.executable, "-m", "shoal.consumer", "produce", "--stdin"]
    command += ["-g", config.group, "-n", config.namespace, "--nats", config.nats_url]
    command += ["-p", str(config.partitions), *args]
    return subprocess.run(command, input=data, capture_output=True, timeout=60)


async def stream_messages(js: Any, stream: str) -> list[Any]:
    info = await js.stream_info(stream)
    if not info.state.messages:
        return []
    first, last = info.state.first_seq, info.state.last_seq
    return [await js.get_msg(stream, seq) for seq in range(first, last + 1)]


def headers(msg: Any) -> dict[str, str]:
    """A stored message's headers as a member reads them (nats-py's get_msg parses them
    as e-mail headers, which turns non-ASCII values into objects)."""
    return parse_headers(base64.b64decode(msg.hdrs))


def lines_of(messages: list[tuple[str, bytes]]) -> bytes:
    return b"".join(p.encode() + b"\t" + d + b"\n" for p, d in messages)


@pytest.fixture
async def config(make_config: Callable[..., GroupConfig], js: Any) -> GroupConfig:
    config = make_config(partitions=PARTITIONS, ledger=False)
    await ensure_group(js, config)
    return config


@e2e
async def test_lines_go_to_their_partitions_with_the_producers_headers_in_order(
    config: GroupConfig, js: Any
) -> None:
    projects = ["p-0", "p-1", "café", unicodedata.normalize("NFD", "café"), "项目", "🚀", "a"]
    projects += [f"bulk-{k}" for k in range(40)]
    sent = [(projects[i % len(projects)], f"{i}\tdata é {i}".encode()) for i in range(1500)]
    # CRLF line ends, empty lines, and a last line without its line end are fine too.
    text = lines_of(sent[:-2]) + b"\r\n\n" + lines_of(sent[-2:-1]).replace(b"\n", b"\r\n")
    text += lines_of(sent[-1:]).rstrip(b"\n")

    result = produce(config, text, "--run-id", "r1", "--window", "16")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == b""
    summary = json.loads(result.stderr.decode().strip().splitlines()[-1])
    assert summary["published"] == 1500 and summary["seconds"] >= 0

    got = await stream_messages(js, config.stream)
    assert len(got) == 1500
    by_project: dict[str, list[Any]] = defaultdict(list)
    for msg in got:
        project = headers(msg)[PROJECT_HEADER]
        assert msg.subject == partition_subject(
            config.subject_prefix, partition_for(project, PARTITIONS)
        )
        by_project[project].append(msg)
    assert set(by_project) == set(projects)  # NFC and NFD stayed two projects
    for project in projects:
        mine = [data for p, data in sent if p == project]
        msgs = by_project[project]
        assert [m.data for m in msgs] == mine  # the order of the lines, TABs kept
        assert [headers(m)[SEQ_HEADER] for m in msgs] == [str(n) for n in range(len(mine))]
        assert [headers(m)[MSG_ID_HEADER] for m in msgs] == [
            f"r1-{project}-{n}" for n in range(len(mine))
        ]

    # The same input with the same run id again: JetStream drops every one as a duplicate.
    again = produce(config, text, "--run-id", "r1")
    assert again.returncode == 0, again.stderr.decode()
    assert len(await stream_messages(js, config.stream)) == 1500


@e2e
async def test_a_line_without_a_tab_is_named_and_the_lines_before_it_are_kept(
    config: GroupConfig, js: Any
) -> None:
    before = [(f"p-{i % 3}", f"m{i}".encode()) for i in range(300)]
    text = lines_of(before) + b"\n" + b"no tab here\n" + lines_of([("p-0", b"after")])
    result = produce(config, text, "--run-id", "r2", "--window", "8")

    assert result.returncode == 1
    err = result.stderr.decode()
    assert "line 302: no TAB: expected project_id<TAB>data" in err, err
    assert "Traceback" not in err
    assert json.loads(err.strip().splitlines()[0])["published"] == 300
    got = await stream_messages(js, config.stream)
    assert [(headers(m)[PROJECT_HEADER], m.data) for m in got] == before


@e2e
async def test_an_id_a_header_cannot_carry_publishes_nothing_after_it(
    config: GroupConfig, js: Any
) -> None:
    result = produce(config, b"ok\tfirst\n padded\tx\nok\tnever\n")
    assert result.returncode == 1
    assert "line 2: the project id starts or ends with whitespace" in result.stderr.decode()
    assert [m.data for m in await stream_messages(js, config.stream)] == [b"first"]


def test_test_traffic_options_are_refused_with_stdin() -> None:
    command = [sys.executable, "-m", "shoal.consumer", "produce", "--stdin", "-g", "g"]
    result = subprocess.run([*command, "-m", "5"], capture_output=True, input=b"", timeout=60)
    assert result.returncode == 2 and b"--messages makes no sense with --stdin" in result.stderr


def test_help_explains_stdin() -> None:
    command = [sys.executable, "-m", "shoal.consumer", "produce", "--help"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    for words in ("--stdin", "project_id<TAB>data", "Shoal-Project-Id", "Nats-Msg-Id"):
        assert words in out


def test_parse_line() -> None:
    assert parse_line(b"", 1) is None
    assert parse_line(b"p\t", 1) == ("p", b"")
    assert parse_line(b"p\ta\tb c", 1) == ("p", b"a\tb c")
    assert parse_line("項目\tdé".encode(), 1) == ("項目", "dé".encode())
    assert parse_line(b"p\t\xff", 1) == ("p", b"\xff")  # data is bytes, not checked
    for line, problem in [
        (b"no tab", "line 9: no TAB: expected project_id<TAB>data"),
        (b"\tdata", "line 9: the project id is empty"),
        (b"\xffp\tdata", "line 9: the project id is not UTF-8"),
        (b" p\tdata", "line 9: the project id starts or ends with whitespace"),
        (b"p \tdata", "line 9: the project id starts or ends with whitespace"),
        ("p\u00a0\tdata".encode(), "line 9: the project id starts or ends with whitespace"),
        (b"p\rq\tdata", "line 9: the project id contains CR or LF"),
    ]:
        with pytest.raises(LineError, match="^" + problem) as caught:
            parse_line(line, 9)
        assert caught.value.number == 9


async def test_read_lines_splits_chunks_into_lines() -> None:
    stream = io.BytesIO(b"a\tb\r\n\nccc\tdddd\neee")
    got = [item async for item in read_lines(stream, chunk=3)]
    assert got == [(1, b"a\tb"), (2, b""), (3, b"ccc\tdddd"), (4, b"eee")]
    assert [item async for item in read_lines(io.BytesIO(b""))] == []


async def test_a_byte_order_mark_is_no_part_of_the_first_project_id() -> None:
    """Before: the first line of a file an editor saved with a BOM went to another
    partition, under another id ("\ufefforder-42"), out of order with its project."""
    stream = io.BytesIO(b"\xef\xbb\xbforder-42\tx\r\n\xef\xbb\xbforder-42\ty\n")
    got = [item async for item in read_lines(stream)]
    assert got == [(1, b"order-42\tx"), (2, b"\xef\xbb\xbforder-42\ty")]  # only at the start


@e2e
def test_a_group_without_a_stream_is_one_line_with_the_run_id(nats_url: str) -> None:
    """Before: a traceback (NoStreamResponseError), no count, and the run id, without
    which publishing the input again duplicates what landed, was never shown."""
    command = [sys.executable, "-m", "shoal.consumer", "produce", "--stdin", "-g", "nosuch"]
    command += ["-n", "nowhere", "--nats", nats_url]
    result = subprocess.run(command, input=b"a\tb\n", capture_output=True, timeout=60)
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("Error: publishing failed: no stream takes subjects"), last
    assert "--run-id " in last, last


@e2e
def test_ctrl_c_ends_a_run_whose_input_stays_open(nats_url: str, tmp_path: Any) -> None:
    """Before: the interpreter waited at exit for the thread blocked in its read of an
    input that stays open and idle (a terminal, `tail -f`): Ctrl-C did not end it."""
    command = [sys.executable, "-m", "shoal.consumer", "produce", "--stdin", "-g", "g"]
    command += ["--nats", nats_url]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert process.stdin is not None
        process.stdin.write(b"")  # open, and idle
        time.sleep(4)  # imported and connected
        process.send_signal(signal.SIGINT)
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
            raise AssertionError("produce --stdin did not end on SIGINT")
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


async def test_the_producer_refuses_ids_a_header_cannot_carry() -> None:
    class NoJetStream:
        async def publish(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("published")

    producer = Producer(NoJetStream(), "shoal.test.g", PARTITIONS)
    for project in (" x", "x ", "\u00a0", "a\nb"):
        with pytest.raises(ValueError, match="project id"):
            await producer.publish(project, b"")
    with pytest.raises(ValueError, match="non-empty"):
        await producer.publish("", b"")
