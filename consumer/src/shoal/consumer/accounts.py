"""A group's streams in one NATS account, its members in another: exports and imports.

A common production shape: JetStream (the group's streams, the operator, producers) lives
in one account, say ``SHOAL``, and a team's members run as users of their own account,
say ``TEAM``, which sees of ``SHOAL`` only what it imports. This module lists, for one
group, what ``SHOAL`` must export to ``TEAM`` and how ``TEAM`` imports it, and renders
both as a NATS config ``accounts`` block (`shoal-consumer permissions --accounts`).

What crosses, and why (the member's side of permissions.member_permissions):

* JetStream API requests, as services. ``TEAM`` imports each under its own API prefix
  (``JS.SHOAL.API``: a member's NATS_JS_API_PREFIX) rather than as ``$JS.API``, because
  ``$JS.API`` in ``TEAM`` is ``TEAM``'s own JetStream, if it has one. A pull
  (``CONSUMER.MSG.NEXT``) is answered with up to a batch of messages, so its export says
  ``response: stream``; every other request has one answer.
* Acks: a delivered message's reply subject is ``$JS.ACK.<stream>.…`` of ``SHOAL``; a
  member acks by publishing there, so ``TEAM`` imports that service unchanged.
* What a member publishes into ``SHOAL``'s streams (dead letters, the assignment log,
  the test ledger), as services: JetStream's publish ack is the response.
* What a member listens to, as streams: the partition subjects (a dozing partition's
  alarm, published by producers in ``SHOAL``) and the stream's advisories.

Producers, the operator and the export connect to ``SHOAL`` with their single-account
permissions. Requests' replies cross back on the server's own response subjects, so a
member's NATS_INBOX_PREFIX needs no import.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.consumer.deadletter import ADVISORY
from shoal.consumer.permissions import API, User, management_subjects, user_lines
from shoal.contracts.names import (
    assignments_subject,
    dlq_subjects,
    ledger_subjects,
    stream_subjects,
)
from shoal.group.config import GroupConfig

DEFAULT_JS_ACCOUNT = "SHOAL"
DEFAULT_MEMBER_ACCOUNT = "TEAM"


@dataclass(frozen=True)
class Export:
    """One entry of the JetStream account's exports (to the member account only)."""

    kind: str  # "service" or "stream"
    subject: str
    # The local subject the member account imports it as (None: the same subject).
    to: str | None = None
    # For a service: "stream" when a request may have many responses (a pull).
    response: str | None = None


def default_api_prefix(js_account: str = DEFAULT_JS_ACCOUNT) -> str:
    """The importing account's name for the JetStream account's API (the convention of
    NATS's own examples: ``JS.<account>.API``)."""
    return f"JS.{js_account}.API"


def group_exports(config: GroupConfig, api_prefix: str) -> tuple[Export, ...]:
    """What a member of `config`'s group needs from the JetStream account, as exports."""
    stream, prefix = config.stream, config.subject_prefix

    def api(rest: str, response: str | None = None) -> Export:
        return Export("service", f"{API}.{rest}", f"{api_prefix}.{rest}", response)

    out = [
        api(f"CONSUMER.MSG.NEXT.{stream}.*", response="stream"),
        api(f"CONSUMER.INFO.{stream}.*"),
        api(f"STREAM.INFO.{stream}"),  # is it still the stream consumed (worker.py)
        api(f"STREAM.MSG.GET.{stream}"),
        api(f"STREAM.MSG.DELETE.{stream}"),
    ]
    if config.ensure_jetstream:
        # Standalone members create the streams and durables themselves.
        out += [api(s.removeprefix(API + ".")) for s in management_subjects(config)]
    published = [*dlq_subjects(prefix), assignments_subject(prefix)]
    if config.ledger:
        published += ledger_subjects(prefix)
    out += [Export("service", f"$JS.ACK.{stream}.>")]
    out += [Export("service", s) for s in published]
    listened = [
        *stream_subjects(prefix),
        f"$JS.EVENT.ADVISORY.STREAM.DELETED.{stream}",
        f"$JS.EVENT.ADVISORY.CONSUMER.DELETED.{stream}.*",
        f"{ADVISORY}.{stream}.*",
    ]
    out += [Export("stream", s) for s in listened]
    return tuple(out)


def accounts_block(
    exports: Sequence[Export],
    js_users: Sequence[User],
    member_users: Sequence[User],
    js_account: str = DEFAULT_JS_ACCOUNT,
    member_account: str = DEFAULT_MEMBER_ACCOUNT,
) -> str:
    """A NATS config ``accounts`` block: `js_account` with JetStream, its users and the
    exports (to `member_account` only), and `member_account` with its users and imports."""
    q = json.dumps
    export_lines, import_lines = [], []
    for e in exports:
        extra = f", response: {e.response}" if e.response else ""
        export_lines.append(
            f"      {{{e.kind}: {q(e.subject)}, accounts: [{member_account}]{extra}}}"
        )
        source = f"{{account: {js_account}, subject: {q(e.subject)}}}"
        to = f", to: {q(e.to)}" if e.to else ""
        import_lines.append(f"      {{{e.kind}: {source}{to}}}")
    lines = [
        "accounts {",
        f"  {js_account} {{",
        "    jetstream: enabled",
        "    users = [",
        *user_lines(js_users, "      "),
        "    ]",
        "    exports = [",
        *export_lines,
        "    ]",
        "  }",
        f"  {member_account} {{",
        "    users = [",
        *user_lines(member_users, "      "),
        "    ]",
        "    imports = [",
        *import_lines,
        "    ]",
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"
