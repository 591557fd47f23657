"""Every name Shoal's parts and its tests agree on, spelled once.

Producers, consumers, the operator, analytics and the tests derive these names from here
and nowhere else (DESIGN.md, "Contracts"): a project's partition, the NATS subjects and
stream names of a group, message headers, etcd keys, the CRD's coordinates, annotation and
label names, and the time format of status fields.
"""

from __future__ import annotations

import hashlib
import re
import time
from datetime import UTC, datetime, timedelta

# -- partitions ----------------------------------------------------------------------------

DEFAULT_PARTITIONS = 128


def partition_for(project_id: str, partitions: int = DEFAULT_PARTITIONS) -> int:
    """The partition of a project: sha256 of its UTF-8 id, big-endian, modulo partitions."""
    if not isinstance(project_id, str) or not project_id:
        raise ValueError(f"project id must be a non-empty string, got {project_id!r}")
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions!r}")
    digest = hashlib.sha256(project_id.encode("utf-8")).digest()
    return int.from_bytes(digest, "big") % partitions


def durable_name(partition: int) -> str:
    """The durable belongs to the partition, not to a member."""
    return f"p{partition}"


# -- subjects ------------------------------------------------------------------------------

# A NATS subject token may not contain whitespace, "." or the wildcards.
# Whitespace as the CRD's patterns (Go's RE2 `\s`) and shoal.contracts.spec.WHITESPACE
# mean it: a prefix the API server and the spec model accept must pass here too.
_TOKEN = re.compile(r"^[^\t\n\f\r .*>]+$")


def check_token(value: str, what: str) -> str:
    """Return value if it is usable as one NATS subject token, else raise ValueError."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} is not a valid NATS subject token")
    return value


def default_subject_prefix(namespace: str, group: str) -> str:
    return f"shoal.{check_token(namespace, 'namespace')}.{check_token(group, 'group')}"


def check_subject_prefix(prefix: str) -> str:
    tokens = prefix.split(".")
    for token in tokens:
        check_token(token, "subject prefix token")
    return prefix


def partition_subject(prefix: str, partition: int) -> str:
    return f"{prefix}.{partition}"


def decimal(text: str) -> int | None:
    """`text` as a non-negative integer if it is one written in ASCII digits, else None.
    (str.isdigit alone also accepts "²", which int() refuses: a key or header with one
    must be ignored as garbage, not crash its reader.)"""
    return int(text) if text.isascii() and text.isdigit() else None


def subject_partition(subject: str, prefix: str) -> int | None:
    """The partition of a subject `<prefix>.<p>` (a partition's, or with `<prefix>.dlq`
    a dead letter's), or None for any other subject."""
    head, _, tail = subject.rpartition(".")
    return decimal(tail) if head == prefix else None


def stream_subjects(prefix: str) -> list[str]:
    """The partition stream captures exactly one token below the prefix."""
    return [f"{prefix}.*"]


# Everything else lives two tokens below the prefix, in streams of its own, so that the
# partition stream (one token below) never captures it.
def dlq_subject(prefix: str, partition: int) -> str:
    return f"{prefix}.dlq.{partition}"


def dlq_subjects(prefix: str) -> list[str]:
    return [f"{prefix}.dlq.*"]


def assignments_subject(prefix: str) -> str:
    return f"{prefix}.log.assignments"


def ledger_subject(prefix: str, partition: int) -> str:
    return f"{prefix}.ledger.{partition}"


def ledger_subjects(prefix: str) -> list[str]:
    return [f"{prefix}.ledger.*"]


# -- streams -------------------------------------------------------------------------------


def member_inbox_prefix(namespace: str, group: str) -> str:
    """The members' reply prefix: the group's own (Kubernetes names have no dots), and
    under no other prefix, so that no other user's inbox permission covers it."""
    return f"_SHOAL_INBOX.{namespace}.{group}"


def producer_inbox_prefix(namespace: str, group: str) -> str:
    return f"_SHOAL_PRODUCER.{namespace}.{group}"


def default_stream_name(namespace: str, group: str) -> str:
    """JetStream stream names may not contain ".", "*", ">", whitespace or path separators."""
    raw = f"shoal_{namespace}_{group}"
    return re.sub(r"[^A-Za-z0-9_-]", "_", raw)


def dlq_stream_name(stream: str) -> str:
    return f"{stream}_dlq"


def log_stream_name(stream: str) -> str:
    """The assignment log (one event per generation, shoal.contracts.events)."""
    return f"{stream}_log"


def ledger_stream_name(stream: str) -> str:
    """The ledger handler's records (shoal.consumer.handlers:ledger), for audits."""
    return f"{stream}_ledger"


# -- message headers -------------------------------------------------------------------------

PROJECT_HEADER = "Shoal-Project-Id"
SEQ_HEADER = "Shoal-Seq"  # the producer's per-project sequence (audits check order by it)
MSG_ID_HEADER = "Nats-Msg-Id"  # JetStream's de-duplication id
# On dead letters: why, where it came from, and which member gave up on it.
DEAD_LETTER_REASON_HEADER = "Shoal-Dead-Letter-Reason"
ORIGINAL_SUBJECT_HEADER = "Shoal-Original-Subject"
MEMBER_HEADER = "Shoal-Member"
# A dead letter's copy of the original's headers it cannot carry as headers, as JSON
# {name: value}: names NATS clients refuse to publish (no token; a client writing its own
# protocol can send them), and JetStream's publish controls (Nats-Expected-Stream,
# Nats-Expected-Last-Sequence, Nats-TTL, ...), which the dead-letter stream would apply
# to the copy, or refuse it for (deadletter.dead_letter_message).
ORIGINAL_HEADERS_HEADER = "Shoal-Original-Headers"
# A dead letter that had to be cut to fit the server's limits (max_payload, 64 KiB of
# headers): what was cut, in words.
DEAD_LETTER_CUT_HEADER = "Shoal-Dead-Letter-Cut"
# A dead letter keeps the original's Nats-Msg-Id here (its own Nats-Msg-Id is dropped: the
# dead-letter stream keeps every copy), and a redriven message carries it on, so that its
# handler sees the id it was published with (shoal.consumer.handlers.Message.message_id).
ORIGINAL_MSG_ID_HEADER = "Shoal-Original-Msg-Id"
# On a message redriven from the dead letters: its sequence in the dead-letter stream.
REDRIVEN_FROM_HEADER = "Shoal-Redriven-From"

# -- etcd ----------------------------------------------------------------------------------


class Keys:
    """etcd key layout of one group, under /shoal/<namespace>/<group>/."""

    def __init__(self, namespace: str, group: str) -> None:
        self.prefix = f"/shoal/{namespace}/{group}/"
        self.members = self.prefix + "members/"
        self.leader = self.prefix + "leader"
        self.partitions = self.prefix + "partitions/"
        self.claims = self.prefix + "claims/"
        # The autoscaler's last action (time, from, to, reason): the operator reports it
        # as status.lastScale, and a new leader keeps the cooldown it started.
        self.scale = self.prefix + "scale"
        # Per partition, what its last orderly hand-over gave back: {stream sequence:
        # credit}, the deliveries of each message that were not one attempt each (a
        # hand-over nak is none; a delivery retried in place f times is f). The next
        # owner counts a message's attempts as deliveries - credit (partition.py).
        self.handbacks = self.prefix + "handbacks/"
        # Per member, why NATS refuses it (credentials, TLS) while it does: JSON
        # {"reason", "message", "since"} on a short lease of its own, so a member that
        # never joined (it connects to NATS first) still says why. Not under members/:
        # the leader must not give partitions to it.
        self.problems = self.prefix + "problems/"
        # The group is paused while this key exists (shoal.contracts.values.PauseRecord:
        # who paused it, when, why). Written by the operator from spec.paused, or by
        # `shoal-consumer pause` for groups run without it; bound to nothing, so a pause
        # outlives every member and leader. Members read it before they pull.
        self.paused = self.prefix + "paused"
        # The last `shoal-consumer reset` of the group's durables (JSON: by, time, the
        # position). Written while the group is paused, after the durables were
        # recreated: members watch it to forget what they remembered of the old
        # durables (given-back sequences, hand-over credits, settled sequences), which
        # would hold back or skip the replayed messages.
        self.reset = self.prefix + "reset"
        # While a `shoal-consumer reset` runs: who runs it (JSON: by, time), on a lease of
        # the resetting process, so that a reset that died with it leaves none. A second
        # reset refuses while it exists, and knows a reset's pause without it for one
        # left by a reset that did not finish.
        self.resetting = self.prefix + "resetting"
        # Per member, its routine stats (the same MemberStats as members/<id>), rewritten
        # every stats interval, on the member's lease; members/<id> is written when the
        # member joins and when a field someone acts on at once changes (nats_ok,
        # stalled, paused), with this key in the same transaction. Only the leader (its
        # autoscaler, load-aware balancing) and status readers want the routine ones:
        # the leader polls them (GroupView.follow_stats), and the members' watches cover
        # the group's keys below this one (group_end) only, so a rewrite reaches nobody
        # at once. It must sort after every other key of the group
        # (tests/test_routine_stats.py).
        self.stats = self.prefix + "stats/"
        self.group_end = self.stats

    def problem(self, member_id: str) -> str:
        return self.problems + member_id

    def handback(self, partition: int) -> str:
        return f"{self.handbacks}{partition}"

    def member(self, member_id: str) -> str:
        return self.members + member_id

    def member_stats(self, member_id: str) -> str:
        return self.stats + member_id

    def partition(self, partition: int) -> str:
        return f"{self.partitions}{partition}"

    def claim(self, partition: int) -> str:
        return f"{self.claims}{partition}"

    @staticmethod
    def tail(key: str, prefix: str) -> str:
        return key[len(prefix) :]


# -- Kubernetes ----------------------------------------------------------------------------

API_GROUP = "shoal.dev"
API_VERSION = "v1alpha1"
KIND = "ConsumerGroup"
PLURAL = "consumergroups"
SHORT_NAME = "cg"
FINALIZER = f"{API_GROUP}/cleanup"
# Labels of every consumer pod (the Deployment's selector uses both).
GROUP_LABEL = f"{API_GROUP}/group"
CONSUMER_APP_NAME = "shoal-consumer"
# The member's own container in a consumer pod: spec.containers may not take its name.
CONSUMER_CONTAINER_NAME = "consumer"
# Pod-template annotation: the etcd tlsSecret version the pods were started with.
ETCD_SECRET_VERSION_ANNOTATION = f"{API_GROUP}/etcd-secret-version"
# The same for spec.nats.tlsSecret and spec.nats.credentialsSecret: members read their NATS
# certificates and credentials only at start.
NATS_TLS_SECRET_VERSION_ANNOTATION = f"{API_GROUP}/nats-tls-secret-version"
NATS_CREDENTIALS_SECRET_VERSION_ANNOTATION = f"{API_GROUP}/nats-credentials-secret-version"
# Which pod a ReplicaSet removes first on a scale-down (lowest cost goes first).
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"

# What a member's health port answers (consumer/healthport.py), the operator's httpGet
# probes ask.
READY_PATH = "/readyz"
LIVE_PATH = "/livez"

# The pod's CPU limit, in millicores, as the operator tells the members (shoal.consumer.cpu
# reads it: the share of the limit a member reports as its cpu).
CPU_LIMIT_ENV = "SHOAL_CPU_LIMIT_MILLICORES"

# Status and Event times: RFC 3339 in UTC, whole seconds (as Kubernetes writes them).
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def format_time(t: float | None = None) -> str:
    """A Unix time (now when None) in TIME_FORMAT."""
    return time.strftime(TIME_FORMAT, time.gmtime(time.time() if t is None else t))


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class TimeOutOfRange(ValueError):
    """A time or duration past what a datetime holds (before year 1, after 9999)."""


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """A command's ``--since``: an RFC 3339 time or date (UTC unless it says otherwise) or
    a duration back from now (``90s``, ``15m``, ``24h``, ``7d``, ``2w``). ValueError, with
    what it expected, for anything else."""
    match = _DURATION.match(text)
    try:
        if match:
            seconds = float(match.group(1)) * _UNITS[match.group(2)]
            return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
        value = datetime.fromisoformat(text.strip().replace("z", "Z"))
        return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    except OverflowError:  # 99999999999d, or the year 1 east of UTC: before year 1
        raise TimeOutOfRange(f"{text!r} is out of range (years 1 to 9999)") from None
    except ValueError:
        raise ValueError(
            f"--since {text!r}: expected an RFC 3339 time (2026-11-21T10:00:00Z), a date "
            "(2026-11-21) or a duration (30m, 24h, 7d)"
        ) from None
