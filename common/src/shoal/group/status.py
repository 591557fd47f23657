"""A one-shot summary of a group from etcd: members, leader, owners, skew, and the
members NATS refuses or that wait for their handler (they never join, so only their
problems/ key tells of them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shoal.assignor import owner_counts, skew
from shoal.clients.etcd import Etcd
from shoal.contracts.names import Keys, decimal
from shoal.contracts.values import MemberStats, PauseRecord
from shoal.group.problems import MemberProblem
from shoal.group.view import GroupView


@dataclass
class GroupStatus:
    namespace: str
    group: str
    partitions: int
    members: dict[str, MemberStats]
    leader: str | None
    epoch: int | None
    generation: int
    owners: dict[int, str]
    claims: dict[int, str]
    counts: dict[str, int] = field(default_factory=dict)
    skew: int = 0
    unowned: list[int] = field(default_factory=list)
    unclaimed: list[int] = field(default_factory=list)
    # Partitions a member reports stalled (progress.py), by partition.
    stalled: dict[int, str] = field(default_factory=dict)
    # Members that report NATS refusing them, or waiting for their handler (Keys.problems).
    problems: dict[str, MemberProblem] = field(default_factory=dict)
    # Who paused the group (Keys.paused); None while it runs.
    paused: PauseRecord | None = None

    def moving(self) -> dict[int, tuple[str, str]]:
        """Partition -> (the member that claims it, its target owner), for the partitions
        claimed by another member than the assignment names (a hand-over going on)."""
        return {
            p: (member, self.owners[p])
            for p, member in sorted(self.claims.items())
            if p in self.owners and self.owners[p] != member
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "group": self.group,
            "partitions": self.partitions,
            "leader": self.leader,
            "epoch": self.epoch,
            "generation": self.generation,
            "members": {m: s.as_dict() for m, s in self.members.items()},
            "counts": self.counts,
            "skew": self.skew,
            "unowned": self.unowned,
            "unclaimed": self.unclaimed,
            "stalled": {str(p): m for p, m in sorted(self.stalled.items())},
            "owners": {str(p): m for p, m in sorted(self.owners.items())},
            "claims": {str(p): m for p, m in sorted(self.claims.items())},
            "problems": {
                m: {"reason": p.reason, "message": p.message, "since": p.since}
                for m, p in sorted(self.problems.items())
            },
            "paused": None if self.paused is None else self.paused.model_dump(),
        }


async def read_status(
    etcd: Etcd, namespace: str, group: str, partitions: int | None
) -> GroupStatus:
    """The group's status from etcd. partitions None: as many as the leader's targets
    name (partitions/<p>; a command line's --partitions default, 128, would count a
    16-partition group's 112 others as unowned, and drop a 256-partition group's
    owners above 127); 0 before the first assignment, when none is named yet."""
    keys = Keys(namespace, group)
    revision, kvs = await etcd.get_prefix(keys.prefix)
    if partitions is None:
        partitions = partition_count(keys, kvs)
    view = GroupView(etcd, keys, partitions)
    view.load(revision, kvs)
    return status_from_view(view, namespace, group)


def partition_count(keys: Keys, kvs: Mapping[str, Any]) -> int:
    """How many partitions the leader's targets name (the highest number + 1); 0 if
    none."""
    numbers = (
        decimal(key[len(keys.partitions) :]) for key in kvs if key.startswith(keys.partitions)
    )
    return max((p + 1 for p in numbers if p is not None and p < 4096), default=0)


def status_from_view(view: GroupView, namespace: str, group: str) -> GroupStatus:
    members = view.members()
    owners = view.owners()
    leader = view.leader()
    claims = {p: c.member for p, c in view.claims().items()}
    counts = owner_counts(owners, members) if members else {}
    return GroupStatus(
        namespace=namespace,
        group=group,
        partitions=view.partitions,
        members=members,
        leader=leader.member if leader else None,
        epoch=leader.epoch if leader else None,
        generation=view.generation(),
        owners=owners,
        claims=claims,
        counts=counts,
        skew=skew(owners, members) if members and owners else 0,
        unowned=[p for p in range(view.partitions) if p not in owners],
        unclaimed=[p for p in range(view.partitions) if p not in claims],
        stalled=stalled_by_partition(members, view.partitions),
        problems=view.problems(),
        paused=view.paused(),
    )


def stalled_by_partition(members: dict[str, MemberStats], partitions: int) -> dict[int, str]:
    """Partition -> the member reporting it stalled, from the members' stats (partition
    numbers outside the group are ignored)."""
    stalled: dict[int, str] = {}
    for member, stats in sorted(members.items()):
        for p in stats.stalled:
            if p < partitions:
                stalled[p] = member
    return stalled
