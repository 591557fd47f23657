"""Member pods the scheduler cannot place: from the group's pods to what the ConsumerGroup
says about them (pure: the reconciler reads the pods, shoal.operator.observe writes the
conditions).

A pod the scheduler cannot place stays Pending with its PodScheduled condition False,
reason Unschedulable, and the scheduler's explanation as the condition's message ("0/3
nodes are available: 3 node(s) didn't match Pod's node affinity/selector. ..."). Without
this the group would only say "0 of 2 members ready", and the reason would be on pods
the user may not think of looking at.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The condition of the ConsumerGroup this module decides, and its reasons.
CONDITION = "MembersSchedulable"
UNSCHEDULABLE = "Unschedulable"
#: The Warning Event once per episode, and the Ready condition's reason meanwhile.
EVENT_REASON = "MembersUnschedulable"

#: The scheduler's message is quoted up to this many characters: it aggregates by node
#: count ("3 node(s) ..."), so it is short in practice, but a condition's message is
#: limited (32 KiB) and `kubectl describe` shows it whole.
MAX_SCHEDULER_MESSAGE = 1000


@dataclass(frozen=True)
class Unschedulable:
    """Some of the group's member pods cannot be scheduled."""

    pods: int  # member pods Pending, PodScheduled False, reason Unschedulable
    of: int  # member pods not being deleted
    scheduler: str  # the scheduler's message (the most common one among those pods)
    others: int = 0  # how many other messages those pods carry

    def message(self) -> str:
        """The condition's, the Event's and (after the member count) Ready's message."""
        noun = "pod cannot" if self.pods == 1 else "pods cannot"
        more = ""
        if self.others:
            more = f" (and {self.others} other {'reason' if self.others == 1 else 'reasons'}"
            more += ": kubectl describe pod)"
        return f"{self.pods} of {self.of} member {noun} be scheduled: {self.scheduler}{more}"


def _condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    status = pod.get("status")
    found = status.get("conditions") if isinstance(status, Mapping) else None
    for c in found if isinstance(found, list) else ():
        if isinstance(c, Mapping) and c.get("type") == kind:
            return c
    return {}


def _deleting(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata")
    return isinstance(meta, Mapping) and bool(meta.get("deletionTimestamp"))


def is_unschedulable(pod: Mapping[str, Any]) -> bool:
    """Pending, not being deleted, and the scheduler said it fits no node (PodScheduled
    False, reason Unschedulable). A pod the scheduler has not looked at yet has no such
    condition, and one gated by schedulingGates has reason SchedulingGated: neither is the
    scheduler refusing it."""
    status = pod.get("status")
    phase = status.get("phase") if isinstance(status, Mapping) else None
    scheduled = _condition(pod, "PodScheduled")
    return (
        phase == "Pending"
        and not _deleting(pod)
        and scheduled.get("status") == "False"
        and scheduled.get("reason") == UNSCHEDULABLE
    )


def unschedulable(pods: Iterable[Mapping[str, Any]]) -> Unschedulable | None:
    """What the group's pods (API objects, as `kubectl get -o json` gives them) say: None
    when the scheduler refuses none of them.

    Pods being deleted do not count, in either number: they are on their way out (a
    rollout, a scale-down) and no longer the group's members-to-be. The message quoted is
    the one most of the refused pods carry (ties: the first pod's by name), so a group
    whose pods all fail for one reason says it once.
    """
    live = sorted(
        (p for p in pods if not _deleting(p)),
        key=lambda p: str((p.get("metadata") or {}).get("name", "")),
    )
    refused = [p for p in live if is_unschedulable(p)]
    if not refused:
        return None
    messages: Sequence[str] = [
        " ".join(str(_condition(p, "PodScheduled").get("message") or "").split())
        or "no reason given"
        for p in refused
    ]
    counts = Counter(messages)
    # Counter.most_common keeps first-seen order among equal counts: the first pod's wins.
    top = counts.most_common(1)[0][0]
    if len(top) > MAX_SCHEDULER_MESSAGE:
        top = top[: MAX_SCHEDULER_MESSAGE - 3] + "..."
    return Unschedulable(pods=len(refused), of=len(live), scheduler=top, others=len(counts) - 1)


def unschedulable_in_status(status: Mapping[str, Any] | None) -> bool:
    """Whether an earlier operator process said the group's pods could not be scheduled
    (its MembersSchedulable condition is False): then it has posted the episode's Warning,
    and a restarted operator does not post it again."""
    raw = (status or {}).get("conditions")
    for c in raw if isinstance(raw, list) else ():
        if isinstance(c, Mapping) and c.get("type") == CONDITION:
            return c.get("status") == "False"
    return False
