"""From what is observed (Deployment, its pods, etcd, JetStream) to a ConsumerGroup's
status.

Pure: the reconciler gathers the facts, this module decides what they mean. Conditions
follow the Kubernetes API conventions: Ready, Progressing, Degraded, Paused and
MembersSchedulable (shoal.operator.scheduling), each with a CamelCase reason, a message
for people, observedGeneration, and a lastTransitionTime that moves only when the
condition's status does.
"""

from __future__ import annotations

import calendar
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.contracts.names import TIME_FORMAT, format_time
from shoal.contracts.values import MemberStats, PauseRecord, ScaleRecord
from shoal.group.pause import CLI_SOURCE, RESET_SOURCE
from shoal.operator.failing import Failing
from shoal.operator.scheduling import CONDITION, EVENT_REASON, UNSCHEDULABLE, Unschedulable


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
    # (partition, member) for each partition a member reports stalled (stalled_partitions).
    stalled: tuple[tuple[int, str], ...] = ()
    stall_after: int = 60  # spec.stallAfterSeconds, for the messages
    problem: tuple[str, str] | None = None  # reason, message: why the group cannot work
    # (member, reason, message) for each member NATS refuses (Keys.problems), sorted.
    refused: tuple[tuple[str, str, str], ...] = ()
    # (member, message, since) for each member that waits for its HTTP handler to answer
    # its ready path before it joins (Keys.problems, HandlerNotReady), sorted.
    waiting: tuple[tuple[str, str, float], ...] = ()
    selector: str = ""
    # Messages in the group's dead-letter stream (`shoal-consumer dlq list`); None when
    # NATS could not tell (the status keeps what it said before).
    dead_letters: int | None = None
    # spec.paused: who paused the group and when (its pause record); None while it runs.
    paused: PauseRecord | None = None
    # Member pods the scheduler cannot place (shoal.operator.scheduling); None: none, or
    # the pods were not read because the Deployment has all its pods ready.
    unschedulable: Unschedulable | None = None
    # Member pods whose containers crash-loop or cannot start (shoal.operator.failing),
    # read from the same pods; None: none, or the pods were not read.
    failing: Failing | None = None
    # Why the member pods could not be read, if they could not (MembersSchedulable is
    # Unknown then, rather than a guess either way).
    pods_unread: str | None = None
    # member -> whether it reports reaching NATS and its HTTP handler (MemberStats.nats_ok,
    # handler_ok; absent: True). The leader gives a member that cannot none of the
    # partitions (election._eligible).
    nats_ok: Mapping[str, bool] = field(default_factory=dict)
    # Whether etcd was read: if not, what comes from it (members, leader, the assignment,
    # stalls) is not known, and the status keeps what it said before.
    etcd_read: bool = True
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
    being handed over. Skew means nothing then (a newcomer owns 0 of 64 for a moment).

    Without members nothing moves, whatever `moving` counts: claims go with the members'
    leases, and the last assignment's targets stay in etcd (a group scaled to zero). A
    member the leader leaves without a share on purpose (it reports that it cannot reach
    NATS: election._eligible) is not waiting for one."""
    if not o.members:
        return False
    if o.moving:
        return True
    if o.unowned == o.partitions:
        return False  # no assignment yet: nothing is moving, the group is starting
    assigned = sum(o.members.values())
    waiting = [n for m, n in o.members.items() if o.nats_ok.get(m, True)]
    joined_without_share = len(o.members) <= o.partitions and 0 in waiting
    return assigned + o.unowned < o.partitions or joined_without_share


def stalled_partitions(
    members: Mapping[str, MemberStats], partitions: int
) -> tuple[tuple[int, str], ...]:
    """(partition, member) for every partition a member's stats report stalled, sorted.

    The member decides what is stalled (shoal.consumer.progress) and writes the list with
    its stats; MemberStats drops entries that are no partition numbers, and numbers
    beyond this group's partitions are skipped here, so that a member of another version
    or a hand-edited key cannot take the group's status down with it.
    """
    found = {(p, m) for m, stats in members.items() for p in stats.stalled if p < partitions}
    return tuple(sorted(found))


def members_lag(members: Mapping[str, MemberStats], partitions: int) -> tuple[int, tuple[int, ...]]:
    """The lag the members report (num_pending + num_ack_pending of the durables they
    run, and what they hold), and the partitions no member runs, whose lag only their
    durables can tell.

    For a work-queue stream the stream's message count is the lag; for `limits` and
    `interest` retention the stream keeps what was processed too, so the lag is the
    durables'. The members ask theirs every stats interval anyway: the operator asks
    only the durables nobody runs. (During a hand-over two members may count one
    partition for a moment.)
    """
    total = sum(stats.lag for stats in members.values())
    run = {p for stats in members.values() for p in stats.owned}
    return total, tuple(p for p in range(partitions) if p not in run)


def by_member(stalled: Iterable[tuple[int, str]]) -> dict[str, list[int]]:
    """member -> its partitions, both sorted."""
    result: dict[str, list[int]] = {}
    for p, member in sorted(stalled, key=lambda pm: (pm[1], pm[0])):
        result.setdefault(member, []).append(p)
    return result


def _partitions(ps: Sequence[int]) -> str:
    return f"{'Partition' if len(ps) == 1 else 'Partitions'} {', '.join(map(str, ps))}"


def _remedy(members: int, count: int) -> str:
    """What happens to stalled partitions: the leader moves them, if it has where to."""
    them = "it" if count == 1 else "them"
    if members > 1:
        return "the leader moves " + ("it to another member" if count == 1 else "them elsewhere")
    # assignor.relieve_stalls leaves it in place; the member's liveness restarts it once
    # it stays stalled for WEDGED_AFTER_STALLS periods.
    return f"no other member can take {them}: the member restarts if it stays stalled"


def stalled_message(o: Observed) -> str:
    where = "; ".join(
        f"{', '.join(map(str, ps))} on {member}" for member, ps in by_member(o.stalled).items()
    )
    count = len(o.stalled)
    return (
        f"{count} {'partition' if count == 1 else 'partitions'} stalled ({where}): work "
        f"waiting and no progress for {o.stall_after} s or more; "
        f"{_remedy(len(o.members), count)}"
    )


def stall_started_message(
    member: str, partitions: Sequence[int], stall_after: int, members: int
) -> str:
    """The PartitionStalled Event: which partitions, on which member, and what happens."""
    return (
        f"{_partitions(partitions)} stalled on member {member}: work waiting and no progress "
        f"for {stall_after} s or more; {_remedy(members, len(partitions))}"
    )


def stall_ended_message(member: str, partitions: Sequence[int]) -> str:
    """The PartitionStallEnded Event. The operator only sees that the member stopped
    reporting them, not why: it says the three reasons that can be."""
    return (
        f"{_partitions(partitions)} no longer reported stalled by member {member} "
        "(progressing again, moved to another member, or the member left)"
    )


def stalls_in_status(status: Mapping[str, Any] | None) -> frozenset[tuple[int, str]]:
    """The (partition, member) pairs a status's stalledPartitions lists (what an earlier
    operator process announced); entries that are not such a pair are skipped."""
    raw = (status or {}).get("stalledPartitions")
    out: set[tuple[int, str]] = set()
    for item in raw if isinstance(raw, list) else ():
        if not isinstance(item, Mapping):
            continue
        partition, member = item.get("partition"), item.get("member")
        if isinstance(partition, int) and not isinstance(partition, bool):
            if isinstance(member, str):
                out.add((partition, member))
    return frozenset(out)


def stall_changes(
    known: Iterable[tuple[int, str]],
    now: Iterable[tuple[int, str]],
    seen_between: Iterable[tuple[int, str]] = (),
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(started, ended), each member -> partitions: the stall episodes that began and
    ended since the last observation.

    An episode is one member reporting one partition stalled, from the first observation
    that shows it to the first that does not; so a partition that stalls again on its next
    owner is a new episode. `known`: the episodes going on at the last observation; `now`:
    what this one reads; `seen_between`: what was reported in between (StallWatch), so an
    episode shorter than the timer's period still starts and ends, in that order.
    """
    old, new, between = set(known), set(now), set(seen_between)
    return by_member((new | between) - old), by_member((old | between) - new)


#: The Ready reason while members wait for their handler (spec.handlerReadyPath).
WAITING_FOR_HANDLER = "MembersWaitingForHandler"
#: Members named in the message, at most (the rest are counted).
WAITING_LISTED = 3


def waiting_message(waiting: Sequence[tuple[str, str, float]]) -> str:
    """One clause per member waiting for its handler, the longest waits first. Since
    when, not for how long: a message that changed at every observation would have the
    status written every 5 s for as long as a member waits."""
    ordered = sorted(waiting, key=lambda w: (w[2] or float("inf"), w[0]))
    parts = []
    for member, message, since in ordered[:WAITING_LISTED]:
        when = f" since {format_time(since)}" if since else ""
        parts.append(f"member {member} waits for its handler{when}: {message}")
    more = len(ordered) - WAITING_LISTED
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def refused_message(refused: Iterable[tuple[str, str, str]]) -> str:
    """One clause per member NATS refuses (the Degraded message and the Event's)."""
    return "; ".join(
        f"member {member} cannot connect to NATS: {reason}: {message}"
        for member, reason, message in refused
    )


_REFUSED = re.compile(r"(?:^|; )member (\S+) cannot connect to NATS: (\w+): ")


def refusals_in_status(status: Mapping[str, Any] | None) -> frozenset[tuple[str, str]]:
    """The (member, reason) refusals an earlier operator process announced, read back
    from the status it wrote, so a restart does not post their Warning again (and posts
    NatsRefusalEnded for one that ended meanwhile): its refusedMembers, which the status
    timer writes even while a problem of the group's own (HandlerInvalid, EtcdNoSpace,
    NatsUnavailable, ...) outranks the refusals in the Degraded condition, and which a
    failed reconcile leaves alone. Also the refusals a Degraded condition names
    (refused_message): what an operator that wrote no refusedMembers left. Entries that
    are not such a pair are skipped."""
    found: set[tuple[str, str]] = set()
    listed = (status or {}).get("refusedMembers")
    for item in listed if isinstance(listed, list) else ():
        if isinstance(item, Mapping):
            member, reason = item.get("member"), item.get("reason")
            if isinstance(member, str) and isinstance(reason, str):
                found.add((member, reason))
    raw = (status or {}).get("conditions")
    for c in raw if isinstance(raw, list) else ():
        if isinstance(c, Mapping) and c.get("type") == "Degraded" and c.get("status") == "True":
            message = c.get("message")
            if isinstance(message, str):
                found.update(_REFUSED.findall(message))
    return frozenset(found)


def no_space_in_status(status: Mapping[str, Any] | None) -> bool:
    """Whether an earlier operator process found the group's etcd with its NOSPACE alarm
    raised (and announced it): the status it wrote is Degraded for EtcdNoSpace, which
    the status timer puts ahead of every problem it finds once etcd answers. (A reconcile
    that failed since wrote its own problem there: then the alarm counts as new.)"""
    raw = (status or {}).get("conditions")
    return any(
        isinstance(c, Mapping)
        and c.get("type") == "Degraded"
        and c.get("status") == "True"
        and c.get("reason") == "EtcdNoSpace"
        for c in (raw if isinstance(raw, list) else ())
    )


def refusal_changes(
    known: Iterable[tuple[str, str]], now: Iterable[tuple[str, str]]
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(started, ended) refusal episodes, each sorted (member, reason): an episode is one
    member reporting one reason, from the first observation that shows it to the first
    that does not."""
    old, new = set(known), set(now)
    return sorted(new - old), sorted(old - new)


def conditions(o: Observed) -> list[dict[str, Any]]:
    if o.problem is not None:
        reason, message = o.problem
        degraded = _condition("Degraded", True, reason, message, o.generation)
    elif o.refused:
        # A person must act (a Secret, a server's users or CA): ahead of stalls, which
        # the leader handles. The reason is the first member's (they usually share one).
        degraded = _condition(
            "Degraded", True, o.refused[0][1], refused_message(o.refused), o.generation
        )
    elif o.failing is not None:
        # Member pods crash-loop or cannot start: a person must act (the spec, the image,
        # a Secret, the node), and alerting on Degraded should catch it. After the
        # refusals, which say more precisely why a member exits.
        degraded = _condition("Degraded", True, o.failing.reason, o.failing.message(), o.generation)
    elif o.stalled:
        # Not a problem of the group's spec or servers, but part of its work waits: that
        # is what Degraded means to tools that read only the conditions.
        degraded = _condition(
            "Degraded", True, "PartitionsStalled", stalled_message(o), o.generation
        )
    else:
        degraded = _condition("Degraded", False, "AsExpected", "No problem found", o.generation)

    settled = (
        o.replicas == o.spec_replicas
        and o.ready_replicas == o.spec_replicas
        and len(o.members) == o.spec_replicas
    )
    if o.problem is not None:
        # Before ScaledToZero too: a group with no members is still one whose stream and
        # durables producers rely on, and the problem may be that they cannot be made.
        ready = _condition("Ready", False, o.problem[0], o.problem[1], o.generation)
    elif o.spec_replicas == 0:
        ready = _condition(
            "Ready",
            o.replicas == 0,
            "ScaledToZero",
            "The group is scaled to zero members",
            o.generation,
        )
    elif o.ready_replicas < o.spec_replicas and o.refused:
        ready = _condition(
            "Ready",
            False,
            o.refused[0][1],
            f"{o.ready_replicas} of {o.spec_replicas} members ready; {refused_message(o.refused)}",
            o.generation,
        )
    elif o.ready_replicas < o.spec_replicas and o.failing is not None:
        # "0 of 3 members ready" alone would send people to the pods to find out why.
        ready = _condition(
            "Ready",
            False,
            o.failing.reason,
            f"{o.ready_replicas} of {o.spec_replicas} members ready; {o.failing.message()}",
            o.generation,
        )
    elif o.ready_replicas < o.spec_replicas and o.unschedulable is not None:
        # The count alone ("0 of 2 members ready") would send people to the pods to find
        # out why; the scheduler's own words say it here.
        ready = _condition(
            "Ready",
            False,
            EVENT_REASON,
            f"{o.ready_replicas} of {o.spec_replicas} members ready; {o.unschedulable.message()}",
            o.generation,
        )
    elif o.ready_replicas < o.spec_replicas and o.waiting:
        # Not joined on purpose (spec.handlerReadyPath): the service beside them does not
        # answer yet. The count alone would send people to the pods' logs.
        ready = _condition(
            "Ready",
            False,
            WAITING_FOR_HANDLER,
            f"{o.ready_replicas} of {o.spec_replicas} members ready; {waiting_message(o.waiting)}",
            o.generation,
        )
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

    if o.problem is not None:
        # What `kubectl get cg` shows (the Status column): the spec cannot be applied, or
        # a server the group needs cannot be reached. "Stable" there, beside a Degraded
        # condition nobody lists, would say all is well.
        progressing = _condition("Progressing", False, o.problem[0], o.problem[1], o.generation)
    elif o.failing is not None:
        # Not Reconciling: the pods will not become ready by waiting (a rollout whose new
        # pods crash-loop stops there), and the Status column says why.
        progressing = _condition(
            "Progressing", False, o.failing.reason, o.failing.message(), o.generation
        )
    elif o.stalled:
        # Next, like a Deployment's ProgressDeadlineExceeded: it is what `kubectl get cg`
        # shows (the Status column), and a move of the stalled partitions that follows is
        # Rebalancing only once no member reports them any more.
        progressing = _condition(
            "Progressing", False, "PartitionsStalled", stalled_message(o), o.generation
        )
    elif o.paused is not None:
        # What `kubectl get cg` shows while paused (the Status column): nothing progresses,
        # by request. (A stall comes first: a paused partition never reports one, so a
        # stall is news.)
        progressing = _condition(
            "Progressing", False, "Paused", paused_message(o.paused), o.generation
        )
    elif o.spec_replicas == 0 and o.replicas == 0 and not o.members:
        # Scaled to zero: the targets of the last assignment stay in etcd, unclaimed (the
        # claims went with the members' leases); nothing is on its way anywhere.
        progressing = _condition(
            "Progressing",
            False,
            "Stable",
            "Scaled to zero: no member, nothing to move",
            o.generation,
        )
    elif rebalancing(o):
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
    if o.paused is not None:
        # A reset's pause (shoal-consumer reset, interrupted) stands whatever spec.paused
        # says: ResetPaused then.
        reason = {RESET_SOURCE: "ResetPaused", CLI_SOURCE: "CommandPaused"}.get(
            o.paused.source, "SpecPaused"
        )
        paused = _condition("Paused", True, reason, paused_message(o.paused), o.generation)
    else:
        paused = _condition("Paused", False, "Running", "The group is not paused", o.generation)
    return [ready, progressing, degraded, paused, schedulable(o)]


def schedulable(o: Observed) -> dict[str, Any]:
    """MembersSchedulable: False while the scheduler refuses some member pods (even with
    the group Ready: a surge pod of a rollout that fits nowhere stalls the rollout)."""
    if o.unschedulable is not None:
        return _condition(CONDITION, False, UNSCHEDULABLE, o.unschedulable.message(), o.generation)
    if o.pods_unread is not None:
        return _condition(
            CONDITION,
            None,
            "PodsUnread",
            f"The member pods could not be read: {o.pods_unread}",
            o.generation,
        )
    return _condition(
        CONDITION, True, "Schedulable", "The scheduler refuses no member pod", o.generation
    )


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
    """The conditions after a failed reconcile: Degraded is True for (reason, message),
    and Ready and Progressing are False for it, as the status timer will write them
    (conditions(): a problem outranks the rest), so `kubectl get cg` says it at once.

    The reconciler knows only the problem, not the Deployment, etcd or JetStream, so the
    other conditions stay as the status timer last wrote them.
    """
    mine = {
        kind: _condition(kind, kind == "Degraded", reason, message, generation)
        for kind in ("Ready", "Progressing", "Degraded")
    }
    kept = [mine.pop(c.get("type"), c) for c in old_conditions]  # type: ignore[arg-type]
    return stamp([*kept, *mine.values()], old_conditions, now)


def skew(o: Observed) -> int:
    """Most minus fewest partitions the assignment gives one member."""
    counts = list(o.members.values())
    return (max(counts) - min(counts)) if counts else 0


#: The status fields that come from etcd: status() leaves them out when etcd was not read.
ETCD_FIELDS = (
    "leader",
    "assignmentGeneration",
    "members",
    "partitionsPerMember",
    "skew",
    "stalledPartitions",
    "refusedMembers",
)


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
        # None (deleted by the status patch) when nothing is stalled: describe stays short.
        "stalledPartitions": [{"partition": p, "member": m} for p, m in o.stalled] or None,
        # The members NATS refuses, also while a problem outranks them in Degraded (a
        # restarted operator reads back from here which refusals it announced).
        "refusedMembers": [{"member": m, "reason": r} for m, r, _ in o.refused] or None,
    }
    if not o.etcd_read:
        # Not known (etcd unreadable): left out, so the status keeps what it said.
        for key in ETCD_FIELDS:
            del result[key]
    if o.lag is not None:
        result["lag"] = o.lag
    if o.dead_letters is not None:
        result["deadLetters"] = o.dead_letters
    result.update(o.extra)
    return result


def status_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `new` that differ from the status the object has (`old`), for the
    status timer's merge patch; empty when nothing changed, and kopf then sends no
    request. A None value deletes its field, so it counts only where `old` has one.
    `old` is the object as kopf last saw it: should it lag behind the API server, a
    patch is at worst repeated, or put off to the next observation (5 s later), which
    compares with the object the watch has brought by then."""
    return {key: value for key, value in new.items() if old.get(key) != value}


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


# -- pause and resume ------------------------------------------------------------------------


def parse_time(value: object) -> float | None:
    """A Kubernetes time (RFC 3339, UTC, whole seconds) as a Unix time; None otherwise."""
    if not isinstance(value, str):
        return None
    try:
        return float(calendar.timegm(time.strptime(value, TIME_FORMAT)))
    except ValueError:
        return None


def pause_manager(managed_fields: object) -> tuple[str, float | None] | None:
    """Who last set spec.paused, and when: of the metadata.managedFields entries whose
    fieldsV1 holds f:spec/f:paused, the manager of the most recent (kubectl patch
    records "kubectl-patch", kubectl apply "kubectl-client-side-apply" or "kubectl",
    an operator or a controller its own name). None if no entry holds the field."""
    best: tuple[float, int, str] | None = None
    for index, entry in enumerate(managed_fields if isinstance(managed_fields, list) else ()):
        if not isinstance(entry, Mapping):
            continue
        fields = entry.get("fieldsV1")
        spec = fields.get("f:spec") if isinstance(fields, Mapping) else None
        if not isinstance(spec, Mapping) or "f:paused" not in spec:
            continue
        manager = entry.get("manager")
        when = parse_time(entry.get("time"))
        # Entries without a time rank first; ties go to the later entry.
        key = (when if when is not None else float("-inf"), index, str(manager or "unknown"))
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        return None
    when = best[0] if best[0] != float("-inf") else None
    return best[2], when


def pause_record(managed_fields: object, now: float) -> PauseRecord:
    """The pause record the operator writes for spec.paused: its manager and time."""
    who = pause_manager(managed_fields)
    by, when = who if who is not None else ("unknown", None)
    return PauseRecord(by=by, time=when if when is not None else now, source="spec.paused")


def paused_message(record: PauseRecord) -> str:
    """The Paused condition's (and Event's) message."""
    if record.source == RESET_SOURCE:
        return (
            f"Paused {record.describe()}: `shoal-consumer reset` recreates the durables and "
            "resumes the group when it is done. If that reset was interrupted, run it again "
            "(it resumes the group), or `shoal-consumer resume` to go on from where the "
            "durables are now (spec.paused does not lift a reset's pause)"
        )
    # A pause `shoal-consumer pause` made stands whatever spec.paused says (the operator
    # lifts only its own): the command lifts it.
    how = "`shoal-consumer resume`" if record.source == CLI_SOURCE else "spec.paused: false"
    return (
        f"Paused {record.describe()}: members finished what they were running and pull "
        f"nothing; partitions stay where they are; the autoscaler waits. Resume with {how}"
    )


def resumed_message(by: str, record: PauseRecord, now: float) -> str:
    """The Resumed Event's message: who resumed, and how long the pause lasted."""
    lasted = f" after {now - record.time:.0f} s" if record.time > 0 else ""
    return f"Resumed by {by}{lasted} (paused {record.describe()}): members pull again"
