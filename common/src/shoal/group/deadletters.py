"""A group's dead letters: read, summed up, redriven to their partitions, purged.

Where they are. A member dead-letters a message (its handler raised PermanentError,
failed ``maxDeliver`` attempts, or the message broke a rule: no project id, the wrong
partition), and the leader one JetStream stopped delivering (shoal.consumer.deadletter),
by publishing a copy to ``<prefix>.dlq.<partition>`` (names.dlq_subject) and then
terminating (or deleting) the original. The copy has the original's data and headers
(its project id, Shoal-Seq, ...; its Nats-Msg-Id moved to Shoal-Original-Msg-Id) plus
Shoal-Dead-Letter-Reason, Shoal-Original-Subject and Shoal-Member
(shoal.consumer.deadletter.dead_letter_headers). One stream per group captures them:
``<stream>_dlq`` on ``<prefix>.dlq.*`` (names.dlq_stream_name, dlq_subjects), created with
the group's stream (jetstream.ensure_group) with limits retention and no limits, so a
dead letter stays until it is redriven or purged.

This module is `shoal-consumer dlq` (list, show, redrive, purge) and the operator's
status.deadLetters. Its first half is pure (which dead letters a selection takes, the
summary, per-project order, the subject and headers of a redriven message, the progress
line), tested without servers; the second half reads the stream through an ephemeral
consumer (no acks), republishes and deletes.

A redrive republishes each dead letter to its partition subject, with its original
headers, Shoal-Redriven-From (its sequence in the dead-letter stream) and Nats-Msg-Id
``redrive-<dead-letter stream>-<sequence>``, and deletes it from the dead-letter stream
only once JetStream acknowledged the republish. A project's dead letters go one after
another, in dead-letter stream order (the next is published once the one before is
acknowledged), projects side by side in lanes. Interrupted anywhere and run again, it
moves only what is still there; one republished but not yet deleted (the process died in
between) is published again with the same Nats-Msg-Id, which the partition stream's
duplicate window (120 s, jetstream.ensure_group) drops: a run again within that window
duplicates nothing; later, at most those in flight when it died (one per lane) would run
twice. A redriven message is a new message at the end of its partition: it runs after
what its project published since it was dead-lettered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from shoal.contracts.names import (
    DEAD_LETTER_CUT_HEADER,
    DEAD_LETTER_REASON_HEADER,
    MEMBER_HEADER,
    MSG_ID_HEADER,
    ORIGINAL_HEADERS_HEADER,
    ORIGINAL_MSG_ID_HEADER,
    ORIGINAL_SUBJECT_HEADER,
    PROJECT_HEADER,
    REDRIVEN_FROM_HEADER,
    decimal,
    format_time,
    partition_subject,
    subject_partition,
)
from shoal.group.config import GroupConfig
from shoal.group.jetstream import MessageDeleteError, delete_message

log = logging.getLogger(__name__)
_K = TypeVar("_K", str, str | None)

#: The partition stream's duplicate window (jetstream.ensure_group): a redrive run again
#: within it never publishes one dead letter twice.
DUPLICATE_WINDOW = 120.0
#: What a headers-only read adds: the size of the data it left out.
_SIZE_HEADER = "Nats-Msg-Size"
#: Headers a dead letter has that its original did not: a redrive leaves them out.
DEAD_LETTER_ONLY = (
    DEAD_LETTER_REASON_HEADER,
    ORIGINAL_SUBJECT_HEADER,
    MEMBER_HEADER,
    # What the original carried that a message cannot (names nats-py refuses, JetStream's
    # publish controls, checked once already): shown by `dlq show`, not published again.
    ORIGINAL_HEADERS_HEADER,
    DEAD_LETTER_CUT_HEADER,
)

# -- the pure half ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DeadLetter:
    seq: int  # its sequence in the dead-letter stream
    subject: str  # <prefix>.dlq.<partition>
    time: float  # when the dead-letter stream stored it (Unix seconds)
    headers: Mapping[str, str]
    data: bytes = b""
    size: int = 0  # bytes of data (a headers-only read has the size, not the data)

    @property
    def project(self) -> str | None:
        return self.headers.get(PROJECT_HEADER) or None

    @property
    def reason(self) -> str:
        return self.headers.get(DEAD_LETTER_REASON_HEADER, "")

    def partition(self, prefix: str) -> int | None:
        """The partition of its dead-letter subject, `<prefix>.dlq.<p>`."""
        return subject_partition(self.subject, f"{prefix}.dlq")

    def as_dict(self, prefix: str) -> dict[str, Any]:
        """What `dlq show --json` prints of it: the data as text if it is UTF-8, else
        as base64 (data_base64)."""
        out: dict[str, Any] = {
            "seq": self.seq,
            "time": format_time(self.time),
            "subject": self.subject,
            "partition": self.partition(prefix),
            "project": self.project,
            "reason": self.reason,
            "headers": dict(self.headers),
            "size": self.size,
        }
        try:
            out["data"] = self.data.decode("utf-8")
        except UnicodeDecodeError:
            import base64

            out["data_base64"] = base64.b64encode(self.data).decode("ascii")
        return out


NO_REASON = "(no reason)"
# worker.py's reason when a handler's retries ran out: "failed N times, last: <repr>".
_RETRIED = re.compile(r"^(failed \d+ times, last: [A-Za-z_][\w.]*)")


def reason_kind(reason: str) -> str:
    """What `dlq list` counts by: a reason up to its first ": ", since what follows names
    the message ("permanent error: order 42 has no customer" is a "permanent error";
    "failed 5 times, last: TimeoutError()" is "failed 5 times, last"), at most 100
    characters; NO_REASON for a dead letter without one. A handler's retries run out
    with "failed 5 times, last: TimeoutError()": its kind keeps the exception's type,
    "failed 5 times, last: TimeoutError" (the count alone would put every failure in
    one bucket, and a cut before the type read "failed 5 times, last")."""
    retried = _RETRIED.match(reason)
    if retried:
        return retried.group(1)
    head = reason.split(": ", 1)[0].strip()
    if not head:
        return NO_REASON
    return head if len(head) <= 100 else head[:99] + "…"


@dataclass(frozen=True)
class Selection:
    """Which dead letters a command takes: all of them, or those of one project, whose
    reason contains a text (case-insensitive), stored at or after a time; all must hold."""

    project: str | None = None
    reason: str | None = None
    since: float | None = None  # Unix seconds

    @property
    def everything(self) -> bool:
        return self.project is None and not self.reason and self.since is None

    def matches(self, letter: DeadLetter) -> bool:
        if self.project is not None and letter.project != self.project:
            return False
        if self.reason and self.reason.casefold() not in letter.reason.casefold():
            return False
        return self.since is None or letter.time >= self.since

    def describe(self) -> str:
        """For messages: "" for everything, else " of project 'x', reason ~ 'y', ..."."""
        parts = []
        if self.project is not None:
            parts.append(f"of project {self.project!r}")
        if self.reason:
            parts.append(f"whose reason contains {self.reason!r}")
        if self.since is not None:
            parts.append(f"since {format_time(self.since)}")
        return (" " + ", ".join(parts)) if parts else ""


@dataclass
class Summary:
    """`dlq list`: how many, how big, by reason (reason_kind) and by project, the oldest
    and the newest."""

    count: int = 0
    bytes: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)
    by_project: Counter[str | None] = field(default_factory=Counter)
    oldest: DeadLetter | None = None
    newest: DeadLetter | None = None

    def add(self, letter: DeadLetter) -> None:
        self.count += 1
        self.bytes += letter.size
        self.by_reason[reason_kind(letter.reason)] += 1
        self.by_project[letter.project] += 1
        if self.oldest is None or (letter.time, letter.seq) < (self.oldest.time, self.oldest.seq):
            self.oldest = letter
        if self.newest is None or (letter.time, letter.seq) > (self.newest.time, self.newest.seq):
            self.newest = letter

    def as_dict(self) -> dict[str, Any]:
        def end(letter: DeadLetter | None) -> dict[str, Any] | None:
            if letter is None:
                return None
            return {"seq": letter.seq, "time": format_time(letter.time), "project": letter.project}

        return {
            "count": self.count,
            "bytes": self.bytes,
            "by_reason": [{"reason": r, "count": n} for r, n in ranked(self.by_reason)],
            "by_project": [{"project": p, "count": n} for p, n in ranked(self.by_project)],
            "oldest": end(self.oldest),
            "newest": end(self.newest),
        }


def ranked(counts: Mapping[_K, int]) -> list[tuple[_K, int]]:
    """Most first; ties by name (no project, None, last)."""
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0] is None, kv[0] or ""))


def summarize(letters: Iterable[DeadLetter]) -> Summary:
    summary = Summary()
    for letter in letters:
        summary.add(letter)
    return summary


def by_project(letters: Iterable[DeadLetter]) -> dict[str | None, list[DeadLetter]]:
    """Each project's dead letters in dead-letter stream order; projects in the order of
    their first dead letter (dead letters without a project id are one "project", None)."""
    out: dict[str | None, list[DeadLetter]] = {}
    for letter in sorted(letters, key=lambda dl: dl.seq):
        out.setdefault(letter.project, []).append(letter)
    return out


def redrive_subject(letter: DeadLetter, prefix: str) -> str:
    """Where a redrive publishes a dead letter: the partition subject it came from
    (Shoal-Original-Subject), else the one its dead-letter subject names. ValueError if
    neither is a partition subject of `prefix`, or if the dead letter was cut to fit the
    server's limits (Shoal-Dead-Letter-Cut): its data or headers are not the message's,
    and a handler given them would take them for the message."""
    cut = letter.headers.get(DEAD_LETTER_CUT_HEADER)
    if cut:
        raise ValueError(
            f"dead letter {letter.seq} is not the whole message ({cut}); not redriven "
            "(see it with `shoal-consumer dlq show`)"
        )
    original = letter.headers.get(ORIGINAL_SUBJECT_HEADER, "")
    if subject_partition(original, prefix) is not None:
        return original
    partition = letter.partition(prefix)
    if partition is None:
        raise ValueError(
            f"dead letter {letter.seq} on {letter.subject} names no partition of {prefix} "
            f"(Shoal-Original-Subject {original!r})"
        )
    return partition_subject(prefix, partition)


def redrive_msg_id(dlq_stream: str, seq: int) -> str:
    """The Nats-Msg-Id of a redriven message: the same for every run of a redrive, so
    the partition stream drops a second publish within its duplicate window."""
    return f"redrive-{dlq_stream}-{seq}"


def redrive_headers(letter: DeadLetter, dlq_stream: str) -> dict[str, str]:
    """A redriven message's headers: the original's (project id, Shoal-Seq, the
    original's id in Shoal-Original-Msg-Id, ...), without what dead-lettering added,
    plus Shoal-Redriven-From and the redrive's Nats-Msg-Id."""
    out = {k: v for k, v in letter.headers.items() if k not in DEAD_LETTER_ONLY}
    out.pop(_SIZE_HEADER, None)
    out[REDRIVEN_FROM_HEADER] = str(letter.seq)
    out[MSG_ID_HEADER] = redrive_msg_id(dlq_stream, letter.seq)
    return out


def original_msg_id(letter: DeadLetter) -> str | None:
    return letter.headers.get(ORIGINAL_MSG_ID_HEADER)


class Progress:
    """A progress line, written at most every `every` seconds (and once at the end)."""

    def __init__(
        self,
        verb: str,
        total: int,
        write: Callable[[str, bool], None],
        *,
        every: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.verb = verb
        self.total = total
        self.write = write  # (line, final)
        self.every = every
        self.clock = clock
        self.started = clock()
        self._last: float | None = None

    def update(self, done: int, *, final: bool = False) -> None:
        now = self.clock()
        if not final and self._last is not None and now - self._last < self.every:
            return
        if not final and self._last is None and now - self.started < self.every:
            return
        self._last = now
        self.write(self.line(done, now - self.started), final)

    def line(self, done: int, elapsed: float) -> str:
        share = f" ({100 * done / self.total:.0f}%)" if self.total else ""
        rate = f", {done / elapsed:,.0f}/s" if elapsed > 0 else ""
        return f"{self.verb} {done:,} of {self.total:,}{share} in {elapsed:.1f} s{rate}"


# -- the I/O half ----------------------------------------------------------------------------


class DeadLetterError(RuntimeError):
    """A dead-letter command cannot run (one line, for the user)."""


async def dead_letter_stream(js: Any, config: GroupConfig) -> Any:
    """The group's dead-letter stream's info; DeadLetterError if the group has none or
    there is no such group (no partition stream either)."""
    from nats.js.errors import NotFoundError

    try:
        return await js.stream_info(config.dlq_stream)
    except NotFoundError:
        pass
    group = f"{config.namespace}/{config.group}"
    try:
        await js.stream_info(config.stream)
    except NotFoundError:
        raise DeadLetterError(
            f"unknown group {group}: no stream {config.stream} on this NATS server (are "
            "--group and --namespace right? --stream, if it has another name?)"
        ) from None
    raise DeadLetterError(
        f"group {group} has no dead letters stream: {config.dlq_stream} does not exist "
        f"(the operator, or a member with SHOAL_ENSURE_JETSTREAM, creates it with "
        f"{config.stream})"
    )


async def dead_letter_count(js: Any, config: GroupConfig) -> int | None:
    """Messages in the group's dead-letter stream (one STREAM.INFO: the stream is the
    group's own), None if it has none. The operator's status.deadLetters."""
    from nats.js.errors import NotFoundError

    try:
        info = await js.stream_info(config.dlq_stream)
    except NotFoundError:
        return None
    return int(info.state.messages)


def _letter(msg: Any, headers_only: bool) -> DeadLetter:
    meta = msg.metadata
    headers = dict(msg.headers or {})
    data = msg.data or b""
    size = len(data)
    if headers_only:
        raw = headers.pop(_SIZE_HEADER, "0")
        size = decimal(raw) or 0
        data = b""
    stored: datetime = meta.timestamp
    return DeadLetter(
        seq=int(meta.sequence.stream),
        subject=msg.subject,
        time=stored.timestamp(),
        headers=headers,
        data=data,
        size=size,
    )


async def read(
    js: Any,
    config: GroupConfig,
    selection: Selection = Selection(),
    *,
    headers_only: bool = False,
    until_seq: int | None = None,
    batch: int = 1000,
    fetch_timeout: float = 5.0,
) -> AsyncGenerator[list[DeadLetter], None]:
    """The dead letters `selection` takes, in stream order, a batch at a time, up to the
    stream's last message when the read began (or `until_seq`): dead letters that arrive
    meanwhile are left for the next command. Through an ephemeral consumer without acks
    (deleted at the end; the server drops it after two idle minutes anyway). Use with
    contextlib.aclosing when breaking out early."""
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js import api

    info = await dead_letter_stream(js, config)
    last = int(info.state.last_seq) if until_seq is None else until_seq
    if not int(info.state.messages) or last < int(info.state.first_seq):
        return
    since = selection.since
    consumer = await js.add_consumer(
        config.dlq_stream,
        config=api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.BY_START_TIME if since else api.DeliverPolicy.ALL,
            opt_start_time=datetime.fromtimestamp(since, UTC) if since else None,
            headers_only=headers_only or None,
            inactive_threshold=120.0,
            num_replicas=1,
            mem_storage=True,
        ),
    )
    try:
        if not int(consumer.num_pending or 0):
            return
        sub = await js.pull_subscribe_bind(stream=config.dlq_stream, consumer=consumer.name)
        try:
            done = False
            quiet = 0
            while not done:
                try:
                    msgs = await sub.fetch(batch, timeout=fetch_timeout)
                    quiet = 0
                except (TimeoutError, NatsTimeout):
                    # Nothing more (deleted meanwhile), or NATS away for a moment: a
                    # list cut short without a word would read as complete.
                    quiet += 1
                    if not await _more_pending(js, config.dlq_stream, consumer.name, quiet):
                        break
                    continue
                taken: list[DeadLetter] = []
                for msg in msgs:
                    letter = _letter(msg, headers_only)
                    if letter.seq > last:
                        done = True
                        break
                    if selection.matches(letter):
                        taken.append(letter)
                    if letter.seq >= last or not int(msg.metadata.num_pending):
                        done = True
                if taken:
                    yield taken
        finally:
            try:
                await sub.unsubscribe()
            except Exception as exc:
                log.debug("Could not unsubscribe the dead-letter reader: %r", exc)
    finally:
        try:
            await js.delete_consumer(config.dlq_stream, consumer.name)
        except Exception as exc:  # the server drops it after inactive_threshold anyway
            log.debug("Could not delete the dead-letter reader's consumer: %r", exc)


# Fetches in a row that time out while the reader's consumer still has dead letters
# pending before the read gives up (with an error: the listing would be incomplete).
FETCH_ATTEMPTS = 3


async def _more_pending(js: Any, stream: str, consumer: str, quiet: int) -> bool:
    """After a fetch timed out: whether to fetch again (dead letters still pending).
    Raises DeadLetterError when NATS does not answer, or the attempts are spent."""
    from nats.errors import TimeoutError as NatsTimeout

    try:
        info = await js.consumer_info(stream, consumer)
    except (TimeoutError, NatsTimeout) as exc:
        raise DeadLetterError(
            "NATS stopped answering while the dead letters were read: what was read is "
            "incomplete; run the command again"
        ) from exc
    if not int(info.num_pending or 0):
        return False
    if quiet >= FETCH_ATTEMPTS:
        raise DeadLetterError(
            f"{info.num_pending} dead letters are still to read, but {quiet} reads in a "
            "row brought none: what was read is incomplete; run the command again"
        )
    return True


async def scan(
    js: Any,
    config: GroupConfig,
    selection: Selection = Selection(),
    *,
    headers_only: bool = True,
    limit: int | None = None,
    until_seq: int | None = None,
) -> list[DeadLetter]:
    """The first `limit` (all, if None) dead letters `selection` takes, in stream order."""
    out: list[DeadLetter] = []
    if limit is not None and limit <= 0:
        return out
    reader = read(js, config, selection, headers_only=headers_only, until_seq=until_seq)
    async with aclosing(reader) as batches:
        async for letters in batches:
            out.extend(letters)
            if limit is not None and len(out) >= limit:
                del out[limit:]
                break
    return out


@dataclass
class RedriveResult:
    selected: int = 0  # the dead letters the redrive was to move
    moved: int = 0  # republished, acknowledged and deleted from the dead letters
    # Of those, how many JetStream already had (an earlier run died between the
    # republish and the delete): acknowledged as duplicates, not published twice.
    duplicates: int = 0
    # (dead-letter sequence, why): not moved, or moved but still in the dead letters.
    failed: list[tuple[int, str]] = field(default_factory=list)
    # Later dead letters of a project whose earlier one failed: kept for its order.
    held_back: int = 0
    stopped: bool = False  # interrupted (Ctrl-C) before it was done
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.moved / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "selected": self.selected,
            "moved": self.moved,
            "duplicates": self.duplicates,
            "failed": [{"seq": s, "error": e} for s, e in self.failed],
            "held_back": self.held_back,
            "stopped": self.stopped,
            "seconds": round(self.seconds, 3),
            "per_second": round(self.rate, 1),
        }


class Redrive:
    """Move dead letters back to their partitions (see the module docstring).

    `lanes` projects at a time, each one message after another; dead letters are read
    `chunk` at a time, and a chunk is done before the next is read, so every project's
    dead letters go in stream order with bounded memory. `stop` (an Event, set by Ctrl-C)
    ends it after the messages in flight; so does `stop_after` moved messages (a test
    hook).
    """

    RETRIES = 3

    def __init__(
        self,
        nc: Any,
        js: Any,
        config: GroupConfig,
        selection: Selection = Selection(),
        *,
        limit: int | None = None,
        lanes: int = 64,
        chunk: int = 5000,
        stop: asyncio.Event | None = None,
        stop_after: int | None = None,
        progress: Callable[[int], None] | None = None,
        retry_delay: float = 0.5,
    ) -> None:
        self.nc, self.js, self.config = nc, js, config
        self.selection = selection
        self.limit = limit
        self.lanes = max(1, lanes)
        self.chunk = max(1, chunk)
        self.stop = stop or asyncio.Event()
        self.stop_after = stop_after
        self.progress = progress
        self.retry_delay = retry_delay
        self.result = RedriveResult()
        self._blocked: set[str | None] = set()  # projects with a failed dead letter

    async def count(self, until_seq: int) -> int:
        """How many dead letters this redrive is to move (a headers-only scan when the
        selection is not everything)."""
        if self.selection.everything:
            info = await dead_letter_stream(self.js, self.config)
            total = int(info.state.messages)
        else:
            letters = await scan(
                self.js, self.config, self.selection, limit=self.limit, until_seq=until_seq
            )
            total = len(letters)
        return total if self.limit is None else min(total, self.limit)

    async def run(self, until_seq: int | None = None) -> RedriveResult:
        started = time.monotonic()
        if until_seq is None:
            until_seq = int((await dead_letter_stream(self.js, self.config)).state.last_seq)
        self.result.selected = await self.count(until_seq)
        pending: list[DeadLetter] = []
        taken = 0
        reader = read(self.js, self.config, self.selection, until_seq=until_seq)
        async with aclosing(reader) as batches:
            async for letters in batches:
                if self.limit is not None:
                    letters = letters[: self.limit - taken]
                taken += len(letters)
                pending.extend(letters)
                if len(pending) >= self.chunk:
                    await self._chunk(pending)
                    pending = []
                if self.stop.is_set() or (self.limit is not None and taken >= self.limit):
                    break
        if pending and not self.stop.is_set():
            await self._chunk(pending)
        self.result.stopped = self.stop.is_set() and self.result.moved < self.result.selected
        self.result.seconds = time.monotonic() - started
        return self.result

    async def _chunk(self, letters: list[DeadLetter]) -> None:
        queues = deque(by_project(letters).items())

        async def lane() -> None:
            while queues and not self.stop.is_set():
                project, items = queues.popleft()
                if project in self._blocked:
                    self.result.held_back += len(items)
                    continue
                for i, letter in enumerate(items):
                    if self.stop.is_set():
                        return
                    if not await self._move(letter):
                        self._blocked.add(project)
                        self.result.held_back += len(items) - i - 1
                        break

        await asyncio.gather(*(lane() for _ in range(min(self.lanes, len(queues)))))

    async def _move(self, letter: DeadLetter) -> bool:
        """Republish one dead letter, then delete it; False if it could not be
        republished (the project's later dead letters then stay, for its order)."""
        dlq = self.config.dlq_stream
        try:
            subject = redrive_subject(letter, self.config.subject_prefix)
        except ValueError as exc:
            self.result.failed.append((letter.seq, str(exc)))
            return False
        headers = redrive_headers(letter, dlq)
        ack: Any = None
        for attempt in range(1, self.RETRIES + 1):
            try:
                ack = await self.js.publish(subject, letter.data, headers=headers, timeout=5)
                break
            except Exception as exc:  # timeouts, no responders, a full stream, ...
                if attempt == self.RETRIES:
                    self.result.failed.append(
                        (letter.seq, f"could not republish to {subject}: {exc!r}")
                    )
                    return False
                await asyncio.sleep(self.retry_delay * attempt)
        if ack is not None and ack.duplicate:
            self.result.duplicates += 1
        for attempt in range(1, self.RETRIES + 1):
            try:
                await delete_message(self.nc, self.config.nats_js_api_prefix, dlq, letter.seq)
                break
            except MessageDeleteError as exc:
                if exc.code == MessageDeleteError.NO_MESSAGE:
                    break  # gone already (purged meanwhile): nothing left to do
                error: Exception = exc
            except Exception as exc:
                error = exc
            if attempt == self.RETRIES:
                # Republished, in order: the project goes on; a run again within the
                # duplicate window will not publish it twice.
                self.result.failed.append(
                    (
                        letter.seq,
                        f"republished to {subject} but not deleted from {dlq}: {error!r}",
                    )
                )
                self._moved()
                return True
            await asyncio.sleep(self.retry_delay * attempt)
        self._moved()
        return True

    def _moved(self) -> None:
        self.result.moved += 1
        if self.progress is not None:
            self.progress(self.result.moved)
        if self.stop_after is not None and self.result.moved >= self.stop_after:
            self.stop.set()


async def purge(
    nc: Any,
    js: Any,
    config: GroupConfig,
    selection: Selection = Selection(),
    *,
    limit: int | None = None,
    until_seq: int,
    lanes: int = 64,
) -> int:
    """Delete the dead letters `selection` takes (the first `limit`), up to `until_seq`
    (the last one the user was shown a count of); how many were deleted. Everything:
    one STREAM.PURGE; a selection: one delete each."""
    if selection.everything and limit is None:
        request = json.dumps({"seq": until_seq + 1}).encode()
        api = config.nats_js_api_prefix
        reply = await nc.request(f"{api}.STREAM.PURGE.{config.dlq_stream}", request, timeout=10)
        answer = json.loads(reply.data)
        if answer.get("error"):
            raise DeadLetterError(f"could not purge {config.dlq_stream}: {answer['error']}")
        return int(answer.get("purged", 0))
    letters = await scan(js, config, selection, limit=limit, until_seq=until_seq)
    sem = asyncio.Semaphore(lanes)
    deleted = 0

    async def delete(letter: DeadLetter) -> None:
        nonlocal deleted
        async with sem:
            try:
                await delete_message(nc, config.nats_js_api_prefix, config.dlq_stream, letter.seq)
            except MessageDeleteError as exc:
                if exc.code != MessageDeleteError.NO_MESSAGE:
                    raise
                return
            deleted += 1

    await asyncio.gather(*(delete(letter) for letter in letters))
    return deleted
