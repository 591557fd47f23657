"""The producer side: publish a project's data to its partition's subject.

No registration hand-shake (the seed's REG_RESP/CLOSE/DATA subjects): a project's
partition is a pure function of its id. Every message carries a message id so that a
retried publish is de-duplicated by JetStream instead of processed twice.

`shoal-consumer produce --stdin` publishes `project_id<TAB>data` lines with the same
Producer (parse_line, read_lines), so that shell scripts and tools in any language
publish correctly without a client library.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

from shoal.contracts.names import (
    DEFAULT_PARTITIONS,
    MSG_ID_HEADER,
    PROJECT_HEADER,
    partition_for,
    partition_subject,
)

log = logging.getLogger(__name__)

# What `shoal-consumer produce --stdin` reads, one message a line.
LINE_FORMAT = "project_id<TAB>data"


class LineError(ValueError):
    """A line of `produce --stdin` input that is not a message; says which line."""

    def __init__(self, number: int, problem: str) -> None:
        super().__init__(f"line {number}: {problem}")
        self.number = number


def header_problem(project_id: str) -> str | None:
    """Why `project_id` cannot travel in the Shoal-Project-Id header, or None.

    NATS clients (nats-py and nats.go alike) trim header values and turn CR and LF into
    spaces, so the member would read another id than the one the partition was computed
    from, and dead-letter the message.
    """
    if not project_id:
        return "the project id is empty"
    if project_id != project_id.strip():
        return "the project id starts or ends with whitespace, which NATS headers drop"
    if "\r" in project_id or "\n" in project_id:
        return "the project id contains CR or LF, which NATS headers cannot carry"
    return None


def parse_line(line: bytes, number: int) -> tuple[str, bytes] | None:
    """One `project_id<TAB>data` line (its end of line removed) -> (project id, data);
    None for an empty line. The data is the rest of the line, as bytes (TABs included)."""
    if not line:
        return None
    head, tab, data = line.partition(b"\t")
    if not tab:
        raise LineError(number, f"no TAB: expected {LINE_FORMAT}")
    try:
        project_id = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LineError(number, f"the project id is not UTF-8 ({exc.reason})") from None
    problem = header_problem(project_id)
    if problem:
        raise LineError(number, problem)
    return project_id, data


# A UTF-8 byte order mark, which editors on Windows put at the start of a text file: it
# is no part of the first line's project id (str.strip keeps it).
BOM = b"\xef\xbb\xbf"


async def read_lines(stream: IO[bytes], chunk: int = 1 << 16) -> AsyncIterator[tuple[int, bytes]]:
    """(line number from 1, line without its LF or CRLF) of a binary stream (a BOM at its
    start removed), read in a thread, so that publishing and acknowledgements go on while
    the input is slow (read1 returns what is there, up to `chunk`, where read would wait
    to fill it). The thread is a daemon: a Ctrl-C while the input is open and idle (a
    terminal, `tail -f`) ends the process, where a pool thread blocked in its read kept
    the interpreter from exiting until the input closed."""
    read: Callable[[int], bytes] = getattr(stream, "read1", stream.read)
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[bytes | BaseException] = asyncio.Queue()
    wanted = threading.Semaphore(0)  # one read per chunk asked for: no read-ahead

    def reader() -> None:
        while True:
            wanted.acquire()
            try:
                data: bytes | BaseException = read(chunk)
            except BaseException as exc:  # given to the reading coroutine
                data = exc
            try:
                loop.call_soon_threadsafe(chunks.put_nowait, data)
            except RuntimeError:  # the loop is closed: nobody reads any more
                return
            if not data or isinstance(data, BaseException):
                return

    threading.Thread(target=reader, name="stdin-reader", daemon=True).start()
    number = 0
    rest = b""
    while True:
        wanted.release()
        data = await chunks.get()
        if isinstance(data, BaseException):
            raise data
        if not data:
            break
        lines = (rest + data).split(b"\n")
        rest = lines.pop()
        for line in lines:
            number += 1
            yield number, _first_line(number, line).removesuffix(b"\r")
    if rest:
        yield number + 1, _first_line(number + 1, rest).removesuffix(b"\r")


def _first_line(number: int, line: bytes) -> bytes:
    return line.removeprefix(BOM) if number == 1 else line


@dataclass(frozen=True)
class Outgoing:
    project_id: str
    data: bytes
    message_id: str | None = None
    headers: dict[str, str] | None = None


class Producer:
    def __init__(self, js: Any, subject_prefix: str, partitions: int = DEFAULT_PARTITIONS) -> None:
        self.js = js
        self.subject_prefix = subject_prefix
        self.partitions = partitions

    def prepare(self, item: Outgoing) -> tuple[str, dict[str, str]]:
        """The subject and headers `item` is published with (the partition contract)."""
        partition = partition_for(item.project_id, self.partitions)  # a non-empty str
        problem = header_problem(item.project_id)
        if problem:  # it would reach the member as another id and be dead-lettered
            raise ValueError(f"{problem}: {item.project_id!r}")
        headers = dict(item.headers or {})
        headers[PROJECT_HEADER] = item.project_id
        headers[MSG_ID_HEADER] = item.message_id or uuid.uuid4().hex
        return partition_subject(self.subject_prefix, partition), headers

    async def publish(
        self,
        project_id: str,
        data: bytes,
        *,
        message_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """Publish one message and wait for JetStream's acknowledgement."""
        subject, hdrs = self.prepare(Outgoing(project_id, data, message_id, headers))
        return await self.js.publish(subject, data, headers=hdrs)

    async def publish_many(
        self,
        items: Iterable[Outgoing] | AsyncIterable[Outgoing],
        *,
        window: int = 512,
        attempts: int = 5,
    ) -> int:
        """Publish asynchronously with at most `window` unacknowledged; returns the count.

        A publish whose acknowledgement fails is retried with the same message id, so the
        retry cannot create a duplicate.
        """
        pending: set[asyncio.Task[None]] = set()
        count = 0

        async def one(item: Outgoing) -> None:
            subject, hdrs = self.prepare(item)
            for attempt in range(1, attempts + 1):
                try:
                    await self.js.publish(subject, item.data, headers=hdrs)
                    return
                except Exception as exc:
                    if attempt == attempts:
                        raise
                    log.warning("Publish to %s failed (%r); retry %d", subject, exc, attempt)
                    await asyncio.sleep(0.2 * attempt)

        async def submit(item: Outgoing) -> None:
            nonlocal count
            if len(pending) >= window:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    pending.discard(task)
                    task.result()
            task = asyncio.create_task(one(item))
            pending.add(task)
            count += 1

        if isinstance(items, AsyncIterable):
            async for item in items:
                await submit(item)
        else:
            for item in items:
                await submit(item)
        if pending:
            await asyncio.gather(*pending)
        return count
