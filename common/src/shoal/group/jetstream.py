"""The JetStream objects of a group: the partition stream, its durables, DLQ and ledger.

Idempotent: creating what exists with the same config is a no-op, so every member (and
later the operator) may call `ensure_group` at start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any

from nats.js import api
from nats.js.errors import APIError, BadRequestError, NotFoundError

from shoal.contracts.names import (
    assignments_subject,
    dlq_subjects,
    durable_name,
    ledger_subjects,
    partition_subject,
    stream_subjects,
)
from shoal.group.config import GroupConfig

log = logging.getLogger(__name__)

_RETENTION = {
    "workqueue": api.RetentionPolicy.WORK_QUEUE,
    "limits": api.RetentionPolicy.LIMITS,
    "interest": api.RetentionPolicy.INTEREST,
}
_STORAGE = {"file": api.StorageType.FILE, "memory": api.StorageType.MEMORY}


def consumer_config(config: GroupConfig, partition: int) -> api.ConsumerConfig:
    return api.ConsumerConfig(
        durable_name=durable_name(partition),
        filter_subject=partition_subject(config.subject_prefix, partition),
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=config.ack_wait,
        max_ack_pending=config.max_ack_pending,
        # Unlimited: the members count attempts themselves (partition.py, credits), because
        # JetStream counts every delivery, and each hand-over gives unstarted messages
        # back with a nak, a delivery that was no attempt. With JetStream's limit at
        # max_deliver, a message moved k times had max_deliver - k attempts left, and
        # one moved often enough was stranded by moves alone.
        max_deliver=-1,
        # No backoff on the durable: with one, JetStream uses its first step as the
        # ack_wait of every first delivery. The backoff is the member's: it spaces the
        # in-place retries (and, with NakAndContinue, the delays of its naks); JetStream
        # redelivers only what a member failed to settle, after ack_wait.
        backoff=None,
        max_waiting=64,
        num_replicas=config.stream_replicas,
        # A work-queue stream deletes each message once it is acked, so the stream itself
        # records what is done: the durable's state can live in memory. On disk,
        # nats-server rewrites it (a new file, renamed over the old) up to 10 times a
        # second per busy durable; with 128 partitions that was about half the server's
        # CPU, and on a host where creating files is slow its acks came later than
        # ack_wait (docs/data-path.md). After a restart of a lone server such a durable
        # is gone; the members recreate it, and it delivers what the stream still holds.
        mem_storage=True if config.retention == "workqueue" else None,
    )


# The stream's metadata key holding the group's partition count.
PARTITIONS_METADATA = "shoal.partitions"


def stream_partitions(info: Any) -> int | None:
    """The partition count a group's stream records (PARTITIONS_METADATA), or None: a
    stream of an older Shoal, or a value that is no count."""
    value = (getattr(info.config, "metadata", None) or {}).get(PARTITIONS_METADATA)
    return int(value) if isinstance(value, str) and value.isdigit() and int(value) > 0 else None


async def recorded_partitions(js: Any, stream: str) -> int | None:
    """The partition count `stream` records (stream_partitions); None: no such stream
    yet, or one of an older Shoal (no metadata). Errors other than a missing stream (no
    answer, no permission) are raised."""
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        return None
    return stream_partitions(info)


class PartitionCountMismatch(RuntimeError):
    """A member given another partition count than its group's stream records: it would
    take partitions its count names and no others (with fewer, the rest are consumed by
    nobody; with more, it waits on partitions nobody publishes to), and rewrite the
    stream's count for every producer."""

    def __init__(self, config: GroupConfig, recorded: int) -> None:
        given = config.partitions
        if given < recorded:
            effect = (
                f"its members would take partitions 0-{given - 1} and leave "
                f"{given}-{recorded - 1} to nobody"
            )
        else:
            effect = f"partitions {recorded}-{given - 1} get no messages"
        super().__init__(
            f"stream {config.stream} records {recorded} partitions for group "
            f"{config.namespace}/{config.group}, not the {given} given "
            f"(--partitions, env SHOAL_PARTITIONS): {effect}. Run every member with "
            f"--partitions {recorded} (SHOAL_PARTITIONS={recorded}); nothing was changed"
        )
        self.recorded = recorded
        self.given = given


async def check_partitions(js: Any, config: GroupConfig) -> int | None:
    """At a member's start, before ensure_group (which would write its count into the
    stream's metadata): PartitionCountMismatch if the group's stream records another
    count than config.partitions. Returns the recorded count; None for a stream not
    created yet, or of an older Shoal (accepted, as before the count was recorded)."""
    recorded = await recorded_partitions(js, config.stream)
    if recorded is not None and recorded != config.partitions:
        raise PartitionCountMismatch(config, recorded)
    return recorded


class StreamConfigConflict(RuntimeError):
    """A stream exists with a configuration JetStream cannot change in place."""


async def _ensure_stream(js: Any, name: str, subjects: list[str], **kwargs: Any) -> None:
    try:
        await js.add_stream(name=name, subjects=subjects, **kwargs)
    except BadRequestError:
        # It exists with another configuration: apply ours in place where JetStream can.
        try:
            await js.update_stream(name=name, subjects=subjects, **kwargs)
            log.info("Updated stream %s to the declared configuration", name)
        except APIError as exc:  # JetStream refuses some changes as 400, others as 500
            raise StreamConfigConflict(
                f"stream {name} exists with a configuration JetStream cannot change in "
                f"place: {exc.description}"
            ) from exc


async def ensure_group(js: Any, config: GroupConfig) -> list[int]:
    """Create the partition stream, one durable per partition, the DLQ and log streams,
    and the ledger stream when the config asks for it.

    Returns the partitions whose durables were missing beside others on a stream that
    keeps acked messages (limits, interest): created at the stream's start, they deliver
    their partitions' messages again (the caller may say so where people look)."""
    await _ensure_stream(
        js,
        config.stream,
        stream_subjects(config.subject_prefix),
        retention=_RETENTION[config.retention],
        storage=_STORAGE[config.storage],
        num_replicas=config.stream_replicas,
        duplicate_window=120.0,
        # What producers need to agree with (`shoal-consumer produce` reads it): a
        # message published for another count lands on a partition nobody consumes, or
        # on the wrong one. (A stream of an older Shoal gets it at the next reconcile.)
        metadata={PARTITIONS_METADATA: str(config.partitions)},
    )
    await _ensure_stream(
        js,
        config.dlq_stream,
        dlq_subjects(config.subject_prefix),
        storage=_STORAGE[config.storage],
        num_replicas=config.stream_replicas,
    )
    await _ensure_stream(
        js,
        config.log_stream,
        [assignments_subject(config.subject_prefix)],
        storage=_STORAGE[config.storage],
        num_replicas=config.stream_replicas,
    )
    if config.ledger:
        await _ensure_stream(
            js,
            config.ledger_stream,
            ledger_subjects(config.subject_prefix),
            storage=_STORAGE[config.storage],
            num_replicas=config.stream_replicas,
        )
    try:
        existing = {info.name: info.config for info in await js.consumers_info(config.stream)}
    except NotFoundError:
        existing = {}
    missing = [p for p in range(config.partitions) if durable_name(p) not in existing]
    # Durables whose settings changed (ack_wait, max_deliver, backoff, max_ack_pending,
    # e.g. the ConsumerGroup spec was edited and the pods rolled): creating a durable
    # with a new config updates it in place. Without this they kept the settings they
    # were created with, while the members worked with the new ones (in-progress acks
    # paced for a longer ack_wait than the server's: redeliveries, duplicates).
    outdated = [
        p
        for p in range(config.partitions)
        if durable_name(p) in existing
        and _settings_differ(existing[durable_name(p)], consumer_config(config, p))
    ]
    sem = asyncio.Semaphore(16)

    async def add(p: int) -> None:
        wanted = consumer_config(config, p)
        current = existing.get(durable_name(p))
        if current is not None:
            # Where it starts is not ours to change here (JetStream refuses to, and a
            # `shoal-consumer reset` chose it): an update keeps the durable's own.
            wanted = keep_position(wanted, current)
        async with sem:
            await js.add_consumer(config.stream, config=wanted)

    await asyncio.gather(*(add(p) for p in missing + outdated))
    restarted = missing if existing and config.retention != "workqueue" else []
    if restarted:
        # Some were deleted while no member ran (a member recreates one deleted under
        # it where it was: consumer/restart.py). Nobody knows where these were, and the
        # stream keeps acked messages: each delivers its partition from the start.
        log.warning(
            "Durables of partitions %s were missing on stream %s (%s retention keeps "
            "acked messages): created anew, each delivers its partition's messages from "
            "the stream's start; `shoal-consumer reset` chooses another place",
            partition_list(restarted),
            config.stream,
            config.retention,
        )
    elif missing:
        log.info("Created %d durable consumers on stream %s", len(missing), config.stream)
    if outdated:
        log.info("Updated %d durable consumers to the configured settings", len(outdated))
    return restarted


def partition_list(partitions: list[int], most: int = 10) -> str:
    shown = ", ".join(str(p) for p in partitions[:most])
    return shown + (f" and {len(partitions) - most} more" if len(partitions) > most else "")


def keep_position(wanted: api.ConsumerConfig, current: api.ConsumerConfig) -> api.ConsumerConfig:
    """`wanted` with the deliver policy (and its start) of the durable `current`."""
    return dataclasses.replace(
        wanted,
        deliver_policy=current.deliver_policy,
        opt_start_seq=current.opt_start_seq,
        opt_start_time=current.opt_start_time,
    )


def _settings_differ(current: api.ConsumerConfig, wanted: api.ConsumerConfig) -> bool:
    """Whether an existing durable lacks settings a member would apply to it.

    A durable that still has a backoff (from an older Shoal) is outdated: the backoff
    replaced its ack_wait.
    """
    if list(current.backoff or []) != list(wanted.backoff or []):
        return True
    if current.ack_wait != wanted.ack_wait:
        return True
    return bool(
        current.max_deliver != wanted.max_deliver
        or current.max_ack_pending != wanted.max_ack_pending
    )


class MessageDeleteError(RuntimeError):
    """JetStream refused to delete a message; `code` is its error code (10037: no such
    message)."""

    NO_MESSAGE = 10037

    def __init__(self, description: str, code: int | None) -> None:
        super().__init__(description)
        self.code = code


async def delete_message(
    nc: Any, api_prefix: str, stream: str, seq: int, *, timeout: float = 5
) -> None:
    """Delete message `seq` of `stream` without erasing it (nats-py's delete_msg always
    erases); MessageDeleteError if JetStream refuses.

    Erasing overwrites the message on disk, which nobody here needs, and nats-server
    2.12.15 can crash in that path (a nil pointer in fileStore.removeMsg, seen when the
    leader's sweep deleted messages of a work-queue stream that were being acked at the
    same time: shoal.consumer.deadletter).
    """
    request = json.dumps({"seq": seq, "no_erase": True}).encode()
    reply = await nc.request(f"{api_prefix}.STREAM.MSG.DELETE.{stream}", request, timeout=timeout)
    answer = json.loads(reply.data)
    error = answer.get("error")
    if error:
        raise MessageDeleteError(str(error.get("description", error)), error.get("err_code"))


def ack_floor(info: api.ConsumerInfo) -> int:
    """The stream sequence at and below which the durable's messages are all acked."""
    return int(info.ack_floor.stream_seq or 0) if info.ack_floor is not None else 0


async def partition_progress(js: Any, config: GroupConfig, partition: int) -> tuple[int, int]:
    """The partition's durable: its lag (num_pending + num_ack_pending), its ack floor."""
    info = await js.consumer_info(config.stream, durable_name(partition), timeout=2)
    return int(info.num_pending or 0) + int(info.num_ack_pending or 0), ack_floor(info)
