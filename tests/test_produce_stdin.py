"""`shoal-consumer produce --stdin`: `project_id<TAB>data` lines, published as the
Producer publishes, against a real nats-server; and the line parsing on its own."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import unicodedata
from collections import defaultdict
from collections.abc import Callable
from subprocess import PIPE
from typing import Any

import pytest

from harness.waiting import eventually_async
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
    for words in ("max_payload", "duplicates", '"interrupted": true', "130"):
        assert words in " ".join(out.split()), words


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
def test_a_group_without_a_stream_is_one_line(nats_url: str) -> None:
    """Before: a traceback (NoStreamResponseError); then a minute of retries and a run
    id to publish again with. Now one line, before anything is published."""
    command = [sys.executable, "-m", "shoal.consumer", "produce", "--stdin", "-g", "nosuch"]
    command += ["-n", "nowhere", "--nats", nats_url]
    result = subprocess.run(command, input=b"a\tb\n", capture_output=True, timeout=60)
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("Error: unknown group nowhere/nosuch: no stream"), last


@e2e
def test_ctrl_c_ends_a_run_whose_input_stays_open(config: GroupConfig, tmp_path: Any) -> None:
    """Before: the interpreter waited at exit for the thread blocked in its read of an
    input that stays open and idle (a terminal, `tail -f`): Ctrl-C did not end it; then
    it ended it with SIGABRT. (The test ran without a stream, and ended on its own.)"""
    command = [sys.executable, "-m", "shoal.consumer", "produce", "--stdin"]
    command += ["-g", config.group, "-n", config.namespace, "--nats", config.nats_url]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert process.stdin is not None
        process.stdin.write(b"")  # open, and idle
        time.sleep(4)  # imported and connected
        assert process.poll() is None, "it ended before the SIGINT"
        process.send_signal(signal.SIGINT)
        # The summary, and the exit status it names: the interpreter's finalization,
        # which wants the lock of the read still waiting, aborted the process (134).
        assert process.wait(timeout=10) == 130
        assert process.stderr is not None
        err = process.stderr.read().decode()
        assert '"interrupted": true' in err and "Fatal Python error" not in err, err
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


# The nats-server's max_payload (its default), which headers and data together may not
# exceed.
MAX_PAYLOAD = 1 << 20


@e2e
@pytest.mark.parametrize(
    "size", [MAX_PAYLOAD + 1000, MAX_PAYLOAD - 10], ids=["data>max", "data+headers>max"]
)
async def test_a_line_too_large_for_nats_is_named_and_nothing_after_it_is_published(
    config: GroupConfig, js: Any, size: int
) -> None:
    """Before: the line was published and refused by the server (nats-py checks only the
    data, the server headers and data), retried five times as a network error, the error
    named no line, and the lines after it were published meanwhile."""
    text = b"p\tfirst\n" + b"p\t" + b"x" * size + b"\n" + b"p\tthird\n"
    result = produce(config, text, "--run-id", "big")
    err = result.stderr.decode()
    assert result.returncode == 1, err[-600:]
    assert "Error: stdin line 2: " in err and str(MAX_PAYLOAD) in err, err[-600:]
    assert "retry" not in err, err[-600:]
    assert [m.data for m in await stream_messages(js, config.stream)] == [b"first"]


async def test_the_producer_refuses_a_message_over_max_payload_and_never_retries_one() -> None:
    """Before: Producer sent a message whose headers took it over max_payload (the server
    closed the connection), and publish_many retried a MaxPayloadError, BadSubjectError
    or ValueError five times, as if the network had failed."""
    from nats.errors import BadSubjectError, MaxPayloadError

    from shoal.consumer.producer import MessageTooLarge, Outgoing

    class Refusing:
        def __init__(self, error: Exception) -> None:
            self.error, self.calls = error, 0

        async def publish(self, *args: Any, **kwargs: Any) -> None:
            self.calls += 1
            raise self.error

    producer = Producer(Refusing(AssertionError("published")), "shoal.test.g", PARTITIONS, 100)
    producer.prepare(Outgoing("p", b"x" * 30, "m"))  # fits with its headers
    with pytest.raises(MessageTooLarge, match="over the NATS server's max_payload of 100"):
        producer.prepare(Outgoing("p", b"x" * 90, "m"))  # the data alone fits
    for error in (MaxPayloadError(), BadSubjectError(), ValueError("bad")):
        js = Refusing(error)
        with pytest.raises(type(error)):
            await Producer(js, "shoal.test.g", PARTITIONS).publish_many([Outgoing("p", b"")])
        assert js.calls == 1, error


@e2e
async def test_messages_dropped_as_duplicates_are_counted_apart(
    config: GroupConfig, js: Any
) -> None:
    """Before: a message JetStream dropped as a duplicate (its id stored already: the same
    --run-id reused) was counted as published, and nothing said it was dropped."""
    assert produce(config, b"a\tfirst\nb\tsecond\n", "--run-id", "same").returncode == 0
    result = produce(config, b"a\tDIFFERENT\nb\tsecond\nc\tnew\n", "--run-id", "same")
    err = result.stderr.decode()
    assert result.returncode == 0, err
    summary = json.loads(err.strip().splitlines()[-1])
    assert (summary["published"], summary["duplicates"]) == (1, 2), summary
    assert "Warning: JetStream dropped 2 messages as duplicates" in err, err
    got = [m.data for m in await stream_messages(js, config.stream)]
    assert sorted(got) == [b"first", b"new", b"second"]


def test_two_runs_in_one_millisecond_get_different_run_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: the default run id was the millisecond clock alone, so a second run started
    in the same millisecond had the first one's message ids and JetStream dropped its
    messages as duplicates."""
    from shoal.consumer import producer

    monkeypatch.setattr("shoal.consumer.producer.time.time", lambda: 1764316800.000123)
    first, second = producer.default_run_id(), producer.default_run_id()
    assert first != second
    for run in (first, second):
        # No "-": a message id RUN-PROJECT-N splits at its first "-" into the run id.
        assert re.fullmatch(r"1764316800000_[0-9a-f]{6}", run), run


@e2e
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_an_interrupted_run_says_what_it_published_and_its_run_id(
    config: GroupConfig, js: Any, tmp_path: Any, sig: signal.Signals
) -> None:
    """Before: Ctrl-C said "Aborted!" and nothing else (SIGTERM: nothing at all), though
    some lines were stored and the default run id, without which the rest cannot be
    published without duplicates, was never shown."""
    text = lines_of([(f"p-{i % 5}", f"line-{i}".encode()) for i in range(300)])
    lines = tmp_path / "in.txt"
    lines.write_bytes(text)
    command = [sys.executable, "-m", "shoal.consumer", "produce", "--stdin", "--rate", "50"]
    command += ["-g", config.group, "-n", config.namespace, "--nats", config.nats_url]
    command += ["-p", str(config.partitions)]
    with lines.open("rb") as stdin:
        process = await asyncio.create_subprocess_exec(*command, stdin=stdin, stderr=PIPE)
        try:
            await eventually_async(
                lambda: stream_messages(js, config.stream),
                30,
                "some lines published",
                until=lambda got: len(got) >= 20,
                describe=lambda got: f"{len(got)} messages",
            )
            process.send_signal(sig)
            async with asyncio.timeout(30):
                _, err = await process.communicate()
        finally:
            if process.returncode is None:
                process.kill()
                await process.communicate()
    assert process.returncode == 130, err.decode()
    summary = json.loads(err.decode().strip().splitlines()[-2])
    assert summary["interrupted"] is True, summary
    stored = len(await stream_messages(js, config.stream))
    assert 0 < summary["published"] <= stored < 300, (summary, stored)
    assert f"--run-id {summary['run_id']}" in err.decode()

    # The same input again with that run id adds only what is missing.
    again = produce(config, text, "--run-id", summary["run_id"])
    assert again.returncode == 0, again.stderr.decode()
    assert json.loads(again.stderr.decode().strip().splitlines()[-1])["duplicates"] == stored
    got = await stream_messages(js, config.stream)
    assert sorted(m.data for m in got) == sorted(f"line-{i}".encode() for i in range(300))


class SlowPipe(io.RawIOBase):
    """A pipe's reads: at most 64 KiB each, of `data` and then, if `endless`, of x's."""

    def __init__(self, data: bytes, endless: bool = False) -> None:
        self.data, self.endless = io.BytesIO(data), endless

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), 65536)
        got = self.data.read(n) or (b"x" * n if self.endless else b"")
        buf[: len(got)] = got
        return len(got)


async def test_read_lines_is_linear_in_the_length_of_a_line_and_bounded() -> None:
    """Before: read_lines joined what it held of a line with each new chunk and split it
    all again, quadratic in the line's length (a 64 MiB line without a newline, a file
    piped by mistake, took ~30 s, 1 GiB hours), and held a line of any length."""
    stream = io.BufferedReader(SlowPipe(b"p\t" + b"x" * (64 << 20) + b"\n"), 65536)
    started = time.monotonic()
    try:
        async with asyncio.timeout(8):
            assert [len(line) async for _, line in read_lines(stream)] == [(64 << 20) + 2]
    except TimeoutError:
        pytest.fail(f"a 64 MiB line took over {time.monotonic() - started:.0f} s")

    endless = io.BufferedReader(SlowPipe(b"a\tb\n", endless=True), 65536)
    got = []
    async with asyncio.timeout(8):  # before: forever, in ever more memory
        with pytest.raises(LineError, match=r"^line 2: the line is over 100000 bytes"):
            async for item in read_lines(endless, max_line=100_000):
                got.append(item)
    assert got == [(1, b"a\tb")]
    exact = io.BytesIO(b"a\t" + b"x" * 98 + b"\r\n" + b"b\t" + b"x" * 99)
    with pytest.raises(LineError, match=r"^line 2: the line is over 100 bytes"):
        async for item in read_lines(exact, chunk=7, max_line=100):
            assert item == (1, b"a\t" + b"x" * 98)


async def test_a_callers_nats_msg_id_header_is_kept() -> None:
    """Before: a Nats-Msg-Id the caller put in `headers` was replaced by a random one, so
    JetStream did not de-duplicate the caller's own retries."""
    sent: list[dict[str, str]] = []

    class Recording:
        async def publish(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
            sent.append(headers)

    producer = Producer(Recording(), "shoal.test.g", PARTITIONS)
    await producer.publish("order-42", b"{}", headers={MSG_ID_HEADER: "order-42-v1"})
    await producer.publish("order-42", b"{}", message_id="m", headers={MSG_ID_HEADER: "x"})
    await producer.publish("order-42", b"{}")
    assert [h[MSG_ID_HEADER] for h in sent[:2]] == ["order-42-v1", "m"]
    assert re.fullmatch(r"[0-9a-f]{32}", sent[2][MSG_ID_HEADER])


@e2e
def test_a_closed_stdout_after_publishing_is_no_publishing_failure(config: GroupConfig) -> None:
    """Before: when the reader of standard output had gone (`produce | head -0`), the
    summary's write failed after every message was stored, and the run ended with
    "Error: [Errno 32] Broken pipe", exit 1, as if NATS had failed."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    command = [sys.executable, "-m", "shoal.consumer", "produce", "-m", "5", "-k", "2"]
    command += ["-g", config.group, "-n", config.namespace, "--nats", config.nats_url]
    command += ["-p", str(config.partitions), "--run-id", "pipe"]
    try:
        result = subprocess.run(command, stdout=write, stderr=subprocess.PIPE, timeout=60)
    finally:
        os.close(write)
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert "Error" not in err and "Broken pipe" not in err, err
    assert json.loads(err.strip().splitlines()[-1])["published"] == 5


@e2e
async def test_the_partition_count_is_the_groups(config: GroupConfig, js: Any) -> None:
    """The group's stream records its partition count (ensure_group), and produce takes
    it from there. Before, -p defaulted to 128 whatever the group had: on a group of 7
    its messages went to partitions 7-127, which no durable consumes (a work-queue stream
    keeps them for good), exit 0, "published"; one that differs is now refused."""
    from shoal.group.jetstream import stream_partitions

    assert stream_partitions(await js.stream_info(config.stream)) == PARTITIONS
    command = [sys.executable, "-m", "shoal.consumer", "produce", "--stdin"]
    command += ["-g", config.group, "-n", config.namespace, "--nats", config.nats_url]
    text = lines_of([(f"project-{i}", b"x") for i in range(20)])

    def run(args: list[str]) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(args, input=text, capture_output=True, timeout=60)

    wrong = await asyncio.to_thread(run, [*command, "-p", "128"])
    assert wrong.returncode == 2, wrong.stderr.decode()
    assert f"records {PARTITIONS} partitions for the group, not --partitions 128" in (
        wrong.stderr.decode()
    )
    assert await stream_messages(js, config.stream) == []
    right = await asyncio.to_thread(run, command)
    assert right.returncode == 0, right.stderr.decode()
    got = await stream_messages(js, config.stream)
    assert len(got) == 20
    for msg in got:
        project = headers(msg)[PROJECT_HEADER]
        assert msg.subject == partition_subject(
            config.subject_prefix, partition_for(project, PARTITIONS)
        )


@e2e
async def test_a_misspelt_group_fails_at_once_and_a_stream_of_another_name_is_found(
    make_config: Callable[..., GroupConfig], js: Any
) -> None:
    """A group with no stream: every publish would fail (no stream answers); the command
    retried each line for a minute ('40 retry warnings'), then told the user to publish
    again with --run-id. Refused at once now. A group whose stream has a name of its own
    (spec.nats.stream.name) is found by its subjects, --stream or not."""
    missing = make_config(partitions=PARTITIONS, ledger=False)
    started = time.monotonic()
    done = await asyncio.to_thread(produce, missing, b"a\tx\n")
    assert done.returncode == 2, done.stderr
    assert b"unknown group" in done.stderr and b"--stream" in done.stderr, done.stderr
    assert time.monotonic() - started < 30
    named = make_config(partitions=PARTITIONS, ledger=False, stream="ORDERS_OWN")
    await ensure_group(js, named)
    done = await asyncio.to_thread(produce, named, b"a\tx\nb\ty\n")
    assert done.returncode == 0, done.stderr
    assert (await js.stream_info("ORDERS_OWN")).state.messages == 2
