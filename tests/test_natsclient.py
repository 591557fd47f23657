"""The member's NATS client (natsclient.py): its protocol parser and its header parsing
give what nats-py's do on the same bytes, and its direct path delivers, reports statuses
and acks against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
import uuid
from pathlib import Path
from typing import Any, cast

import pytest
from nats import errors
from nats.aio.client import Client
from nats.errors import ProtocolError
from nats.js import api
from nats.protocol.parser import Parser

from harness.proxy import TcpProxy
from harness.servers import NatsServer
from harness.waiting import eventually_async
from shoal.clients.nats import NATS_FLUSH_TIMEOUT, connect, reader_ended, round_trip
from shoal.clients.natsclient import (
    ACK_FLUSH_DELAY,
    Delivery,
    DirectClient,
    FastParser,
    LazyHeaders,
    header_value,
    parse_headers,
)

# Header lines, good and odd, combined into blocks below.
LINES = [
    b"Shoal-Project-Id: proj-1",
    b"Nats-Msg-Id: abc",
    b"Shoal-Project-Id:proj-2",  # repeated, no space: the last one counts
    b"  Padded-Name  :  padded value  ",
    b"Tab:\tvalue",
    b"Empty:",
    b"no colon here",
    b"Has Space: x",  # whitespace inside the name: skipped
    b"Sep\x1cName: y",  # str.isspace() whitespace, not bytes': skipped too
    b"Caf\xc3\xa9: non-ascii name",
    b"Utf8: caf\xc3\xa9",
    b"Bad-Utf8: \xff\xfe",
    b"Colons: a:b:c",
    b": no name",
]


def blocks() -> list[bytes]:
    out = []
    for size in (0, 1, 2, 3):
        for lines in itertools.permutations(LINES, size):
            if size == 3 and hash(lines) % 7:  # a sample of the 3-line blocks
                continue
            out.append(b"NATS/1.0\r\n" + b"".join(line + b"\r\n" for line in lines) + b"\r\n")
    return out


async def nats_py_headers(raw: bytes) -> dict[str, str]:
    return await Client()._process_headers(raw) or {}


async def test_parse_headers_is_nats_pys_on_the_same_bytes() -> None:
    cases = blocks()
    assert len(cases) > 200
    for raw in cases:
        assert parse_headers(raw) == await nats_py_headers(raw), raw


async def test_header_value_is_the_parsed_value() -> None:
    names = [b"Shoal-Project-Id", b"Nats-Msg-Id", b"Padded-Name", b"Utf8", b"Missing", b"Colons"]
    for raw in blocks():
        parsed = parse_headers(raw)
        for name in names:
            assert header_value(raw, name) == parsed.get(name.decode()), (raw, name)
    assert header_value(None, b"X") is None


def test_lazy_headers_answer_as_the_parsed_dict() -> None:
    """get, items, `in`, len and bool: the parsed dict's answers, for every block."""
    names = ["Shoal-Project-Id", "Nats-Msg-Id", "Padded-Name", "Utf8", "Missing", "Colons"]
    for raw in [*blocks(), None, b""]:
        parsed = parse_headers(raw)
        lazy = LazyHeaders(raw)
        for name in names:
            assert lazy.get(name) == parsed.get(name), (raw, name)
            assert lazy.get(name, "default") == parsed.get(name, "default"), (raw, name)
            assert (name in lazy) == (name in parsed), (raw, name)
        assert list(lazy.items()) == list(parsed.items()), raw
        assert (len(lazy), bool(lazy)) == (len(parsed), bool(parsed)), raw
        assert cast(object, 5) not in lazy  # not a header name at all


def test_lazy_headers_parse_on_first_read_only() -> None:
    msg = Delivery(
        DirectClient(), b"s.1", "r", b"", b"NATS/1.0\r\nA: 1\r\nShoal-Project-Id: p\r\n\r\n"
    )
    headers = msg.headers
    assert headers._parsed is None  # nothing read yet
    assert msg.header(b"Shoal-Project-Id") == "p"
    assert headers._parsed is None  # one header read without parsing the others
    assert dict(headers) == {"A": "1", "Shoal-Project-Id": "p"}
    assert headers.get("A") == "1" and "B" not in headers and len(headers) == 2
    assert msg.headers is headers
    assert not Delivery(DirectClient(), b"s", "r", b"", None).headers


@pytest.fixture
async def direct(nats_url: str) -> Any:
    nc = DirectClient()
    await nc.connect(nats_url, allow_reconnect=False)
    yield nc
    await nc.close()


async def _stream_with_durable(js: Any, prefix: str) -> str:
    """A new stream on `<name>.>` with a durable "d" (explicit acks); its name."""
    stream = f"{prefix}-{uuid.uuid4().hex[:8]}"
    await js.add_stream(name=stream, subjects=[f"{stream}.>"])
    await js.add_consumer(
        stream, api.ConsumerConfig(durable_name="d", ack_policy=api.AckPolicy.EXPLICIT)
    )
    return stream


async def test_direct_path_against_a_real_server(direct: DirectClient) -> None:
    nc = direct
    js = nc.jetstream()
    stream = await _stream_with_durable(js, "direct")
    for i in range(3):
        await js.publish(
            f"{stream}.{i}", f"m{i}".encode(), headers={"Shoal-Project-Id": f"p{i}", "N": str(i)}
        )

    got: list[Delivery] = []
    statuses: list[tuple[str, dict[str, str]]] = []
    arrived = asyncio.Event()

    def on_message(msg: Delivery) -> None:
        got.append(msg)
        arrived.set()

    def on_status(subject: str, headers: dict[str, str]) -> None:
        statuses.append((subject, headers))
        arrived.set()

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox + ".*")
    nc.route_directly(sub, on_message, on_status)
    # Another subscription on the same client still gets nats-py's Msg, through its callback.
    plain: list[Any] = []

    async def on_plain(msg: Any) -> None:
        plain.append(msg)

    other = await nc.subscribe(f"other.{stream}", cb=on_plain)

    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.d"
    await nc.publish(next_subject, json.dumps({"batch": 3}).encode(), reply=inbox + ".a")
    while len(got) < 3:
        arrived.clear()
        async with asyncio.timeout(5):
            await arrived.wait()
    assert [m.data for m in got] == [b"m0", b"m1", b"m2"]
    assert [m.subject for m in got] == [f"{stream}.0", f"{stream}.1", f"{stream}.2"]
    assert [m.header(b"Shoal-Project-Id") for m in got] == ["p0", "p1", "p2"]
    assert dict(got[1].headers) == {"Shoal-Project-Id": "p1", "N": "1"}
    assert all(m.reply.startswith(f"$JS.ACK.{stream}.d.1.") for m in got)

    # Acks through the lean publish. The first wakes the flusher; while that flush is
    # queued, the next is queued without a coroutine. A nak with a delay brings the
    # message back.
    assert not nc.queue_ack(got[0].reply), "no flush queued yet: the caller must await"
    await nc.publish_ack(got[0].reply)
    assert nc.queue_ack(got[1].reply)
    await got[2].nak(delay=0.2)
    await nc.flush()
    # The server applies acks on the consumer's own goroutine, after the flush's PONG:
    # an info request can still see the floor where it was.
    info = await eventually_async(
        lambda: js.consumer_info(stream, "d"),
        5,
        "the two acks to move the ack floor to 2",
        until=lambda i: i.ack_floor.stream_seq == 2,
        interval=0.02,
        describe=lambda i: f"ack floor {i.ack_floor.stream_seq}",
    )
    assert info.num_ack_pending == 1, "the naked message is pending again, not acked"

    # A pull that finds nothing ends with a status (no_wait: 404), on the request's subject.
    await nc.publish(
        next_subject, json.dumps({"batch": 5, "no_wait": True}).encode(), reply=inbox + ".b"
    )
    arrived.clear()
    async with asyncio.timeout(5):
        await arrived.wait()
    assert statuses and statuses[0][0] == inbox + ".b"
    assert statuses[0][1].get("Status") in ("404", "408")

    # The naked message comes back after its delay, to the next pull.
    await asyncio.sleep(0.3)
    await nc.publish(next_subject, json.dumps({"batch": 1}).encode(), reply=inbox + ".c")
    while len(got) < 4:
        arrived.clear()
        async with asyncio.timeout(5):
            await arrived.wait()
    assert got[3].data == b"m2" and ".d.2." in got[3].reply
    await got[3].term()
    await nc.flush()

    await nc.publish(f"other.{stream}", b"hello")
    await nc.flush()
    for _ in range(50):
        if plain:
            break
        await asyncio.sleep(0.02)
    assert plain and plain[0].data == b"hello"

    # Unsubscribed: nothing more reaches the direct functions.
    await sub.unsubscribe()
    await js.publish(f"{stream}.9", b"late", headers={"Shoal-Project-Id": "p9"})
    await nc.publish(next_subject, json.dumps({"batch": 1}).encode(), reply=inbox + ".d")
    await nc.flush()
    await asyncio.sleep(0.3)
    assert len(got) == 4
    await other.unsubscribe()
    await js.delete_stream(stream)


async def test_a_delivery_callback_that_raises_leaves_the_connection_reading(
    direct: DirectClient,
) -> None:
    """The direct path calls the member's function inside nats-py's read loop, which an
    exception ends for good: one bug in it, for one message, and the member read nothing
    more until nats-py's ping check reconnected it minutes later."""
    nc = direct
    js = nc.jetstream()
    stream = await _stream_with_durable(js, "raises")
    for i in range(3):
        await js.publish(f"{stream}.{i}", f"m{i}".encode())
    got: list[Delivery] = []

    def on_message(msg: Delivery) -> None:
        if msg.data == b"m1":
            raise RuntimeError("a bug in the member's callback")
        got.append(msg)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox + ".*")
    nc.route_directly(sub, on_message, lambda subject, headers: None)
    await nc.publish(
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.d",
        json.dumps({"batch": 3}).encode(),
        reply=inbox + ".a",
    )

    async def delivered() -> list[bytes]:
        return [m.data for m in got]

    await eventually_async(delivered, 5, "m0 and m2", until=lambda d: d == [b"m0", b"m2"])
    assert not reader_ended(nc)
    await round_trip(nc, 2.0)
    await js.delete_stream(stream)


async def test_acks_settled_one_by_one_go_out_in_one_write_and_all_arrive(
    direct: DirectClient,
) -> None:
    """Handlers that finish one per turn of the event loop (a 20 ms handler, an HTTP
    service) ack one per turn: each ack used to wake the flusher for a write of its own.
    Now they wait ACK_FLUSH_DELAY for each other and go out together, and reach the
    server without anyone flushing."""
    nc = direct
    js = nc.jetstream()
    stream = await _stream_with_durable(js, "acks")
    for i in range(20):
        await js.publish(f"{stream}.{i}", b"x")
    got: list[Delivery] = []
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox + ".*")
    nc.route_directly(sub, got.append, lambda subject, headers: None)
    await nc.publish(
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.d",
        json.dumps({"batch": 20}).encode(),
        reply=inbox + ".a",
    )

    async def delivered() -> int:
        return len(got)

    await eventually_async(delivered, 5, "20 deliveries", until=lambda n: n == 20)
    await asyncio.sleep(0.05)  # the pull's own write is long done

    transport: Any = nc._transport
    writes = 0
    write_lines = transport.writelines

    def counted(lines: Any) -> None:
        nonlocal writes
        writes += 1
        write_lines(lines)

    transport.writelines = counted
    try:
        for msg in got:
            if not nc.queue_ack(msg.reply):
                await nc.publish_ack(msg.reply)
            await asyncio.sleep(0)  # the next handler finishes in a later turn
        await asyncio.sleep(ACK_FLUSH_DELAY + 0.05)
    finally:
        transport.writelines = write_lines
    assert writes == 1, f"{writes} writes for 20 acks"
    info = await eventually_async(
        lambda: js.consumer_info(stream, "d"),
        5,
        "the 20 acks to reach the server (no flush asked for)",
        until=lambda i: i.num_ack_pending == 0 and i.ack_floor.stream_seq == 20,
        interval=0.02,
        describe=lambda i: f"ack pending {i.num_ack_pending}, floor {i.ack_floor.stream_seq}",
    )
    assert info.num_redelivered == 0
    await sub.unsubscribe()
    await js.delete_stream(stream)


async def test_publish_ack_while_disconnected_is_nats_pys_publish() -> None:
    nc = DirectClient()  # never connected: publish refuses, and so does publish_ack
    with pytest.raises(Exception) as raised:
        await nc.publish("x", b"+ACK")
    with pytest.raises(type(raised.value)):
        await nc.publish_ack("x")
    assert not nc.queue_ack("x")  # the caller then awaits publish_ack, which refuses


class Recorder:
    """What a parser hands to its client, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def _process_msg(self, *args: Any) -> None:
        self.calls.append(("msg", *args))

    async def _process_ping(self) -> None:
        self.calls.append(("ping",))

    async def _process_pong(self) -> None:
        self.calls.append(("pong",))

    async def _process_err(self, err: str) -> None:
        self.calls.append(("err", err))

    async def _process_info(self, info: dict[str, Any]) -> None:
        self.calls.append(("info", info))


def wire(rng: random.Random, count: int) -> bytes:
    """A server's side of a connection: messages of every shape, and the other lines."""
    out = []
    for i in range(count):
        kind = rng.randrange(10)
        subject = f"s.{rng.randrange(128)}".encode()
        reply = f"$JS.ACK.st.p{i}.1.{i}.{i}.17000.{i}".encode() if rng.random() < 0.8 else b""
        payload = bytes(rng.randrange(256) for _ in range(rng.choice((0, 1, 5, 64, 300))))
        if kind < 5:
            headers = b"NATS/1.0\r\nShoal-Project-Id: p%d\r\n\r\n" % i
            if rng.random() < 0.2:
                headers = b"NATS/1.0 408 Request Timeout\r\n\r\n"
            line = b"HMSG %s %d %s%d %d\r\n" % (
                subject,
                rng.randrange(1, 5),
                reply + b" " if reply else b"",
                len(headers),
                len(headers) + len(payload),
            )
            out.append(line + headers + payload + b"\r\n")
        elif kind < 8:
            line = b"MSG %s %d %s%d\r\n" % (
                subject,
                rng.randrange(1, 5),
                reply + b"  " if reply else b"",
                len(payload),
            )
            out.append(line + payload + b"\r\n")
        else:
            out.append(
                rng.choice(
                    [
                        b"PING\r\n",
                        b"PONG\r\n",
                        b"+OK\r\n",
                        b"-ERR 'Slow Consumer'\r\n",
                        b'INFO {"server_id":"x","max_payload":1048576}\r\n',
                    ]
                )
            )
    return b"".join(out)


async def feed(parser: Parser, data: bytes, cuts: list[int]) -> None:
    start = 0
    for cut in [*cuts, len(data)]:
        await parser.parse(data[start:cut])
        start = cut


async def test_fast_parser_hands_over_what_nats_pys_parser_does() -> None:
    rng = random.Random(13)
    for case in range(60):
        data = wire(rng, rng.randrange(1, 80))
        # Reads cut anywhere: inside lines, headers, payloads and the CRLFs.
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randrange(0, 40))))
        if case % 10 == 0:
            cuts = list(range(1, len(data)))  # one byte at a time
        theirs, ours = Recorder(), Recorder()
        await feed(Parser(theirs), data, cuts)
        await feed(FastParser(ours), data, cuts)
        assert ours.calls == theirs.calls, case
        assert len(ours.calls) > 0


async def outcome(parser: Parser, recorder: Recorder, data: bytes) -> Any:
    try:
        await parser.parse(data)
    except ProtocolError as exc:
        return ("refused", type(exc))
    return recorder.calls


async def test_fast_parser_refuses_what_nats_pys_refuses() -> None:
    payload = b"hello\r\n"
    odd_lines = [
        b"BOGUS line\r\n",
        b"MSG only-a-subject\r\n",
        b"MSG s 1 5 \r\n" + payload,  # trailing whitespace
        b"MSG s x 5\r\n" + payload,  # a sid that is not a number
        b"MSG s 1 r +5\r\n" + payload,
        b"MSG s 1 r 5_0\r\n" + payload,
        b"MSG s 1 a b 5\r\n" + payload,  # one token too many
        b"HMSG s 1 r x 5\r\n" + payload,
        b"HMSG s 1 5\r\n" + payload,  # one size only
        b"MSGX s 1 5\r\n" + payload,
        b"MSG\ts\t1\t5\r\n" + payload,  # tabs: whitespace in nats-py's grammar too
        b"HMSG  s  1  r  0  5\r\n" + payload,
    ]
    for data in odd_lines:
        theirs, ours = Recorder(), Recorder()
        expected = await outcome(Parser(theirs), theirs, data)
        assert await outcome(FastParser(ours), ours, data) == expected, data
    for bad in (b"BOGUS line\r\n", b"MSG only-a-subject\r\n"):
        with pytest.raises(ProtocolError):
            await FastParser(Recorder()).parse(bad)


@pytest.mark.e2e
async def test_requests_refused_while_the_reconnect_buffer_is_full_leave_nothing_behind(
    tmp_path: Path,
) -> None:
    """nats-py registers a request's reply future before it publishes the request; when
    that publish raises (NATS away, the reconnect buffer full), nothing ever removed the
    future. DirectClient refuses such a request up front: nothing is left behind, and
    requests work again once NATS is back. (Before: one entry per refused request.)"""
    server = NatsServer(tmp_path / "nats")
    nc = DirectClient()
    try:
        server.start()
        await nc.connect(
            server.url,
            pending_size=4096,
            max_reconnect_attempts=-1,
            # nats-py annotates it int, but it is seconds, slept and compared as a float.
            reconnect_time_wait=0.2,  # type: ignore[arg-type]
            connect_timeout=1,
        )
        js = nc.jetstream()
        server.kill()
        await eventually_async(lambda: _disconnected(nc), 10, "the client to notice")
        with pytest.raises(errors.OutboundBufferLimitError):
            for _ in range(1000):  # fill the reconnect buffer
                await nc.publish("fill", b"x" * 100)
        for _ in range(200):
            with pytest.raises((errors.OutboundBufferLimitError, errors.TimeoutError)):
                await nc.request("some.service", b"ping", timeout=0.05)
            with pytest.raises(Exception):  # noqa: B017 (whatever nats-py makes of it)
                await js.consumer_info("S", "d", timeout=0.05)
        assert len(nc._resp_map) == 0
        server.start()
        await eventually_async(lambda: _connected(nc), 20, "the client to reconnect")
        await js.add_stream(name="S", subjects=["s.>"])
        assert (await js.stream_info("S")).config.name == "S"
        assert len(nc._resp_map) == 0
    finally:
        await nc.close()
        server.stop()


async def _disconnected(nc: Any) -> bool:
    return not nc.is_connected


async def _connected(nc: Any) -> bool:
    return bool(nc.is_connected)


@pytest.mark.e2e
async def test_a_request_cancelled_as_its_answer_arrives_ends_the_task(tmp_path: Path) -> None:
    """nats-py waits for a request's answer with asyncio.wait_for, which on Python 3.11
    returns the answer and drops a cancellation that arrives in the same loop iteration
    (CPython gh-86296). Every JetStream call goes through `request` (consumer_info in the
    takeover gate's loop, stream_info, publish acks), so a loop around one of them that
    was cancelled at that moment ran on, still marked cancelling. DirectClient raises the
    cancellation again once the answer is in. (Before: the task went on to its next step.)"""
    server = NatsServer(tmp_path / "nats")
    nc = DirectClient()
    try:
        server.start()
        await nc.connect(server.url, connect_timeout=1)

        release = asyncio.Event()

        async def answer(msg: Any) -> None:
            await release.wait()  # once the test watches the answer's future
            await msg.respond(b"pong")

        await nc.subscribe("svc", cb=answer)
        went_on = asyncio.Event()

        async def asks() -> None:
            await nc.request("svc", b"ping", timeout=5)
            went_on.set()  # a cancelled task must not get here
            await asyncio.sleep(3600)

        task = asyncio.create_task(asks())
        for _ in range(100):
            if nc._resp_map:
                break
            await asyncio.sleep(0.05)
        (future,) = nc._resp_map.values()
        # Cancelled by the answer's own callback: after wait_for's waiter is released,
        # before the task runs again, i.e. in the loop iteration that brings the answer.
        future.add_done_callback(lambda _: task.cancel())
        release.set()
        done, _ = await asyncio.wait([task], timeout=5)
        if not done:
            task.cancel()  # once more, so that the test ends either way
            await asyncio.wait([task], timeout=2)
        assert not went_on.is_set(), "the request returned its answer to a cancelled task"
        assert done and task.cancelled()
    finally:
        await nc.close()
        server.stop()


@pytest.mark.e2e
async def test_a_request_made_while_cleaning_up_after_a_cancellation_returns(
    tmp_path: Path,
) -> None:
    """The other side of the test above: a `finally:` that cleans up after a cancellation
    (the reset and the dead-letter commands delete their consumers there) runs while the
    task is marked cancelling, and its requests must still return their answers."""
    server = NatsServer(tmp_path / "nats")
    nc = DirectClient()
    try:
        server.start()
        await nc.connect(server.url, connect_timeout=1)

        async def answer(msg: Any) -> None:
            await msg.respond(b"done")

        await nc.subscribe("cleanup", cb=answer)
        started, answers = asyncio.Event(), []

        async def works_then_cleans_up() -> None:
            try:
                started.set()
                await asyncio.sleep(3600)
            finally:
                answers.append((await nc.request("cleanup", b"", timeout=5)).data)
                answers.append((await nc.request("cleanup", b"", timeout=5)).data)

        task = asyncio.create_task(works_then_cleans_up())
        await started.wait()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=10)
        assert done and task.cancelled()
        assert answers == [b"done", b"done"]
    finally:
        await nc.close()
        server.stop()


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_publish_into_a_blackholed_connection_returns(tmp_path: Path) -> None:
    """A network that drops everything without a reset: the kernel's buffers fill, nats-py's
    flusher waits on the socket, and once more is pending than the buffer holds, every
    publish forces a flush and waits for it, for as long as nats-py's flush_timeout, which
    it leaves unset (for good). A member's acks and pulls went that way: a partition's
    runner could not stop, its hand-back waited on its handlers, and its claim stayed on
    a live lease, so the member the leader moved it to could not take it, until nats-py's
    ping check gave up on the connection minutes later. Shoal's connections bound it."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    proxy = TcpProxy(server.url.removeprefix("nats://"), name="nats").start()
    nc = None
    try:
        nc = await connect(f"nats://{proxy.address}", name="blackholed")
        await nc.publish("warm", b"x")
        await nc.flush()
        proxy.blackhole()
        payload = b"x" * 65536
        took = 0.0
        async with asyncio.timeout(60):
            for _ in range(4000):  # up to 256 MB: far more than every buffer on the way
                started = time.monotonic()
                await nc.publish("fill", payload)
                took = time.monotonic() - started
                if took > 0.5:
                    break  # the first publish that had to wait for a flush
        assert took > 0.5, "nothing ever waited: the blackhole did not hold"
        assert took < NATS_FLUSH_TIMEOUT + 3, took
    finally:
        if nc is not None:
            proxy.stop()  # resets the connection: close() need not wait on the blackhole
            with contextlib.suppress(ConnectionError):  # nats-py's close drains the reset
                await nc.close()
        proxy.stop()
        server.stop()


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_publish_cancelled_while_it_waits_for_a_flush_is_cancelled(
    tmp_path: Path,
) -> None:
    """nats-py swallows a cancellation that comes while a publish waits for the flush it
    forced: the publish returned as if it had not been cancelled, and the task went on
    (a runner being stopped, the member shutting down). DirectClient raises it again."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    proxy = TcpProxy(server.url.removeprefix("nats://"), name="nats").start()
    nc = None
    try:
        nc = await connect(f"nats://{proxy.address}", name="blackholed")
        await nc.flush()
        proxy.blackhole()
        payload = b"x" * 65536
        waiting, went_on = asyncio.Event(), asyncio.Event()

        async def fill() -> None:
            assert nc is not None
            for _ in range(4000):
                publish = asyncio.ensure_future(nc.publish("fill", payload))
                done, _ = await asyncio.wait([publish], timeout=0.5)
                if not done:
                    waiting.set()  # blocked in a forced flush: now cancel us
                    await publish
                    went_on.set()
                    return

        task = asyncio.create_task(fill())
        async with asyncio.timeout(60):
            await waiting.wait()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=NATS_FLUSH_TIMEOUT + 5)
        assert done and not went_on.is_set(), "the cancelled publish returned and went on"
        assert task.cancelled()
    finally:
        if nc is not None:
            proxy.stop()
            with contextlib.suppress(ConnectionError):
                await nc.close()
        proxy.stop()
        server.stop()


async def test_a_large_payload_read_in_pieces_costs_what_it_does_in_nats_py() -> None:
    """A 32 MB message (a raised max_payload) read in nats-py's 32 KB pieces. FastParser
    copied its whole buffer at every read, in the middle of a payload too: time in the
    square of the size (8 s for 32 MB, nats-py's parser 0.05 s), the read loop blocked
    meanwhile. A generous bound: the same order as nats-py's."""
    from nats.aio.client import DEFAULT_BUFFER_SIZE

    class Sink:
        def __init__(self) -> None:
            self.payloads: list[bytes] = []

        async def _process_msg(self, *args: Any) -> None:
            self.payloads.append(args[3])

    size = 32 << 20
    wire = b"MSG s 1 $JS.ACK.a.b.1.1.1.1.0 %d\r\n" % size + b"x" * size + b"\r\n"

    async def feed(parser: Parser) -> float:
        started = time.perf_counter()
        for at in range(0, len(wire), DEFAULT_BUFFER_SIZE):
            await parser.parse(wire[at : at + DEFAULT_BUFFER_SIZE])
        return time.perf_counter() - started

    theirs, ours = Sink(), Sink()
    their_time = await feed(Parser(theirs))
    our_time = await feed(FastParser(ours))
    assert [len(p) for p in ours.payloads] == [len(p) for p in theirs.payloads] == [size]
    assert our_time < 5 * their_time + 0.25, (our_time, their_time)


async def test_header_value_is_what_the_handler_reads_when_a_name_comes_twice() -> None:
    """A raw block naming the project twice, the second time padded (" Name : v"):
    header_value took the last plain "Name:" line (proj-a), where parse_headers and
    nats-py keep the last one whatever its spacing (proj-b): the member checked the
    partition with one project and its handler saw the other."""
    raw = b"NATS/1.0\r\nShoal-Project-Id: proj-a\r\n Shoal-Project-Id : proj-b\r\n\r\n"
    assert await Client()._process_headers(raw) == {"Shoal-Project-Id": "proj-b"}
    assert parse_headers(raw) == {"Shoal-Project-Id": "proj-b"}
    assert header_value(raw, b"Shoal-Project-Id") == "proj-b"
