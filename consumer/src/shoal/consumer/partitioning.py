"""Project ids to partitions, and the NATS subject and etcd key names of a group.

These names are contracts (DESIGN.md): producers, consumers, the operator and the
tests all derive them from here and nowhere else.
"""

from __future__ import annotations

import hashlib
import re

DEFAULT_PARTITIONS = 128

# A NATS subject token may not contain whitespace, "." or the wildcards.
_TOKEN = re.compile(r"^[^\s.*>]+$")


def partition_for(project_id: str, partitions: int = DEFAULT_PARTITIONS) -> int:
    """The partition of a project: sha256 of its UTF-8 id, big-endian, modulo partitions."""
    if not isinstance(project_id, str) or not project_id:
        raise ValueError(f"project id must be a non-empty string, got {project_id!r}")
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions!r}")
    digest = hashlib.sha256(project_id.encode("utf-8")).digest()
    return int.from_bytes(digest, "big") % partitions


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


def stream_subjects(prefix: str) -> list[str]:
    """The partition stream captures exactly one token below the prefix."""
    return [f"{prefix}.*"]


def dlq_subject(prefix: str, partition: int) -> str:
    return f"{prefix}.dlq.{partition}"


def assignments_subject(prefix: str) -> str:
    return f"{prefix}.log.assignments"


def ledger_subject(prefix: str, partition: int) -> str:
    return f"{prefix}.ledger.{partition}"


def default_stream_name(namespace: str, group: str) -> str:
    """JetStream stream names may not contain ".", "*", ">", whitespace or path separators."""
    raw = f"shoal_{namespace}_{group}"
    return re.sub(r"[^A-Za-z0-9_-]", "_", raw)


def durable_name(partition: int) -> str:
    """The durable belongs to the partition, not to a member."""
    return f"p{partition}"


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

    def member(self, member_id: str) -> str:
        return self.members + member_id

    def partition(self, partition: int) -> str:
        return f"{self.partitions}{partition}"

    def claim(self, partition: int) -> str:
        return f"{self.claims}{partition}"

    @staticmethod
    def tail(key: str, prefix: str) -> str:
        return key[len(prefix) :]
