"""The member's event loop (shoal.consumer.eventloop): uvloop by default, asyncio's on
request, and the member's own transports (the HTTP handler's client) working on both.

The HTTP client once asserted that its transport was an asyncio.Transport; uvloop's are
not, so every request failed on uvloop (each message retried, then dead-lettered). The
client test below runs it on a real socket under uvloop, as the member does."""

from __future__ import annotations

import asyncio

import pytest
import uvloop
from click.testing import CliRunner

from harness.servers import free_port
from shoal.consumer import eventloop
from shoal.consumer.cli import main
from shoal.consumer.httpclient import HttpClient


async def loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_uvloop_is_the_default() -> None:
    assert eventloop.DEFAULT == "uvloop"
    assert eventloop.run(loop_type()) is uvloop.Loop


def test_asyncio_is_chosen_by_name() -> None:
    kind = eventloop.run(loop_type(), "asyncio")
    assert not issubclass(kind, uvloop.Loop)
    assert issubclass(kind, asyncio.AbstractEventLoop)


def test_an_unknown_loop_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown event loop 'trio': expected one of uvloop"):
        eventloop.run(loop_type(), "trio")


def test_the_run_command_refuses_an_unknown_loop_before_connecting() -> None:
    result = CliRunner().invoke(
        main, ["run", "--group", "g", "--event-loop", "gevent"], env={"SHOAL_EVENT_LOOP": ""}
    )
    assert result.exit_code == 2
    assert "Invalid value for '--event-loop'" in result.output
    assert "'uvloop', 'asyncio'" in result.output


@pytest.mark.parametrize("loop", eventloop.CHOICES)
def test_the_http_client_posts_reuses_and_times_out_on_each_loop(loop: str) -> None:
    async def scenario() -> list[object]:
        seen: list[bytes] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    seen.append(head)
                    if b"/slow" in head.split(b"\r\n", 1)[0]:
                        await asyncio.sleep(5)  # longer than the client waits
                    body = b"5\r\nhello\r\n0\r\n\r\n"
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        port = free_port()
        server = await asyncio.start_server(serve, "127.0.0.1", port)
        client = HttpClient(f"http://127.0.0.1:{port}/messages")
        got: list[object] = []
        try:
            for _ in range(3):
                answer = await client.request("POST", "/messages", {"A": "b"}, b"")
                got.append((answer.status, answer.body))
            with pytest.raises(TimeoutError):
                await client.request("POST", "/slow", {}, b"", timeout=0.2)
            got.append((await client.request("POST", "/messages", {}, b"")).status)
        finally:
            await client.close()
            server.close()
            await server.wait_closed()
        got.append(len(seen))
        return got

    got = eventloop.run(scenario(), loop)
    # Three answers on one kept-alive connection, the timed-out request's connection
    # dropped, and a new one for the last request.
    assert got == [(200, b"hello")] * 3 + [200, 5]
