"""Copy a group's assignment log from JetStream to date-partitioned files.

The log is the stream ``<stream>_log`` (``shoal_<namespace>_<group>_log`` by default) on
``<subjectPrefix>.log.assignments``. It is read with an ephemeral pull consumer (no acks,
deleted afterwards, and dropped by the server anyway after 30 s unused), from the first
message or from the first stored at or after ``since``, up to the last message there was
when the export started. Files are partitioned by the date each message was stored (UTC),
so the order of the files is the order of the log.

JSON lines are copied verbatim, bad ones included: the report counts and lists them.
Parquet holds typed columns (nested lists and maps for members, the assignment, moves,
hand-over times and loads) for other tools; messages that are not valid events cannot be
typed, so they are counted, logged and left out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from shoal.analytics.layout import PartWriter, part_prefix
from shoal.contracts.events import AssignmentEvent, EventError, parse_event
from shoal.contracts.names import default_stream_name, log_stream_name, parse_since

if TYPE_CHECKING:  # nats-py only where the export runs (lazily, below)
    from shoal.clients.natsauth import NatsSecurity

# parse_since: the export's --since, re-exported (its home is the contracts: `shoal-consumer
# dlq` reads its --since too).
__all__ = ["ExportError", "ExportResult", "export_log", "group_log_stream", "parse_since"]

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "parquet")


class ExportError(RuntimeError):
    """The export cannot run (the message is one line, meant for the user)."""


def group_log_stream(namespace: str, group: str, stream: str | None = None) -> str:
    """The assignment log stream of a group (its stream's name unless given)."""
    return log_stream_name(stream or default_stream_name(namespace, group))


@dataclass
class ExportResult:
    stream: str
    messages: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    rejected: list[int] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "messages": self.messages,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "rejected": len(self.rejected),
            "files": [str(p) for p in self.files],
        }


def _parquet_encoder(rejected: list[int]) -> Callable[[list[bytes], IO[bytes]], None]:
    """Encode buffered lines (each prefixed with b"<seq> <stored-at-us> ") as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def partition_map(value: Any) -> Any:
        return pa.map_(pa.int32(), value)

    schema = pa.schema(
        [
            ("seq", pa.int64()),
            ("stored_at", pa.timestamp("us", tz="UTC")),
            ("schema", pa.int32()),
            ("ts", pa.timestamp("ms", tz="UTC")),
            ("namespace", pa.string()),
            ("group", pa.string()),
            ("generation", pa.int64()),
            ("epoch", pa.int64()),
            ("leader", pa.string()),
            ("reason", pa.string()),
            ("strategy", pa.string()),
            ("members", pa.list_(pa.string())),
            ("assignment", partition_map(pa.string())),
            (
                "moved",
                pa.list_(
                    pa.struct(
                        [("partition", pa.int32()), ("from", pa.string()), ("to", pa.string())]
                    )
                ),
            ),
            ("handover_ms", partition_map(pa.float64())),
            ("loads", partition_map(pa.float64())),
        ]
    )

    def encode(lines: list[bytes], out: IO[bytes]) -> None:
        rows: list[dict[str, Any]] = []
        for framed in lines:
            seq_text, stored_text, payload = framed.split(b" ", 2)
            seq = int(seq_text)
            try:
                event = parse_event(payload)
            except EventError as exc:
                rejected.append(seq)
                log.warning("Message %d is not a valid event, left out: %s", seq, exc)
                continue
            rows.append(_parquet_row(seq, int(stored_text), event))
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), out)

    return encode


def _parquet_row(seq: int, stored_us: int, event: AssignmentEvent) -> dict[str, Any]:
    return {
        "seq": seq,
        "stored_at": datetime.fromtimestamp(stored_us / 1e6, UTC),
        "schema": event.schema_version,
        "ts": event.ts,
        "namespace": event.namespace,
        "group": event.group,
        "generation": event.generation,
        "epoch": event.epoch,
        "leader": event.leader,
        "reason": event.reason,
        "strategy": event.strategy,
        "members": event.members,
        "assignment": list(event.assignment.items()),
        "moved": [{"partition": m.partition, "from": m.from_, "to": m.to} for m in event.moved],
        "handover_ms": list(event.handover_ms.items()),
        "loads": list(event.loads.items()),
    }


async def export_log(
    *,
    nats_url: str,
    namespace: str,
    group: str,
    out: Path,
    fmt: str = "jsonl",
    since: datetime | None = None,
    stream: str | None = None,
    creds_file: str | None = None,
    security: NatsSecurity | None = None,
    connect_attempts: int = 5,
    batch: int = 500,
    max_lines: int = 20_000,
    fetch_timeout: float = 5.0,
    progress: Callable[[str], None] | None = None,
) -> ExportResult:
    """Export the group's log to ``out``; raises :class:`ExportError` when it cannot."""
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js import api
    from nats.js.errors import NotFoundError

    from shoal.clients.nats import connect
    from shoal.clients.natsauth import NatsConfigError, NatsSecurity

    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    name = group_log_stream(namespace, group, stream)
    result = ExportResult(stream=name)
    try:
        nc = await connect(
            nats_url,
            name=f"shoal-analytics-export-{namespace}-{group}",
            attempts=connect_attempts,
            security=replace(security or NatsSecurity(), creds_file=creds_file)
            if creds_file
            else security,
        )
    except (ConnectionError, NatsConfigError) as exc:  # NatsRefused is a ConnectionError
        raise ExportError(str(exc)) from None
    try:
        js = nc.jetstream()
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            raise ExportError(
                f"no assignment log for {namespace}/{group}: stream {name} does not exist on "
                f"{nats_url} (has the group run? is --stream right?)"
            ) from None
        last = int(info.state.last_seq)
        if int(info.state.messages) == 0:
            log.info("Stream %s is empty: nothing to export", name)
            return result
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.BY_START_TIME if since else api.DeliverPolicy.ALL,
            opt_start_time=since,
            inactive_threshold=30.0,
        )
        consumer = await js.add_consumer(name, config=config)
        sub = await js.pull_subscribe_bind(stream=name, consumer=consumer.name)
        pending = int(consumer.num_pending or 0)
        log.info("Exporting %d messages of stream %s to %s", pending, name, out)
        prefix = part_prefix(namespace, group)
        encode = _parquet_encoder(result.rejected) if fmt == "parquet" else None
        suffix = ".parquet" if fmt == "parquet" else ".jsonl"
        started = time.monotonic()
        try:
            with PartWriter(out, prefix, max_lines=max_lines, suffix=suffix, encode=encode) as w:
                while pending > 0:
                    try:
                        msgs = await sub.fetch(batch, timeout=fetch_timeout)
                    except (TimeoutError, NatsTimeout):
                        log.warning("No message within %.0f s; stopping early", fetch_timeout)
                        break
                    for msg in msgs:
                        meta = msg.metadata
                        seq = int(meta.sequence.stream)
                        stored: datetime = meta.timestamp
                        day: date = stored.astimezone(UTC).date()
                        # A newline can only be whitespace in valid JSON: keep one per line.
                        line = msg.data.replace(b"\r", b" ").replace(b"\n", b" ")
                        if encode is not None:
                            stored_us = int(stored.timestamp() * 1e6)
                            line = f"{seq} {stored_us} ".encode() + line
                        w.write(day, seq, line)
                        result.messages += 1
                        result.first_seq = seq if result.first_seq is None else result.first_seq
                        result.last_seq = seq
                        pending = int(meta.num_pending)
                        if seq >= last:
                            pending = 0
                    if progress is not None:
                        progress(
                            f"export: {result.messages} messages, {pending} pending "
                            f"({time.monotonic() - started:.1f} s)"
                        )
            result.files = list(w.files)
        finally:
            try:
                await sub.unsubscribe()
                await js.delete_consumer(name, consumer.name)
            except Exception as exc:  # the server drops it after inactive_threshold anyway
                log.debug("Could not delete the export consumer: %r", exc)
    finally:
        await nc.close()
    if result.rejected:
        log.warning(
            "%d messages were not valid events and are not in the Parquet files "
            "(export as jsonl to keep them)",
            len(result.rejected),
        )
    return result
