"""The leader's autoscaling loop: read stats, decide (consumer/scaler.py), act.

Every ``spec.autoscaling.intervalSeconds`` the leader
  1. reads its ConsumerGroup (the spec may change at any time: policy and replicas are
     never cached);
  2. collects the stats every member keeps in etcd (cpu, active projects, lag, rate: the
     newer of ``members/<id>`` and ``stats/<id>``, which the leader's view polls; stale
     after three rounds or three of their own periods, :meth:`Autoscaler._policy`) and
     whether a hand-over is in progress (some partition not yet consumed by the owner the
     assignment names: no load decision then, but replicas outside
     [minReplicas, maxReplicas] are still brought back);
  3. calls the pure :func:`decide`;
  4. acts: records the decision in etcd (``<prefix>scale``, epoch-guarded: the operator
     turns it into ``status.lastScale`` and a successor keeps the cooldown, timed by its
     own monotonic clock from when it saw the record, never by the writer's wall clock:
     see :func:`resume_state`), marks the
     scale-down victim with ``pod-deletion-cost``, patches the ``scale`` subresource and
     posts a ``ScaledUp``/``ScaledDown`` Event with the signal values. A dry run records
     and reports (``WouldScaleUp``/``WouldScaleDown``) but changes nothing.

While the group is paused (spec.paused, or its `paused` key) the leader decides nothing
(:func:`paused_reason`): nothing is processed, so lag and CPU say nothing about the load.
Nor while every member's HTTP handler accepts no connection (:func:`handlers_away_reason`):
the lag grows for a reason more members would meet as well.

Every round, autoscaling on or off, the leader also keeps the members' pod-deletion-cost
current (its own highest, the others their partition counts), so a scale-down by anyone
spares the leader. API errors back off (the next evaluation, then doubling, up to 5
minutes) and are logged; a member whose stats are missing or garbage is left out for that
round by the decision function.

The cooldown starts only when a scale took effect. A scale that failed (the API server
refused the patch: 403, 409, 422, ...; or etcd could not record the decision) changed
nothing: it raises :class:`ScaleFailed`, is logged at every try and posted once as a
``ScaleFailed`` Warning Event, its record is withdrawn from etcd, and the next round
decides again, after the backoff.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol

from shoal.clients.etcd import TRANSIENT_ERRORS, Etcd
from shoal.consumer.membership import routine_stats_period
from shoal.consumer.scaler import Action, Decision, Policy, ScalerState, decide, without_action
from shoal.contracts.spec import ConsumerGroupSpec, parse_spec
from shoal.contracts.values import MemberStats, PauseRecord, ScaleRecord
from shoal.group.config import GroupConfig
from shoal.group.view import STATS_POLL_SECONDS, Claim, GroupView, Target

log = logging.getLogger(__name__)

MAX_BACKOFF_SECONDS = 300.0
#: Pod deletion costs: the ReplicaSet removes the lowest first (ties: its own ranking).
LEADER_COST = 1_000_000
VICTIM_COST = -1_000_000
#: Generations written this long after a scale, until the members match it, are its doing.
SCALE_SETTLE_SECONDS = 120.0
#: How long a scale-down victim stays marked if it does not leave.
VICTIM_MARK_SECONDS = 120.0


class ScaleFailed(RuntimeError):
    """A decided scale that did not take effect: nothing changed, no cooldown started."""


def retry_delay(interval: float, failures: int) -> float:
    """How long after the `failures`-th failed round in a row the loop tries again: the
    next evaluation first, then doubling, so a permanent denial is retried (and logged)
    at most once every MAX_BACKOFF_SECONDS."""
    return float(min(MAX_BACKOFF_SECONDS, interval * 2 ** max(0, failures - 1)))


class ScaleTarget(Protocol):
    """What the loop needs from Kubernetes (consumer/kube.py's GroupObject)."""

    async def read(self) -> dict[str, Any]: ...

    async def scale(self, replicas: int) -> None: ...

    async def event(self, reason: str, message: str, uid: str, warning: bool = False) -> None: ...

    async def set_deletion_costs(self, costs: dict[str, int]) -> None: ...


class LeaderState(Protocol):
    is_leader: bool
    epoch: int

    def expect_scale(self, replicas: int, until: float) -> None: ...


# -- pure helpers -------------------------------------------------------------------------


def handover_in_progress(
    partitions: int, targets: Mapping[int, Target], claims: Mapping[int, Claim]
) -> bool:
    """True while some partition has no owner or is not consumed by the owner named."""
    for p in range(partitions):
        target, claim = targets.get(p), claims.get(p)
        if target is None or claim is None or claim.member != target.owner:
            return True
    return False


def choose_victim(owners: Mapping[int, str], members: list[str], leader: str) -> str | None:
    """The member a scale-down should remove: not the leader, fewest partitions.

    Ties go to the greatest member id (with generated pod names: an arbitrary but stable
    pick, so two rounds agree).
    """
    counts = Counter(owners.values())
    candidates = [m for m in members if m != leader]
    if not candidates:
        return None
    return min(candidates, key=lambda m: (counts.get(m, 0), _reverse(m)))


def _reverse(text: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in text)


def deletion_costs(
    owners: Mapping[int, str], members: list[str], leader: str, victim: str | None
) -> dict[str, int]:
    """Every member's pod-deletion-cost: its partition count, the leader highest, the victim
    lowest. All members are annotated, so a stale mark from an earlier round (a member
    that was the victim then and now owns partitions) cannot pick the wrong pod."""
    counts = Counter(owners.values())
    costs = {m: counts.get(m, 0) for m in members}
    costs[leader] = LEADER_COST
    if victim is not None:
        costs[victim] = VICTIM_COST
    return costs


def event_message(decision: Decision, current: int) -> str:
    """One line for ``kubectl describe cg``: the change, the reason, the signals."""
    shown = {k: v for k, v in decision.signals.items() if v is not None}
    signals = ", ".join(
        f"{k}={round(v, 2) if isinstance(v, float) else v}" for k, v in shown.items()
    )
    prefix = "dry run: would scale" if decision.dry_run else "Scaled"
    return f"{prefix} {current} -> {decision.replicas}: {decision.reason} [{signals}]"


def resume_state(record: ScaleRecord | None, seen_ago: float, now: float) -> ScalerState:
    """A new leader's scaler state: it keeps the cooldown its predecessor started.

    ``record.time`` is the predecessor's wall clock, and two hosts' clocks may disagree
    by any amount: a clock behind would cut the cooldown short (a flap), one ahead would
    stretch it. So the cooldown runs from when *this* process first saw the record
    (``seen_ago`` seconds ago by its own monotonic clock; ``now`` is its wall clock, the
    one :func:`decide` compares with). That is never earlier than the write, so the
    cooldown is never shorter than configured; at worst (a record older than this
    process) it runs from this process's start.
    """
    if record is None:
        return ScalerState()
    direction: Action = "up" if record.to_replicas > record.from_replicas else "down"
    return ScalerState(last_action_time=now - max(0.0, seen_ago), last_action_direction=direction)


def paused_reason(spec_paused: bool, record: PauseRecord | None) -> str | None:
    """Why the autoscaler does nothing this round, if the group is paused: by its
    `paused` key (the operator's, or `shoal-consumer pause`'s), or by spec.paused before
    the operator has written the key. None while it runs."""
    if record is not None:
        return f"paused {record.describe()}: no scaling until the group resumes"
    if spec_paused:
        return "paused (spec.paused): no scaling until the group resumes"
    return None


def handlers_away_reason(stats: Mapping[str, MemberStats]) -> str | None:
    """Why the autoscaler does nothing this round, if every member reports that its HTTP
    handler accepts no connection (MemberStats.handler_ok; reach.py): their messages wait,
    the lag grows, and new members would find the service as away (a service they share,
    or one image's sidecars all failing). Some members able: they consume, and the
    decision stands on their figures as ever. None otherwise."""
    if stats and all(s.handler_ok is False for s in stats.values()):
        return "every member's HTTP handler accepts no connection: no scaling until one does"
    return None


# -- the loop -----------------------------------------------------------------------------


class Autoscaler:
    def __init__(
        self,
        config: GroupConfig,
        etcd: Etcd,
        view: GroupView,
        leader: LeaderState,
        target: ScaleTarget,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.etcd = etcd
        self.view = view
        self.leader = leader
        self.target = target
        self.clock = clock
        self.monotonic = monotonic
        # (mod_revision of the scale record, our monotonic time when we first saw it):
        # every member tracks it, leader or not, so a successor knows how long ago the
        # last action was without reading anyone else's clock (see resume_state).
        self._seen: tuple[int, float] | None = None
        self.state: ScalerState | None = None
        self.last_reason = ""
        self._marked: dict[str, int] = {}  # pod-deletion-costs this term has set
        self._victim: tuple[str | None, float] | None = None  # (member, mark until)
        # The leader epoch that state, _marked and _victim belong to (0: none yet).
        self._term = 0
        self.decisions = 0
        self.actions = 0
        # Why the last scale failed (None after a success): its Warning Event is posted
        # once per episode, not at every retry.
        self._failure: str | None = None

    async def run(self) -> None:
        interval, failures = 30.0, 0
        while True:
            self._observe_record()
            if not self.leader.is_leader:
                self._new_term(0)
                await asyncio.sleep(1.0)
                continue
            try:
                interval = await self.round()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                delay = retry_delay(interval, failures)
                log.warning(
                    "Autoscaling round failed (%s); next try in %.0f s",
                    _short(exc),
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            await asyncio.sleep(interval)

    def _new_term(self, epoch: int) -> None:
        """Forget what an earlier term decided and marked when the leader epoch is not
        the one it was built under: a later term starts from etcd's record, not memory.
        Checked every round too, not only when run() sees is_leader False between two
        sleeps: leadership lost and won back inside one interval (another member led,
        and maybe scaled, meanwhile) is a new term all the same."""
        if epoch != self._term:
            self._term = epoch
            self.state = None
            self._marked = {}
            self._victim = None

    def _policy(self, spec: ConsumerGroupSpec) -> Policy:
        """The spec's policy, with how old healthy members' stats get here: their write
        period in a group of this size, plus the view's reading period."""
        written = routine_stats_period(self.config.keepalive_interval, len(self.view.members()))
        period = written + STATS_POLL_SECONDS
        return replace(Policy.from_spec(spec), report_period_seconds=period)

    async def round(self) -> float:
        """One decision (and action); returns the interval until the next."""
        self._new_term(self.leader.epoch)
        await self._mark_pods(self._pending_victim())
        group = await self.target.read()
        spec = parse_spec(group.get("spec") or {})
        policy = self._policy(spec)
        if not policy.enabled:
            self.state = None
            return policy.interval_seconds
        held = paused_reason(spec.paused, self.view.paused()) or handlers_away_reason(
            self.view.members()
        )
        if held is not None:
            # A paused group processes nothing by design: its lag grows and its CPU falls,
            # and a decision drawn from them would be wrong both ways. The windows start
            # again after the resume (from etcd's record, so a cooldown still holds).
            self.state = None
            if held != self.last_reason:
                log.info("Autoscaler: %d replicas; %s", spec.replicas, held)
                self.last_reason = held
            return policy.interval_seconds
        self._observe_record()
        if self.state is None:
            seen_ago = 0.0 if self._seen is None else self.monotonic() - self._seen[1]
            self.state = resume_state(self._record(), seen_ago, self.clock())
        current = spec.replicas
        stats = {member: data for member, data in self.view.members().items()}
        busy = handover_in_progress(self.config.partitions, self.view.targets(), self.view.claims())
        before = self.state
        decision, after = decide(stats, current, policy, self.clock(), before, busy)
        self.decisions += 1
        if decision.action == "none":
            self.state = after
            if decision.reason != self.last_reason:
                log.info("Autoscaler: %d replicas; %s", current, decision.reason)
                self.last_reason = decision.reason
            return policy.interval_seconds
        self.last_reason = ""
        uid = str(group["metadata"].get("uid", ""))
        try:
            took_effect = await self._act(decision, current, uid)
        except Exception as exc:
            # Nothing changed, so no cooldown: the next round decides again.
            self.state = without_action(after, before)
            self._victim = None  # no scale-down is coming: the next round unmarks it
            failure = _short(exc)
            if failure != self._failure:
                self._failure = failure
                await self._event(
                    "ScaleFailed",
                    f"Could not scale {current} -> {decision.replicas} ({decision.reason}): "
                    f"{failure}; no cooldown started, retrying with backoff",
                    uid,
                    warning=True,
                )
            raise ScaleFailed(
                f"could not scale {current} -> {decision.replicas}: {failure}; no cooldown started"
            ) from exc
        self._failure = None
        self.state = after if took_effect else without_action(after, before)
        return policy.interval_seconds

    def _pending_victim(self) -> str | None:
        """The victim of our last scale-down while it is still a member (and not too long)."""
        if self._victim is None:
            return None
        victim, until = self._victim
        if victim not in self.view.members() or time.monotonic() > until:
            self._victim = None
            return None
        return victim

    async def _mark_pods(self, victim: str | None) -> None:
        """Keep every member's pod-deletion-cost current, so that any scale-down (ours,
        `kubectl scale`, an HPA) removes a member with few partitions, never the leader.
        Only changed values are patched."""
        costs = deletion_costs(
            self.view.owners(), sorted(self.view.members()), self.config.member_id, victim
        )
        changed = {m: c for m, c in costs.items() if self._marked.get(m) != c}
        if changed:
            await self.target.set_deletion_costs(changed)
            self._marked.update(changed)

    def _observe_record(self) -> None:
        """Note when this process first saw the current scale record (by mod_revision)."""
        kv = self.view.kvs.get(self.config.keys.scale)
        if kv is not None and (self._seen is None or self._seen[0] != kv.mod_revision):
            self._seen = (kv.mod_revision, self.monotonic())

    def _record(self) -> ScaleRecord | None:
        kv = self.view.kvs.get(self.config.keys.scale)
        if kv is None:
            return None
        record = ScaleRecord.parse(kv.value)
        if record is None:
            log.warning("Ignoring garbage at %s", self.config.keys.scale)
        return record

    async def _act(self, decision: Decision, current: int, uid: str) -> bool:
        """Record the decision, then apply it (or, in a dry run, report it). True when it
        took effect; False when leadership was lost first; an exception when it failed."""
        record = ScaleRecord(
            time=self.clock(),
            from_replicas=current,
            to_replicas=decision.replicas,
            reason=decision.reason,
            dry_run=decision.dry_run,
            epoch=self.leader.epoch,
        )
        keys = self.config.keys
        try:
            written = await self.etcd.guarded_put_many(
                keys.leader, self.leader.epoch, {keys.scale: record.to_json()}
            )
        except TRANSIENT_ERRORS as exc:
            raise RuntimeError(f"could not record the decision in etcd: {exc}") from exc
        if not written:
            log.info("Lost leadership before scaling; leaving it to the next leader")
            return False
        message = event_message(decision, current)
        up = decision.action == "up"
        if decision.dry_run:
            log.info("Autoscaler (dry run): %s", message)
            await self._event("WouldScaleUp" if up else "WouldScaleDown", message, uid)
            return True
        try:
            await self._scale(decision, up)
        except Exception:
            await self._withdraw(keys.scale)
            raise
        self.actions += 1
        log.info("Autoscaler: %s", message)
        await self._event("ScaledUp" if up else "ScaledDown", message, uid)
        return True

    async def _scale(self, decision: Decision, up: bool) -> None:
        if not up:
            victim = choose_victim(
                self.view.owners(), sorted(self.view.members()), self.config.member_id
            )
            # The mark must outlive this round: the ReplicaSet acts only once the operator
            # has moved the Deployment.
            self._victim = (victim, time.monotonic() + VICTIM_MARK_SECONDS)
            await self._mark_pods(victim)
            log.info("Scale-down victim: %s (fewest partitions, not the leader)", victim)
        await self.target.scale(decision.replicas)
        # The generation that follows is this scale's doing, for the assignment log. (Set
        # once the patch went through: members join or leave seconds after it.)
        self.leader.expect_scale(decision.replicas, time.monotonic() + SCALE_SETTLE_SECONDS)

    async def _withdraw(self, key: str) -> None:
        """Delete the record of a scale that failed, so that no successor holds a cooldown
        for it (a successor times the cooldown from when it saw the record).

        Not epoch-guarded (the client has no guarded delete), but it follows our guarded
        write by one API call: a successor would have to win an election and record a
        scale in between. Should the delete fail, a successor would hold one needless
        cooldown; this leader holds none (its scaler state lives in memory)."""
        try:
            await self.etcd.delete(key)
        except TRANSIENT_ERRORS as exc:
            log.warning("Could not withdraw the record of the failed scale: %s", exc)

    async def _event(self, reason: str, message: str, uid: str, warning: bool = False) -> None:
        # The decision stands even when its Event cannot be posted.
        try:
            await self.target.event(reason, message, uid, warning=warning)
        except Exception as exc:
            log.warning("Could not post the %s Event: %s", reason, _short(exc))


def _short(exc: BaseException) -> str:
    if isinstance(exc, ScaleFailed):
        return str(exc)
    reason = getattr(exc, "reason", None)
    status = getattr(exc, "status", None)
    if status is not None:
        return f"API {status} {reason or ''}".strip()
    return f"{type(exc).__name__}: {exc}"
