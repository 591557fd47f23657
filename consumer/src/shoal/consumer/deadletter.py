"""Messages JetStream gave up on: to the dead-letter subject, not left in the stream.

A worker dead-letters a message whose handler fails on its last delivery. One case
escapes it: the last delivery is never answered (its member was killed mid-handler, or
froze past ack_wait). JetStream then stops delivering the message and announces it on
``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<durable>``; without a listener it
would stay in the work-queue stream forever, invisible to every consumer.

The leader listens (one listener per group, so one dead letter per message). After a
grace of ``ack_wait`` (a late ack may still remove the message) it copies what is left to
``<prefix>.dlq.<partition>`` with the reason and deletes it from the stream. Advisories
are core NATS: one sent while no leader listens is missed, and the message stays.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from nats.js.errors import NotFoundError

from shoal.contracts.names import (
    DEAD_LETTER_CUT_HEADER,
    DEAD_LETTER_REASON_HEADER,
    MEMBER_HEADER,
    MSG_ID_HEADER,
    ORIGINAL_HEADERS_HEADER,
    ORIGINAL_MSG_ID_HEADER,
    ORIGINAL_SUBJECT_HEADER,
    PROJECT_HEADER,
    SEQ_HEADER,
    dlq_subject,
    subject_partition,
)
from shoal.group.config import GroupConfig
from shoal.group.jetstream import MessageDeleteError, delete_message

log = logging.getLogger(__name__)

T = TypeVar("T")

# A header name nats-py publishes (its _HEADER_KEY_RE: an HTTP token); it refuses the
# whole message (BadHeaderError) for any other.
_SENDABLE_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")

# A sweep's retries: soon at first (a blip), then every half minute (an outage).
RETRY_FIRST_SECONDS = 0.5
RETRY_MAX_SECONDS = 30.0


def dead_letter_headers(
    headers: Mapping[str, str] | None, subject: str, reason: str, member: str
) -> dict[str, str]:
    """A dead letter's headers: the original's, without its de-duplication id (the
    dead-letter stream must keep every copy), which it keeps as Shoal-Original-Msg-Id
    (a message dead-lettered again after a redrive keeps the first one), plus why, from
    where and by whom. What it cannot carry as headers goes, as JSON, into
    Shoal-Original-Headers: names NATS clients refuse to publish, and JetStream's
    publish controls (every Nats-* header but Nats-Msg-Id)."""
    out: dict[str, str] = {}
    aside: dict[str, str] = {}
    for name, value in (headers or {}).items():
        stripped = name.strip()
        if name == ORIGINAL_HEADERS_HEADER:
            aside.update(_json_object(value))  # set aside before (a redriven dead letter)
        elif not stripped:
            continue  # nats-py skips empty names: nothing to keep
        elif not _SENDABLE_NAME.fullmatch(stripped) or (
            stripped.lower().startswith("nats-") and stripped.lower() != MSG_ID_HEADER.lower()
        ):
            # As they are, the dead letter could never be written (nats-py refuses the
            # name; the dead-letter stream would check Nats-Expected-Stream against
            # itself and refuse the copy), and its project would wait for good. Kept.
            aside[name] = value
        else:
            out[name] = value
    if aside:
        out[ORIGINAL_HEADERS_HEADER] = json.dumps(aside, ensure_ascii=False)
    msg_id = out.pop(MSG_ID_HEADER, None)
    if msg_id and not out.get(ORIGINAL_MSG_ID_HEADER):
        out[ORIGINAL_MSG_ID_HEADER] = msg_id
    out[DEAD_LETTER_REASON_HEADER] = reason[:500]
    out[ORIGINAL_SUBJECT_HEADER] = subject
    out[MEMBER_HEADER] = member
    return out


def _json_object(text: str) -> dict[str, str]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return {"?": text}
    if not isinstance(value, dict):
        return {"?": text}
    return {str(k): str(v) for k, v in value.items()}


# nats-server's limit on a message's headers (JetStream refuses more: err_code 10097).
MAX_HEADER_BYTES = 65_535
# Header values longer than this are the first to be cut when a dead letter must shrink.
CUT_VALUE_CHARS = 200
# Room left for what nats-py adds or rewrites in the header block.
FIT_MARGIN = 64
# The cut note, at most (its name, ": ", 150 characters of ASCII, CRLF).
CUT_NOTE_MAX = 150
CUT_NOTE_BYTES = len(DEAD_LETTER_CUT_HEADER) + CUT_NOTE_MAX + 4


def header_bytes(headers: Mapping[str, str]) -> int:
    """The size of the header block nats-py writes for `headers` (NATS/1.0 line, one
    "Name: value" line each, the blank line)."""
    size = len(b"NATS/1.0\r\n\r\n")
    for name, value in headers.items():
        size += len(name.strip().encode()) + len(value.strip().encode()) + 4
    return size


def dead_letter_message(
    headers: Mapping[str, str] | None,
    data: bytes,
    subject: str,
    reason: str,
    member: str,
    max_payload: int,
) -> tuple[dict[str, str], bytes, str]:
    """A dead letter that the server accepts: (headers, data, what was cut, "" if
    nothing). A message near the server's limits grows past them with the dead letter's
    headers: published so, the server closes the connection (nats-py checks the data
    alone against max_payload), the member restarts and meets the message again, for
    good. So, while it does not fit: the headers set aside as JSON are dropped, then
    long header values are cut, then the data (each named in Shoal-Dead-Letter-Cut)."""
    out = dead_letter_headers(headers, subject, reason, member)
    cut: list[str] = []

    def head(note: int = CUT_NOTE_BYTES) -> int:  # with room for the cut note, nats-py's
        return header_bytes(out) + note + FIT_MARGIN

    def fits(note: int = CUT_NOTE_BYTES) -> bool:
        return head(note) <= MAX_HEADER_BYTES and head(note) + len(data) <= max_payload

    if fits(note=0):
        return out, data, ""
    if ORIGINAL_HEADERS_HEADER in out:
        dropped = out.pop(ORIGINAL_HEADERS_HEADER)
        cut.append(f"{ORIGINAL_HEADERS_HEADER} ({len(dropped.encode())} bytes)")
    if not fits():
        # Never the ones that say whose and which message it is: cut, a redrive would
        # publish it as another project's, or take it for another message.
        ours = {
            DEAD_LETTER_REASON_HEADER,
            ORIGINAL_SUBJECT_HEADER,
            MEMBER_HEADER,
            PROJECT_HEADER,
            ORIGINAL_MSG_ID_HEADER,
            SEQ_HEADER,
        }
        longest = sorted(
            (n for n in out if n not in ours and len(out[n]) > CUT_VALUE_CHARS),
            key=lambda n: -len(out[n].encode()),
        )
        for name in longest:
            cut.append(f"header {name[:40]!a} ({len(out[name].encode())} bytes)")
            out[name] = out[name][:CUT_VALUE_CHARS]
            if fits():
                break
    if not fits():
        room = max_payload - head()
        cut.append(f"the data ({len(data)} bytes, {max(room, 0)} kept)")
        data = data[: max(room, 0)]
    note = "; ".join(cut)
    if note:
        out[DEAD_LETTER_CUT_HEADER] = f"cut to fit the server's limits: {note}"[:CUT_NOTE_MAX]
    return out, data, note


ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"


def advisory_subject(stream: str) -> str:
    return f"{ADVISORY}.{stream}.*"


def parse_advisory(data: bytes) -> tuple[int, int] | None:
    """(stream sequence, deliveries) of a max-deliveries advisory; None for anything else."""
    try:
        body = json.loads(data)
        seq, deliveries = body["stream_seq"], body.get("deliveries", 0)
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    if not isinstance(seq, int) or seq < 1 or not isinstance(deliveries, int):
        return None
    return seq, deliveries


class ExhaustedMessages:
    """While this member leads: dead-letter what JetStream stopped delivering."""

    def __init__(self, config: GroupConfig, nc: Any, js: Any, leader: Any) -> None:
        self.config = config
        self.nc = nc
        self.js = js
        self.leader = leader
        self.dead_lettered = 0
        self._pending: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        sub: Any = None
        try:
            while True:
                if self.leader.is_leader and sub is None:
                    sub = await self.nc.subscribe(
                        advisory_subject(self.config.stream), cb=self._on_advisory
                    )
                elif not self.leader.is_leader and sub is not None:
                    await sub.unsubscribe()
                    sub = None
                await asyncio.sleep(1.0)
        finally:
            for task in self._pending:
                task.cancel()
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:
                    log.debug("Advisory unsubscribe failed", exc_info=True)

    async def _on_advisory(self, msg: Any) -> None:
        parsed = parse_advisory(msg.data)
        if parsed is None:
            log.warning("Ignoring a malformed max-deliveries advisory on %s", msg.subject)
            return
        task = asyncio.create_task(self._sweep(*parsed))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _sweep(self, seq: int, deliveries: int) -> None:
        """Dead-letter message `seq`, retrying what fails: the advisory is sent once, and
        JetStream never delivers the message again, so a sweep that gave up on a timeout
        (the server restarting, say) would leave it in the stream for good."""
        await asyncio.sleep(self.config.ack_wait)  # a late ack may still settle it
        stream = self.config.stream
        original = await self._until_done(
            f"read message {seq} of {stream}", lambda: self._read(seq)
        )
        if original is None:
            return  # acknowledged after all (work-queue streams delete acked messages)
        partition = subject_partition(original.subject, self.config.subject_prefix)
        if partition is None:
            log.warning(
                "Message %d of %s is on unexpected subject %s", seq, stream, original.subject
            )
            return
        reason = (
            f"not acknowledged after {deliveries} deliveries "
            f"(max_deliver {self.config.max_deliver}); JetStream stopped delivering it"
        )
        headers, data, cut = dead_letter_message(
            original.headers,
            original.data or b"",
            original.subject,
            reason,
            self.config.member_id,
            self.nc.max_payload,
        )
        if cut:
            log.error("Message %d of %s was cut to be dead-lettered: %s", seq, stream, cut)
        subject = dlq_subject(self.config.subject_prefix, partition)
        # Stored, then deleted: a retried publish may store a second copy (its ack lost),
        # never none.
        await self._until_done(
            f"dead-letter message {seq} of {stream}",
            lambda: self.js.publish(subject, data, headers=headers),
        )
        await self._until_done(
            f"delete message {seq} of {stream}", lambda: self._delete(stream, seq)
        )
        self.dead_lettered += 1
        log.warning("Dead-lettered message %d of partition %d: %s", seq, partition, reason)

    async def _read(self, seq: int) -> Any:
        """The message, or None once it is gone (acked: the work queue deleted it)."""
        try:
            return await self.js.get_msg(self.config.stream, seq)
        except NotFoundError:
            return None

    async def _until_done(self, what: str, step: Callable[[], Awaitable[T]]) -> T:
        """`step()`, again after a growing pause while it fails (until the listener
        stops, which cancels this sweep)."""
        delay = RETRY_FIRST_SECONDS
        for attempt in itertools.count(1):
            try:
                return await step()
            except Exception as exc:
                log.warning(
                    "Could not %s (attempt %d): %r; again in %.1f s", what, attempt, exc, delay
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_SECONDS)
        raise AssertionError("unreachable")

    async def _delete(self, stream: str, seq: int) -> None:
        try:
            await delete_message(self.nc, self.config.nats_js_api_prefix, stream, seq)
        except MessageDeleteError as exc:
            if exc.code != MessageDeleteError.NO_MESSAGE:  # gone already: done
                raise
