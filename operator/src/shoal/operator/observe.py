"""From what is observed (Deployment, etcd, JetStream) to a ConsumerGroup's status.

Pure: the reconciler gathers the facts, this module decides what they mean. Conditions
follow the Kubernetes API conventions: Ready, Progressing and Degraded, each with a
CamelCase reason, a message for people, observedGeneration, and a lastTransitionTime
that moves only when the condition's status does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.consumer.autoscaler import ScaleRecord
from shoal.contracts.names import format_time


@dataclass(frozen=True)
class Observed:
    generation: int
    spec_replicas: int
    replicas: int  # pods of the Deployment
    ready_replicas: int
    members: Mapping[str, int]  # member -> partitions it owns
    leader: str | None
    assignment_generation: int
    partitions: int
    unowned: int
    unclaimed: int
    lag: int | None
    # Partitions whose consumer is not (yet) the owner the assignment names: a hand-over
    # in progress, or an owner that has not claimed its partition yet.
    moving: int = 0
    problem: tuple[str, str] | None = None  # reason, message: why the group cannot work
    selector: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _condition(
    kind: str, status: bool | None, reason: str, message: str, generation: int
) -> dict[str, Any]:
    value = "Unknown" if status is None else ("True" if status else "False")
    return {
        "type": kind,
        "status": value,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def rebalancing(o: Observed) -> bool:
    """Whether the partitions are on their way to a new assignment: a member joined and
    has no share yet, the assignment still names members that left, or partitions are
    being handed over. Skew means nothing then (a newcomer owns 0 of 64 for a moment)."""
    if o.moving:
        return True
    if not o.members or o.unowned == o.partitions:
        return False  # no assignment yet: nothing is moving, the group is starting
    assigned = sum(o.members.values())
    joined_without_share = len(o.members) <= o.partitions and min(o.members.values()) == 0
    return assigned + o.unowned < o.partitions or joined_without_share


def conditions(o: Observed) -> list[dict[str, Any]]:
    if o.problem is not None:
        reason, message = o.problem
        degraded = _condition("Degraded", True, reason, message, o.generation)
    else:
        degraded = _condition("Degraded", False, "AsExpected", "No problem found", o.generation)

    settled = (
        o.replicas == o.spec_replicas
        and o.ready_replicas == o.spec_replicas
        and len(o.members) == o.spec_replicas
    )
    if o.spec_replicas == 0:
        ready = _condition(
            "Ready",
            o.replicas == 0,
            "ScaledToZero",
            "The group is scaled to zero members",
            o.generation,
        )
    elif o.problem is not None:
        ready = _condition("Ready", False, o.problem[0], o.problem[1], o.generation)
    elif o.ready_replicas < o.spec_replicas:
        ready = _condition(
            "Ready",
            False,
            "WaitingForMembers",
            f"{o.ready_replicas} of {o.spec_replicas} members ready",
            o.generation,
        )
    elif o.leader is None:
        ready = _condition(
            "Ready", False, "NoLeader", "No member leads the group yet", o.generation
        )
    elif o.unowned or o.unclaimed:
        ready = _condition(
            "Ready",
            False,
            "PartitionsUnassigned",
            f"{o.unowned} partitions without an owner, {o.unclaimed} not being consumed",
            o.generation,
        )
    else:
        ready = _condition(
            "Ready",
            True,
            "GroupReady",
            f"{len(o.members)} members consume {o.partitions} partitions, led by {o.leader}",
            o.generation,
        )

    if rebalancing(o):
        progressing = _condition(
            "Progressing",
            True,
            "Rebalancing",
            f"Rebalancing: {o.moving} of {o.partitions} partitions moving between "
            f"{len(o.members)} members",
            o.generation,
        )
    elif settled and o.unclaimed == 0:
        progressing = _condition(
            "Progressing", False, "Stable", "Members and assignment match the spec", o.generation
        )
    else:
        progressing = _condition(
            "Progressing",
            True,
            "Reconciling",
            f"{o.replicas} pods ({o.ready_replicas} ready, {len(o.members)} members) "
            f"for {o.spec_replicas} replicas",
            o.generation,
        )
    return [ready, progressing, degraded]


def stamp(
    new: Sequence[Mapping[str, Any]], old: Sequence[Mapping[str, Any]], now: str
) -> list[dict[str, Any]]:
    """Carry lastTransitionTime over for conditions whose status did not change."""
    previous = {c.get("type"): c for c in old}
    stamped = []
    for condition in new:
        before = previous.get(condition["type"])
        if (
            before is not None
            and before.get("status") == condition["status"]
            and before.get("lastTransitionTime")
        ):
            when = before["lastTransitionTime"]
        else:
            when = now
        stamped.append({**condition, "lastTransitionTime": when})
    return stamped


def degraded(
    old_conditions: Sequence[Mapping[str, Any]],
    reason: str,
    message: str,
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    """The conditions after a failed reconcile: Degraded is True for (reason, message).

    The reconciler knows only the problem, not the Deployment, etcd or JetStream, so the
    other conditions stay as the status timer last wrote them.
    """
    condition = _condition("Degraded", True, reason, message, generation)
    others = [c for c in old_conditions if c.get("type") != "Degraded"]
    return stamp([*others, condition], old_conditions, now)


def skew(o: Observed) -> int:
    """Most minus fewest partitions the assignment gives one member."""
    counts = list(o.members.values())
    return (max(counts) - min(counts)) if counts else 0


def status(o: Observed, old_conditions: Sequence[Mapping[str, Any]], now: str) -> dict[str, Any]:
    counts = list(o.members.values())
    result: dict[str, Any] = {
        "observedGeneration": o.generation,
        "replicas": o.replicas,
        "readyReplicas": o.ready_replicas,
        "selector": o.selector,
        "leader": o.leader or "",
        "assignmentGeneration": o.assignment_generation,
        "members": len(o.members),
        "partitionsPerMember": {"min": min(counts, default=0), "max": max(counts, default=0)},
        # None (deleted by the status patch, so `kubectl get cg` shows <none>) while the
        # group rebalances: the Status column says Rebalancing instead of a passing skew.
        "skew": None if rebalancing(o) else skew(o),
        "conditions": stamp(conditions(o), old_conditions, now),
    }
    if o.lag is not None:
        result["lag"] = o.lag
    result.update(o.extra)
    return result


#: An autoscaler record older than this does not explain a replicas change.
SCALE_RECORD_MAX_AGE = 300.0


def last_scale(
    before: int, after: int, record: ScaleRecord | None, now: float
) -> tuple[dict[str, Any], bool]:
    """status.lastScale for a change of spec.replicas, and whether the autoscaler made it.

    The leader records each decision in etcd just before it patches the scale
    subresource; a change that matches a fresh record is the autoscaler's, with its
    reason. Anything else (kubectl scale, an HPA, an edit) is reported as such.
    """
    ours = (
        record is not None
        and not record.dry_run
        and (record.from_replicas, record.to_replicas) == (before, after)
        and 0 <= now - record.time < SCALE_RECORD_MAX_AGE
    )
    when = record.time if ours and record is not None else now
    reason = (
        f"autoscaler: {record.reason}" if ours and record is not None else ("spec.replicas changed")
    )
    value = {
        "time": format_time(when),
        "from": before,
        "to": after,
        "reason": reason,
    }
    return value, ours
