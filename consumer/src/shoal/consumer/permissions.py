"""The least NATS subject permissions a member, the operator, a producer and an admin
(dlq and reset commands) of one group need.

Pure: from a GroupConfig (stream names, subject prefix) to allow lists, and from those to
a NATS ``authorization { users = [...] }`` block (`shoal-consumer permissions`). Each
entry is there because the code uses it (the comments name where); anything not listed
is refused by a server that enforces them, which tests/test_nats_permissions.py checks
on a real nats-server with exactly these lists.

Replies: every request (JetStream API calls, publishes with an ack, pulls) is answered on
the client's inbox, ``<inbox prefix>.>``. nats-py's prefix is ``_INBOX`` for every client,
so a subscribe permission on ``_INBOX.>`` lets any user holding it read every other
client's replies, e.g. the messages a member of another group pulled. So members and
producers (and the export) use prefixes of their group's own (``NATS_INBOX_PREFIX``, by
default in this output ``_SHOAL_INBOX.<namespace>.<group>``,
``_SHOAL_PRODUCER.<namespace>.<group>``, ``_SHOAL_EXPORT.<namespace>.<group>``), outside
``_INBOX``, and may subscribe only below them. The operator keeps nats-py's
``_INBOX``: ``_INBOX.>`` then overlaps with no member's or producer's replies.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.clients.nats import HEALTH_SUBJECT
from shoal.consumer.deadletter import ADVISORY
from shoal.contracts.names import (
    assignments_subject,
    dlq_subjects,
    ledger_subjects,
    member_inbox_prefix,
    producer_inbox_prefix,
    stream_subjects,
)
from shoal.group.config import GroupConfig

API = "$JS.API"


@dataclass(frozen=True)
class Permissions:
    """Subjects a NATS user may publish to and subscribe to (allow lists)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def default_inbox_prefix(config: GroupConfig) -> str:
    """The members' reply prefix (contracts.names.member_inbox_prefix)."""
    return member_inbox_prefix(config.namespace, config.group)


def default_producer_inbox_prefix(config: GroupConfig) -> str:
    return producer_inbox_prefix(config.namespace, config.group)


def _streams(config: GroupConfig) -> list[str]:
    streams = [config.stream, config.dlq_stream, config.log_stream]
    return [*streams, config.ledger_stream] if config.ledger else streams


def member_permissions(
    config: GroupConfig, inbox_prefix: str | None = None, api: str = API
) -> Permissions:
    """What one member of the group publishes and subscribes to.

    With ``config.ensure_jetstream`` (members run without the operator) a member also
    creates and updates the group's streams and durables, as the operator does. `api`:
    the member's NATS_JS_API_PREFIX (another account's API, imported under a prefix).
    """
    inbox = inbox_prefix or config.nats_inbox_prefix or "_INBOX"
    stream, prefix = config.stream, config.subject_prefix
    publish = [
        # Pulls (partition.py: a raw MSG.NEXT request per durable, replies to our inbox).
        f"{api}.CONSUMER.MSG.NEXT.{stream}.*",
        # Acks, naks, in-progress and terms go to the delivered message's reply subject.
        f"$JS.ACK.{stream}.>",
        # Lag and dozing (consumer_info).
        f"{api}.CONSUMER.INFO.{stream}.*",
        # Whether the stream is still the one consumed (its creation time, worker.py).
        f"{api}.STREAM.INFO.{stream}",
        # The leader's sweep of messages past max_deliver (deadletter.py): read the
        # original, publish it to the DLQ, delete it.
        f"{api}.STREAM.MSG.GET.{stream}",
        f"{api}.STREAM.MSG.DELETE.{stream}",
        *dlq_subjects(prefix),
        # The leader's assignment log (runtime.py).
        assignments_subject(prefix),
        # The reachability round trip (shoal.clients.nats.NatsHealth): answered "no responders".
        HEALTH_SUBJECT,
    ]
    if config.ledger:
        publish += ledger_subjects(prefix)  # the test ledger handler
    if config.ensure_jetstream:
        # ensure_group at start, and recreating a deleted durable (partition.py).
        publish += management_subjects(config, api)
    subscribe = [
        f"{inbox}.>",
        # A dozing partition's alarm: any publish on its subject (alarm.py).
        *stream_subjects(prefix),
        # Deleted stream or durables rouse dozing partitions (worker.py); the leader
        # dead-letters what JetStream stopped delivering (deadletter.py).
        f"$JS.EVENT.ADVISORY.STREAM.DELETED.{stream}",
        f"$JS.EVENT.ADVISORY.CONSUMER.DELETED.{stream}.*",
        f"{ADVISORY}.{stream}.*",
    ]
    return Permissions(_unique(publish), _unique(subscribe))


def _unique(subjects: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(subjects))


def management_subjects(config: GroupConfig, api: str = API) -> list[str]:
    """jetstream.ensure_group: create or update the streams, list and create durables."""
    out: list[str] = []
    for stream in _streams(config):
        out += [f"{api}.STREAM.CREATE.{stream}", f"{api}.STREAM.UPDATE.{stream}"]
    # nats-py 2.16 creates a consumer that has a durable_name and no name with the
    # legacy DURABLE.CREATE request (its CONSUMER.CREATE form needs config.name).
    out += [
        f"{api}.CONSUMER.LIST.{config.stream}",
        f"{api}.CONSUMER.DURABLE.CREATE.{config.stream}.*",
    ]
    return out


def operator_permissions(config: GroupConfig, inbox_prefix: str = "_INBOX") -> Permissions:
    """What the operator does for this group: ensure_group, the stream's info for the
    status (its message count is the work-queue lag) and the dead-letter stream's (its
    count is status.deadLetters), and deleting the streams with the group
    (deletionPolicy Delete). For many groups: the union, one entry set per group."""
    publish = management_subjects(config)
    # The status timer reads each stream's info: the lag (the stream), status.deadLetters
    # (the dead-letter stream), and whether one is missing (then it recreates it).
    publish += [f"{API}.STREAM.INFO.{stream}" for stream in _streams(config)]
    publish += [f"{API}.STREAM.DELETE.{stream}" for stream in _streams(config)]
    # Each kept connection's round trip (NatsHealth), which replaces a dead one.
    publish.append(HEALTH_SUBJECT)
    if not config.ledger:
        # The group is deleted with its ledger stream, if one was ever made.
        publish.append(f"{API}.STREAM.DELETE.{config.ledger_stream}")
    return Permissions(_unique(publish), (f"{inbox_prefix}.>",))


def producer_permissions(config: GroupConfig, inbox_prefix: str | None = None) -> Permissions:
    """A publisher of the group's messages (`shoal-consumer produce`): the partition
    subjects, the stream's info (the group's partition count), and its inbox for
    JetStream's publish acks."""
    inbox = inbox_prefix or config.nats_inbox_prefix or "_INBOX"
    # STREAM.INFO: `produce` reads the group's partition count from its stream.
    publish = (*stream_subjects(config.subject_prefix), f"{API}.STREAM.INFO.{config.stream}")
    return Permissions(publish, (f"{inbox}.>",))


def default_exporter_inbox_prefix(config: GroupConfig) -> str:
    return f"_SHOAL_EXPORT.{config.namespace}.{config.group}"


def exporter_permissions(config: GroupConfig, inbox_prefix: str | None = None) -> Permissions:
    """`shoal-analytics export` of the group's assignment log (analytics/export.py): the
    log stream's info, an ephemeral pull consumer on it (created without a name, so with
    the plain CONSUMER.CREATE request), its pulls (no acks: AckPolicy NONE), deleting it."""
    inbox = inbox_prefix or default_exporter_inbox_prefix(config)
    log_stream = config.log_stream
    return Permissions(
        (
            f"{API}.STREAM.INFO.{log_stream}",
            f"{API}.CONSUMER.CREATE.{log_stream}",
            f"{API}.CONSUMER.MSG.NEXT.{log_stream}.*",
            f"{API}.CONSUMER.DELETE.{log_stream}.*",
        ),
        (f"{inbox}.>",),
    )


def default_admin_inbox_prefix(config: GroupConfig) -> str:
    return f"_SHOAL_ADMIN.{config.namespace}.{config.group}"


def admin_permissions(config: GroupConfig, inbox_prefix: str | None = None) -> Permissions:
    """A person's one-shot commands on the group: `shoal-consumer dlq` (list, show,
    redrive, purge: shoal.group.deadletters) and `shoal-consumer reset`
    (shoal.group.reset). They may read and rewrite the group's position and dead letters,
    not its assignment log or other groups'. (`pause`, `resume` and `status` use etcd
    only.)"""
    inbox = inbox_prefix or default_admin_inbox_prefix(config)
    stream, dlq = config.stream, config.dlq_stream
    publish = [
        # reset: the plan (stream info, its durables) and the unknown-group check of dlq.
        f"{API}.STREAM.INFO.{stream}",
        f"{API}.CONSUMER.LIST.{stream}",
        # reset: counting from the new position with an ephemeral consumer (no name:
        # CONSUMER.CREATE.<stream>), then deleting it.
        f"{API}.CONSUMER.CREATE.{stream}",
        # reset: each durable deleted and created again from its info's config, which
        # names it (CONSUMER.CREATE.<stream>.<name>.<filter subject>).
        f"{API}.CONSUMER.DELETE.{stream}.*",
        f"{API}.CONSUMER.CREATE.{stream}.>",
        f"{API}.CONSUMER.DURABLE.CREATE.{stream}.*",
        # dlq: the dead-letter stream's info, an ephemeral reader on it and its pulls
        # (AckPolicy NONE: no acks), deleting it; deleting dead letters one by one
        # (redrive, purge of a selection) or all (purge).
        f"{API}.STREAM.INFO.{dlq}",
        f"{API}.CONSUMER.CREATE.{dlq}",
        f"{API}.CONSUMER.MSG.NEXT.{dlq}.*",
        # dlq: whether more waits when a fetch comes back empty (deadletters.read), as
        # when someone purges or redrives the dead letters meanwhile.
        f"{API}.CONSUMER.INFO.{dlq}.*",
        f"{API}.CONSUMER.DELETE.{dlq}.*",
        f"{API}.STREAM.MSG.DELETE.{dlq}",
        f"{API}.STREAM.PURGE.{dlq}",
        # dlq redrive: back to the partition subjects.
        *stream_subjects(config.subject_prefix),
    ]
    return Permissions(_unique(publish), (f"{inbox}.>",))


def _quoted(subjects: Sequence[str]) -> str:
    return ", ".join(json.dumps(s) for s in subjects)


User = tuple[str, str, Permissions]


def user_lines(users: Sequence[User], indent: str) -> list[str]:
    lines = []
    for user, password, perms in users:
        secret = password if password.startswith("$") else json.dumps(password)
        lines += [
            f"{indent}{{user: {json.dumps(user)}, password: {secret}, permissions: {{",
            f"{indent}  publish: {{allow: [{_quoted(perms.publish)}]}}",
            f"{indent}  subscribe: {{allow: [{_quoted(perms.subscribe)}]}}",
            f"{indent}}}}}",
        ]
    return lines


def authorization_block(users: Sequence[User]) -> str:
    """A NATS config ``authorization`` block: (user, password, permissions) each.

    Passwords are written as given: pass e.g. ``$MEMBER_PASSWORD`` to have nats-server
    read it from its environment (an unquoted variable in the config file).
    """
    lines = ["authorization {", "  users = [", *user_lines(users, "    "), "  ]", "}"]
    return "\n".join(lines) + "\n"
