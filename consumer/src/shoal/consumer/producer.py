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
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

from nats.errors import BadSubjectError, MaxPayloadError

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

# The longest line read_lines takes when it is not told the server's max_payload (a
# longer line could not be published anyway: NATS's max_payload is 1 MiB by default and
# cannot exceed max_pending, 64 MiB by default).
MAX_LINE = 128 << 20


class LineError(ValueError):
    """A line of `produce --stdin` input that is not a message; says which line."""

    def __init__(self, number: int, problem: str) -> None:
        super().__init__(f"line {number}: {problem}")
        self.number = number


class MessageTooLarge(ValueError):
    """A message whose headers and data together exceed the server's max_payload: the
    server would refuse it (and close the connection), however often it is retried."""

    def __init__(self, size: int, data: int, max_payload: int) -> None:
        super().__init__(
            f"the message is {size} bytes with its headers ({data} bytes of data), over the "
            f"NATS server's max_payload of {max_payload} bytes"
        )
        self.size = size
        self.max_payload = max_payload


def encoded_size(headers: dict[str, str], data: bytes) -> int:
    """The bytes the server counts against max_payload: the headers as nats-py encodes
    them (`NATS/1.0`, then `Key: value` lines, trimmed) plus the data."""
    size = len(b"NATS/1.0\r\n\r\n")
    for key, value in headers.items():
        if key.strip():
            size += len(key.strip().encode()) + len(value.strip().encode()) + 4
    return size + len(data)


def default_run_id() -> str:
    """The default run id: the millisecond clock and 6 random hex digits, as in
    `1764316800000_3f9a1c`, so that two runs started in the same millisecond do not share
    message ids (JetStream would drop the second one's as duplicates). No `-` in it, so a
    message id RUN-PROJECT-N still splits at its first `-` into the run id."""
    return f"{int(time.time() * 1000)}_{secrets.token_hex(3)}"


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


async def read_lines(
    stream: IO[bytes], chunk: int = 1 << 16, max_line: int = MAX_LINE
) -> AsyncIterator[tuple[int, bytes]]:
    """(line number from 1, line without its LF or CRLF) of a binary stream (a BOM at its
    start removed), read in a thread, so that publishing and acknowledgements go on while
    the input is slow (read1 returns what is there, up to `chunk`, where read would wait
    to fill it). The thread is a daemon: a Ctrl-C while the input is open and idle (a
    terminal, `tail -f`) ends the process, where a pool thread blocked in its read kept
    the interpreter from exiting until the input closed.

    A line longer than `max_line` bytes (`produce` passes the server's max_payload: a
    longer line cannot be published) raises LineError as soon as that many bytes of it
    are read, rather than being held in memory whole. Each chunk is searched once for
    its line ends, so a long line costs time in proportion to its length."""
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
    rest: list[bytes] = []  # the pieces of the line being read, without a LF
    held = 0  # their bytes
    while True:
        wanted.release()
        data = await chunks.get()
        if isinstance(data, BaseException):
            raise data
        if not data:
            break
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            line = b"".join([*rest, data[start:end]]) if rest else data[start:end]
            rest, held, start = [], 0, end + 1
            number += 1
            yield number, _line(number, line, max_line)
        if start < len(data):
            rest.append(data[start:])
            held += len(data) - start
            if held > max_line + len(BOM) + 1:  # too long, whatever it ends with
                raise LineError(number + 1, _too_long(max_line))
    if rest:
        yield number + 1, _line(number + 1, b"".join(rest), max_line)


def _line(number: int, line: bytes, max_line: int) -> bytes:
    """A line without its CR and (first line) BOM; LineError if over max_line bytes."""
    line = (line.removeprefix(BOM) if number == 1 else line).removesuffix(b"\r")
    if len(line) > max_line:
        raise LineError(number, _too_long(max_line))
    return line


def _too_long(max_line: int) -> str:
    return f"the line is over {max_line} bytes, more than a message can carry"


@dataclass(frozen=True)
class Outgoing:
    project_id: str
    data: bytes
    message_id: str | None = None
    headers: dict[str, str] | None = None


class Producer:
    """Publishes to the partition subjects. `max_payload`: the server's, which headers
    and data together may not exceed (default: the one the connection of `js` was told).
    `acknowledged` counts the publishes JetStream acknowledged, `duplicates` those of them
    it dropped as duplicates (a message id it already had, within its duplicate window)."""

    def __init__(
        self,
        js: Any,
        subject_prefix: str,
        partitions: int = DEFAULT_PARTITIONS,
        max_payload: int | None = None,
    ) -> None:
        self.js = js
        self.subject_prefix = subject_prefix
        self.partitions = partitions
        self.max_payload = max_payload
        self.acknowledged = 0
        self.duplicates = 0

    def payload_limit(self) -> int | None:
        """The server's max_payload, if known."""
        if self.max_payload is not None:
            return self.max_payload
        limit = getattr(getattr(self.js, "_nc", None), "max_payload", None)
        return limit if isinstance(limit, int) else None

    def prepare(self, item: Outgoing) -> tuple[str, dict[str, str]]:
        """The subject and headers `item` is published with (the partition contract).
        ValueError (MessageTooLarge) for a message the server would refuse as too large."""
        partition = partition_for(item.project_id, self.partitions)  # a non-empty str
        problem = header_problem(item.project_id)
        if problem:  # it would reach the member as another id and be dead-lettered
            raise ValueError(f"{problem}: {item.project_id!r}")
        headers = dict(item.headers or {})
        headers[PROJECT_HEADER] = item.project_id
        if item.message_id or not headers.get(MSG_ID_HEADER):  # else the caller's own
            headers[MSG_ID_HEADER] = item.message_id or uuid.uuid4().hex
        limit = self.payload_limit()
        if limit is not None and (size := encoded_size(headers, item.data)) > limit:
            raise MessageTooLarge(size, len(item.data), limit)
        return partition_subject(self.subject_prefix, partition), headers

    def _count(self, ack: Any) -> Any:
        self.acknowledged += 1
        if getattr(ack, "duplicate", False):
            self.duplicates += 1
        return ack

    async def publish(
        self,
        project_id: str,
        data: bytes,
        *,
        message_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """Publish one message and wait for JetStream's acknowledgement (its PubAck says
        whether it was a duplicate). A Nats-Msg-Id in `headers` is kept unless
        `message_id` is given; without either, the message gets a random one."""
        subject, hdrs = self.prepare(Outgoing(project_id, data, message_id, headers))
        return self._count(await self.js.publish(subject, data, headers=hdrs))

    async def publish_many(
        self,
        items: Iterable[Outgoing] | AsyncIterable[Outgoing],
        *,
        window: int = 512,
        attempts: int = 5,
    ) -> int:
        """Publish asynchronously with at most `window` unacknowledged; returns the count.

        A publish whose acknowledgement fails is retried with the same message id, so the
        retry cannot create a duplicate; one the server refuses (too large, a bad subject)
        is not retried. `duplicates` counts those JetStream dropped as duplicates.
        """
        pending: set[asyncio.Task[None]] = set()
        count = 0

        async def one(item: Outgoing) -> None:
            subject, hdrs = self.prepare(item)
            for attempt in range(1, attempts + 1):
                try:
                    self._count(await self.js.publish(subject, item.data, headers=hdrs))
                    return
                except (MaxPayloadError, BadSubjectError, ValueError):
                    raise  # the same publish again fails the same way
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
