"""What the operator remembers between handler calls: its memo, typed.

kopf gives every resource object its own memo, made with copy.copy of the operator's memo
(`OperatorMemo`, given to kopf.run, filled by the startup handler). The operator-wide
things (settings, the Kubernetes client, etcd clients, NATS connections) are shared by
every group; each group's own state (`GroupState`) is not: OperatorMemo.__copy__ gives
each copy a fresh one. kopf drops a resource's memo when the object is deleted, and a new
object of the same name gets a new one.

The state lives only in this process: after a restart the resume handler rebuilds it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from shoal.operator.builders import NatsPodSecrets
from shoal.operator.etcdalarms import AlarmReader
from shoal.operator.etcdsecret import EtcdClients
from shoal.operator.failing import Failing
from shoal.operator.kube import Kube
from shoal.operator.natssecret import NatsClients
from shoal.operator.settings import OperatorSettings
from shoal.operator.stallwatch import StallWatch


@dataclass
class GroupState:
    """One group's state, shared by its handlers (reconcile, the status timer, delete)."""

    # (reason, message) of the last failed reconcile. The status timer sees only etcd and
    # NATS, so it reports this as Degraded until a reconcile succeeds.
    problem: tuple[str, str] | None = None
    # The spec that reconcile failed with. kopf retries a failed change after a delay, but
    # a change undone meanwhile brings back the spec kopf last handled: it calls no
    # handler and drops the retry, so the status timer reconciles again once the spec is
    # no longer this one (reconciler._reconcile_undone_change).
    problem_spec: dict[str, Any] | None = None
    # When (monotonic) the timer first saw the spec differ from problem_spec; and when it
    # may try again after a reconcile of its own failed (kopf retries only its own).
    spec_undone_since: float | None = None
    timer_retry_at: float | None = None
    # Held by every reconcile, kopf's or the timer's: never two at once for a group.
    reconciling: asyncio.Lock = field(default_factory=asyncio.Lock, compare=False, repr=False)
    # The generation of the spec the last successful reconcile applied (None: none in this
    # process yet). status.observedGeneration says this one, never a spec not applied.
    reconciled_generation: int | None = None
    # Whether this process has applied the group's children: until then the status timer
    # leaves a rotated etcd Secret to the resume handler, which applies it anyway.
    applied: bool = False
    # The etcd tlsSecret version the Deployment was last applied with (None: no Secret);
    # a different version read later means the Secret was rotated.
    secret_version: str | None = None
    # What the group's NATS Secrets held (their versions, the credentials' form) when the
    # Deployment was last applied; None before that.
    nats_secrets: NatsPodSecrets | None = None
    # The change of spec.replicas a reconcile reported (status.lastScale, the Scaled
    # Event) and that no reconcile has applied yet: (from, to, the lastScale written).
    # kopf gives each retry of a failed reconcile the same old spec, so a retry of this
    # change reports nothing new (reconciler.report_scale). Cleared by a reconcile that
    # succeeds, and once the spec asks for other replicas.
    scale_reported: tuple[int, int, dict[str, Any]] | None = None
    # Deleting the group: when (monotonic) clearing its etcd keys first failed because
    # etcd was unreachable, and whether the deletionPolicy's decision was announced.
    delete_etcd_failing_since: float | None = None
    delete_etcd_decided: bool = False
    # Deleting the group with deletionPolicy Delete: when (monotonic) deleting its streams
    # first failed (NATS unreachable or refusing); retried for a bounded time.
    delete_streams_failing_since: float | None = None
    # Deleting the group: the retries so far because its etcd or NATS Secret could not be
    # used (bounded by reconciler.DELETE_SECRET_RETRIES; kopf's `retry` counts others too).
    delete_secret_failures: int = 0
    # Whether the group's etcd had its NOSPACE alarm raised at the last observation (an
    # Event is posted when it is raised and when it is cleared, not every observation).
    # None until this process observed the group: it then starts from the status's
    # Degraded condition (reason EtcdNoSpace), so a restarted operator does not post the
    # Warning again.
    etcd_no_space: bool | None = None
    # (partition, member) pairs reported stalled at the last observation that read etcd:
    # a PartitionStalled Event is posted for each new pair, not at every observation.
    # None until this process observed the group: it then starts from the status's
    # stalledPartitions, so a restarted operator does not announce them again.
    stalled: frozenset[tuple[int, str]] | None = None
    # (member, reason) of the members that reported NATS refusing them at the last
    # observation that read etcd (Keys.problems): a Warning is posted for each new one.
    # None until this process observed the group (then: the status's refusedMembers).
    refused: frozenset[tuple[str, str]] | None = None
    # Whether the scheduler refused some of the group's pods at the last observation that
    # knew (a MembersUnschedulable Warning is posted when this turns True, once). None
    # until this process observed the group: it then starts from the status's
    # MembersSchedulable condition, so a restarted operator does not post it again.
    unschedulable: bool | None = None
    # Whether member pods crash-looped or could not start at the last observation that
    # read the pods (a MembersCrashLooping or MembersCannotStart Warning is posted when
    # this turns True, once). None until this process observed the group: it then starts
    # from the status's conditions (one of them has that reason), so a restarted operator
    # does not post it again. failing_last: what that observation found, which stands
    # while the pods cannot be read.
    failing: bool | None = None
    failing_last: Failing | None = None
    # (key, mod_revision) of the garbage values in the group's etcd prefix already logged:
    # the timer reads with a new view every time, and would log each one every 5 s.
    garbage_logged: set[tuple[str, int]] = field(default_factory=set)
    # What the members report between two observations (started by the status timer,
    # stopped when the group is deleted).
    stall_watch: StallWatch | None = None
    # Recreating the group's streams after the status timer found some missing (deleted,
    # or lost with a memory-storage server's restart): the failed attempts in a row, when
    # (monotonic) the next may start, and what the last failure was (status says it while
    # the streams are still missing).
    streams_retry: int = 0
    streams_next_try: float = 0.0
    streams_problem: tuple[str, str] | None = None


class OperatorMemo:
    """The operator's memo and, copied, each group's (see the module docstring).

    The shared attributes are set by the startup handler (reconciler.startup), before kopf
    calls any handler of a group; `group` is the group's own state."""

    settings: OperatorSettings
    kube: Kube
    etcd: EtcdClients
    alarms: AlarmReader
    nats: NatsClients

    def __init__(self) -> None:
        self.group = GroupState()

    def __copy__(self) -> OperatorMemo:
        clone = object.__new__(OperatorMemo)
        clone.__dict__.update(self.__dict__)
        clone.group = GroupState()
        return clone

    def has(self, name: str) -> bool:
        """Whether the startup handler set `name` (the cleanup handler asks)."""
        return name in self.__dict__
