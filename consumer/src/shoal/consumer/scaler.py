"""Autoscaling decisions for a consumer group (DESIGN.md, "Scaling").

Pure and deterministic: no I/O, no clock reads (``now`` is a parameter), no randomness.
The leader calls :func:`decide` every ``interval_seconds`` with the stats each member
published in etcd, applies the returned :class:`Decision` through the ConsumerGroup's
``scale`` subresource (unless it is a dry run) and keeps the returned
:class:`ScalerState` for the next round. The only side effect is logging: a member whose
stats are missing, garbage or stale is logged once when it starts being ignored, not on
every round.

Rules (the seed's, made safe, plus an HPA-like lag target):

* **Up** when any member's CPU (percent of its limit) is ``>= cpu_threshold``, or the
  average number of active projects per member is ``> max_projects_per_member`` (+1
  each, as the seed), or, when ``target_lag_per_member`` is set, toward
  ``ceil(total lag / target)`` unless the lag per member is within ``tolerance`` (10%)
  of the target. Several rules asking for more take the largest; one step adds at most
  ``max_step_up`` members.
* **Down** by exactly one member when the average number of active projects per member
  is ``< min_projects_per_member`` or the lag target asks for fewer members, and only if

  - every expected member reported usable stats this round (a missing member might be
    the busy one: missing data may scale up, never down);
  - removing one member would not immediately trip an up rule: the projected CPU
    (``cpu_max * n / (n - 1)``), active projects per member and lag per member stay
    under their thresholds (this is the hysteresis the seed lacks: without it a
    down/up pair flaps once per cooldown), and going to zero needs an idle group;
  - every recommendation of the last ``scale_down_window_seconds`` agreed (a spike's
    trough, a sawtooth or noise never lasts a whole window), with no gap of more than
    ``2 * interval_seconds`` between two of them: rounds that did not happen (failed
    rounds back off, and record nothing) saw nothing, so they cannot agree.

* **Never** a change inside ``cooldown_seconds`` after an action (so no reversal in a
  cooldown), while a rebalance (hand-over) is in progress, or without any data; never
  outside ``[min_replicas, min(max_replicas, partitions)]``. A current count outside
  those bounds is brought back to them at once ("below minReplicas"), even inside a
  cooldown, during a hand-over and without data: bounds are hard limits, not load
  heuristics, and clamping is idempotent so it cannot flap.
* The cooldown that :func:`decide` starts with an action holds only if the action took
  effect: for one that failed, the caller keeps :func:`without_action` of the state, and
  the next round decides again.

Defaults that are not in the CRD:

* ``max_step_up = 4``: the seed rules only ever ask for +1, so the cap only bounds the
  lag rule. With a 10-minute cooldown, +1 per step would need an hour to go from 2 to 8
  members under a backlog; 4 gets there in one step while a single bogus lag reading
  (a stuck ``num_pending``) costs at most 4 pods for one cooldown. One rebalance that
  adds 4 members moves fewer partitions than 4 rebalances adding one each.
* ``scale_down_window_seconds = min(300, cooldown)`` (300 s is the HPA's default
  scale-down stabilization): 10 rounds at 30 s must agree. It is never longer than the
  cooldown, so after an action the window fills during the cooldown and adds no delay;
  and a new leader (empty history) cannot scale down on a single reading.

Dry run: decisions are computed, reported with ``dry_run=True`` and the cooldown is
recorded as if they had been applied, so the Events a dry run produces are the ones a
real run would (one action per cooldown, not one per interval).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from shoal.contracts.names import format_time
from shoal.contracts.spec import AutoscalingSpec, ConsumerGroupSpec, parse_spec
from shoal.contracts.values import MAX_CPU_PERCENT, MemberStats, ValueRefused

__all__ = [
    "DEFAULT_MAX_STEP_UP",
    "DEFAULT_SCALE_DOWN_WINDOW_SECONDS",
    "DEFAULT_TOLERANCE",
    "MAX_CPU_PERCENT",
    "STALE_INTERVALS",
    "Action",
    "Decision",
    "MemberStats",
    "Policy",
    "ScalerState",
    "decide",
    "parse_stats",
    "without_action",
]

log = logging.getLogger(__name__)

Action = Literal["up", "down", "none"]
SignalValue = float | int | str | None

DEFAULT_TOLERANCE = 0.10
DEFAULT_MAX_STEP_UP = 4
DEFAULT_SCALE_DOWN_WINDOW_SECONDS = 300.0
#: Stats older than this many intervals, or of their own periods when those are longer
#: (by their ``ts``: Policy.stale_after_seconds), count as missing.
STALE_INTERVALS = 3


# -- policy -------------------------------------------------------------------------------


# Policy's defaults are the spec's (shoal.contracts.spec), so each is written once.
_AUTOSCALING = AutoscalingSpec()
_GROUP_DEFAULTS = {
    name: ConsumerGroupSpec.model_fields[name].default
    for name in ("min_replicas", "max_replicas", "partitions")
}


@dataclass(frozen=True)
class Policy:
    """How to scale: ConsumerGroup ``spec.autoscaling`` plus the replica bounds."""

    enabled: bool = _AUTOSCALING.enabled
    interval_seconds: float = _AUTOSCALING.interval_seconds
    cooldown_seconds: float = _AUTOSCALING.cooldown_seconds
    cpu_threshold: float = _AUTOSCALING.cpu_threshold
    max_projects_per_member: int = _AUTOSCALING.max_projects_per_member
    min_projects_per_member: int = _AUTOSCALING.min_projects_per_member
    target_lag_per_member: int | None = _AUTOSCALING.target_lag_per_member
    dry_run: bool = _AUTOSCALING.dry_run
    min_replicas: int = _GROUP_DEFAULTS["min_replicas"]
    max_replicas: int = _GROUP_DEFAULTS["max_replicas"]
    partitions: int = _GROUP_DEFAULTS["partitions"]
    tolerance: float = DEFAULT_TOLERANCE
    max_step_up: int = DEFAULT_MAX_STEP_UP
    scale_down_window_seconds: float = DEFAULT_SCALE_DOWN_WINDOW_SECONDS
    # How old a healthy member's stats can be when a round reads them: how often members
    # write them plus how often the leader reads them (the autoscaler sets it; 0: the
    # interval alone decides).
    report_period_seconds: float = 0.0

    def __post_init__(self) -> None:
        checks: list[tuple[str, bool]] = [
            ("interval_seconds > 0", self.interval_seconds > 0),
            ("cooldown_seconds >= 0", self.cooldown_seconds >= 0),
            ("cpu_threshold > 0", self.cpu_threshold > 0),
            ("max_projects_per_member >= 0", self.max_projects_per_member >= 0),
            ("min_projects_per_member >= 0", self.min_projects_per_member >= 0),
            (
                "target_lag_per_member is None or >= 1",
                self.target_lag_per_member is None or self.target_lag_per_member >= 1,
            ),
            # 0 would be a dead end: no member, no leader, nobody to scale up again.
            ("min_replicas >= 1", self.min_replicas >= 1),
            ("max_replicas >= 1", self.max_replicas >= 1),
            ("partitions >= 1", self.partitions >= 1),
            ("0 <= tolerance < 1", 0 <= self.tolerance < 1),
            ("max_step_up >= 1", self.max_step_up >= 1),
            ("scale_down_window_seconds >= 0", self.scale_down_window_seconds >= 0),
            ("report_period_seconds >= 0", self.report_period_seconds >= 0),
        ]
        for text, ok in checks:
            if not ok:
                raise ValueError(f"invalid scaling policy: need {text} ({self!r})")

    @property
    def upper(self) -> int:
        """Most replicas allowed: ``maxReplicas``, and never more members than partitions."""
        return min(self.max_replicas, self.partitions)

    @property
    def lower(self) -> int:
        """Fewest replicas allowed (``minReplicas``, at most :attr:`upper`)."""
        return min(self.min_replicas, self.upper)

    @property
    def stale_after_seconds(self) -> float:
        """Stats older than this count as missing: three rounds, or three of the stats'
        own periods when those are longer (members write them every keepalive, more
        rarely in big groups, and the leader reads them every few seconds: with a 1 s
        interval, healthy members' 3-6 s old stats were ignored in most rounds, and a
        group with members ignored is never scaled down)."""
        return STALE_INTERVALS * max(self.interval_seconds, self.report_period_seconds)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | ConsumerGroupSpec) -> Policy:
        """The policy of a ConsumerGroup ``spec`` (camelCase, as the API server returns
        it, or its model). Missing fields take the spec's defaults; ill-typed or
        out-of-range values raise :class:`ValueError` (SpecError)."""
        model = parse_spec(spec)
        auto = model.autoscaling
        return cls(
            enabled=auto.enabled,
            interval_seconds=auto.interval_seconds,
            cooldown_seconds=auto.cooldown_seconds,
            cpu_threshold=auto.cpu_threshold,
            max_projects_per_member=auto.max_projects_per_member,
            min_projects_per_member=auto.min_projects_per_member,
            target_lag_per_member=auto.target_lag_per_member,
            dry_run=auto.dry_run,
            min_replicas=model.min_replicas,
            max_replicas=model.max_replicas,
            partitions=model.partitions,
            # Never longer than the cooldown: the window then fills during the cooldown
            # and a short cooldown (tests, demos) is not silently stretched to 5 minutes.
            scale_down_window_seconds=min(DEFAULT_SCALE_DOWN_WINDOW_SECONDS, auto.cooldown_seconds),
        )


# -- member stats -------------------------------------------------------------------------


def parse_stats(raw: Mapping[str, Any] | MemberStats) -> MemberStats | None:
    """One member's stats if the autoscaler can use them, else None (the rules are
    MemberStats'; scaling needs ``cpu``, ``ts``, ``active_projects`` and ``lag``, and none
    of its fields broken)."""
    problem, stats = _scaling_stats(raw)
    return stats if problem is None else None


def _scaling_stats(raw: object) -> tuple[str | None, MemberStats | None]:
    """(why the autoscaler cannot use `raw`, or None; the stats, when it can)."""
    if isinstance(raw, MemberStats):
        stats = raw
    elif not isinstance(raw, Mapping):
        return f"not a mapping ({type(raw).__name__})", None
    else:
        try:
            stats = MemberStats.parse(raw)
        except ValueRefused as exc:
            return str(exc), None
    problem = stats.scaling_problem()
    return problem, (stats if problem is None else None)


# -- decision and state -------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """What the leader should do this round.

    ``replicas`` is the desired count (equal to the current one when ``action`` is
    "none"). ``recommended`` is what the load rules asked for before the cooldown and
    the stabilization window held it back (for Events and status). With ``dry_run`` the
    caller reports the decision and changes nothing. ``ignored`` maps members whose stats
    were not used this round to the reason.
    """

    replicas: int
    reason: str
    signals: dict[str, SignalValue]
    action: Action = "none"
    dry_run: bool = False
    recommended: int = 0
    ignored: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ScalerState:
    """What :func:`decide` remembers between rounds (immutable; decide returns a new one).

    ``history``: ``(time, recommendation)`` of recent rounds, ``None`` for a round that
    had no recommendation (no data, rebalance, disabled), which breaks the scale-down
    window's agreement; so does a gap of more than ``2 * interval_seconds`` between two
    entries (rounds that failed or did not run). ``ignored``: members ignored last round
    (to log each only once).
    """

    history: tuple[tuple[float, int | None], ...] = ()
    last_action_time: float | None = None
    last_action_direction: Action | None = None
    ignored: frozenset[str] = frozenset()


def _fmt(value: float) -> str:
    """A short number: 95, 50.5, 1.3."""
    return f"{round(value, 1):g}"


def _utc(t: float) -> str:
    return format_time(t)


def _collect(
    stats: Mapping[str, MemberStats | Mapping[str, Any] | None], policy: Policy, now: float
) -> tuple[dict[str, MemberStats], dict[str, str]]:
    reports: dict[str, MemberStats] = {}
    ignored: dict[str, str] = {}
    for member in sorted(stats, key=str):
        raw = stats[member]
        if raw is None:
            ignored[member] = "no stats"
            continue
        problem, parsed = _scaling_stats(raw)
        if parsed is None:
            ignored[member] = f"garbage stats: {problem}"
            continue
        age = now - parsed.ts
        if age > policy.stale_after_seconds:
            ignored[member] = f"stale stats ({_fmt(age)}s old)"
        elif -age > policy.stale_after_seconds:
            ignored[member] = f"stats from the future ({_fmt(-age)}s ahead)"
        else:
            reports[member] = parsed
    return reports, ignored


def _signals(reports: Mapping[str, MemberStats], current: int) -> dict[str, SignalValue]:
    n = len(reports)
    signals: dict[str, SignalValue] = {
        "members_reporting": n,
        "members_expected": current,
        "cpu_max": None,
        "cpu_max_member": None,
        "projects_avg": None,
        "projects_total": None,
        "lag_total": None,
        "lag_per_member": None,
        "rate_total": None,
        "inflight_total": None,
    }
    if n == 0:
        return signals
    # Ties go to the first member by id, so the reason is deterministic.
    hot = max(sorted(reports), key=lambda m: reports[m].cpu)
    projects = sum(s.active_projects for s in reports.values())
    lag = sum(s.lag for s in reports.values())
    signals.update(
        cpu_max=reports[hot].cpu,
        cpu_max_member=hot,
        projects_avg=projects / n,
        projects_total=projects,
        lag_total=lag,
        lag_per_member=lag / max(current, 1),
        rate_total=round(sum(s.rate for s in reports.values()), 6),
        inflight_total=sum(s.inflight for s in reports.values()),
    )
    return signals


def _recommend(reports: Mapping[str, MemberStats], current: int, policy: Policy) -> tuple[int, str]:
    """The load rules' recommendation for this round (before cooldown and window)."""
    n = current
    hot = max(sorted(reports), key=lambda m: reports[m].cpu)
    cpu_max = reports[hot].cpu
    projects = sum(s.active_projects for s in reports.values())
    avg = projects / len(reports)
    lag = sum(s.lag for s in reports.values())
    inflight = sum(s.inflight for s in reports.values())
    target = policy.target_lag_per_member

    ups: list[tuple[int, str]] = []
    downs: list[str] = []
    holds: list[str] = []
    if cpu_max >= policy.cpu_threshold:
        ups.append((n + 1, f"cpu {_fmt(cpu_max)}% on {hot} >= {_fmt(policy.cpu_threshold)}%"))
    if avg > policy.max_projects_per_member:
        ups.append(
            (
                n + 1,
                f"avg {_fmt(avg)} active projects per member > {policy.max_projects_per_member}",
            )
        )
    elif avg < policy.min_projects_per_member:
        downs.append(
            f"avg {_fmt(avg)} active projects per member < {policy.min_projects_per_member}"
        )
    if target is not None:
        desired = -(-lag // target)  # ceil, exact on ints
        members = "member" if n == 1 else "members"
        if abs(lag - target * n) <= policy.tolerance * target * n:
            holds.append(
                f"within tolerance: lag {lag} over {n} {members}, target {target} "
                f"+/- {policy.tolerance:.0%}"
            )
        elif desired > n:
            ups.append((desired, f"lag {lag} over {n} {members}, target {target} -> {desired}"))
        elif desired < n:
            downs.append(f"lag {lag} over {n} {members}, target {target} -> {desired}")
        else:
            holds.append(f"lag {lag} over {n} {members}, target {target} -> {desired}")

    if ups:
        rec = max(v for v, _ in ups)
        reason = "; ".join(r for _, r in ups)
        if rec > policy.upper:
            bound = "maxReplicas" if policy.max_replicas <= policy.partitions else "partitions"
            if policy.upper <= n:
                return n, f"{reason}, but already at {bound} {policy.upper}"
            rec = policy.upper
            reason += f" (capped at {bound} {policy.upper})"
        if rec > n + policy.max_step_up:
            rec = n + policy.max_step_up
            reason += f" (step capped at +{policy.max_step_up})"
        return rec, reason

    if downs:
        reason = "; ".join(downs)
        if len(reports) < n:
            return n, (
                f"{reason}, but scale-down needs stats from all {n} members "
                f"({len(reports)} reporting)"
            )
        if n - 1 < policy.lower:
            return n, f"{reason}, but already at minReplicas {policy.lower}"
        if n - 1 == 0:
            if projects or lag or inflight:
                return n, f"{reason}, but scaling to zero needs an idle group"
            return 0, reason
        # Hysteresis: a member less must not trip an up rule right away.
        cpu_after = cpu_max * n / (n - 1)
        if cpu_after >= policy.cpu_threshold:
            return n, (
                f"{reason}, but a member less would put cpu at ~{_fmt(cpu_after)}% "
                f">= {_fmt(policy.cpu_threshold)}%"
            )
        avg_after = projects / (n - 1)
        if avg_after > policy.max_projects_per_member:
            return n, (
                f"{reason}, but a member less would put {_fmt(avg_after)} active projects "
                f"per member > {policy.max_projects_per_member}"
            )
        if target is not None and lag > target * (n - 1) * (1 + policy.tolerance):
            return n, (
                f"{reason}, but a member less would put lag per member at "
                f"{_fmt(lag / (n - 1))} > target {target}"
            )
        return n - 1, reason

    if holds:
        return n, "; ".join(holds)
    return n, (
        f"within thresholds: cpu max {_fmt(cpu_max)}% on {hot}, "
        f"avg {_fmt(avg)} active projects per member"
    )


def _agreed_since(
    history: tuple[tuple[float, int | None], ...], current: int, max_gap: float
) -> float | None:
    """Start of the unbroken run of recommendations below ``current`` ending now.

    Entries more than ``max_gap`` apart break the run as a disagreeing one would: the
    rounds between them (failed, or not run) observed nothing, so two readings a window
    apart do not prove the window.
    """
    since: float | None = None
    for t, rec in reversed(history):
        if rec is None or rec >= current or (since is not None and since - t > max_gap):
            break
        since = t
    return since


def decide(
    stats: Mapping[str, MemberStats | Mapping[str, Any] | None],
    current: int,
    policy: Policy,
    now: float,
    state: ScalerState,
    rebalancing: bool = False,
) -> tuple[Decision, ScalerState]:
    """One autoscaling round: the decision and the state for the next round.

    ``stats`` maps member id -> the stats it published (None when it has none yet);
    ``current`` is the group's replica count (``spec.replicas``); ``rebalancing`` is
    True while a hand-over is in progress. Deterministic; ``state`` is not modified.
    """
    if isinstance(current, bool) or not isinstance(current, int) or current < 0:
        raise ValueError(f"current replicas must be a non-negative int, got {current!r}")
    reports, ignored = _collect(stats, policy, now)
    for member, why in ignored.items():
        if member not in state.ignored:
            log.warning("scaler: ignoring stats of member %s: %s", member, why)
    signals = _signals(reports, current)
    # Keep one entry at or before the window's start so a full window can be proven.
    horizon = now - policy.scale_down_window_seconds - policy.interval_seconds
    history = tuple((t, r) for t, r in state.history if horizon <= t <= now)
    base = replace(state, history=history, ignored=frozenset(ignored))

    def hold(reason: str, rec: int | None = None) -> tuple[Decision, ScalerState]:
        decision = Decision(
            replicas=current,
            reason=reason,
            signals=signals,
            action="none",
            dry_run=policy.dry_run,
            recommended=current if rec is None else rec,
            ignored=ignored,
        )
        return decision, replace(base, history=(*history, (now, rec)))

    def act(replicas: int, reason: str, rec: int | None) -> tuple[Decision, ScalerState]:
        action: Action = "up" if replicas > current else "down"
        decision = Decision(
            replicas=replicas,
            reason=reason,
            signals=signals,
            action=action,
            dry_run=policy.dry_run,
            recommended=replicas,
            ignored=ignored,
        )
        return decision, replace(
            base,
            history=(*history, (now, rec)),
            last_action_time=now,
            last_action_direction=action,
        )

    if not policy.enabled:
        return hold("autoscaling disabled")
    # The bounds come before the hand-over check: a partition nobody claims (a hand-over
    # that does not end) must not keep a group below minReplicas or above maxReplicas.
    if current < policy.lower:
        return act(policy.lower, f"below minReplicas ({current} < {policy.lower})", None)
    if current > policy.upper:
        bound = "maxReplicas" if policy.max_replicas <= policy.partitions else "partitions"
        return act(policy.upper, f"above {bound} ({current} > {policy.upper})", None)
    if rebalancing:
        return hold("rebalance in progress")
    if not reports:
        return hold("no data" if current else "no data (scaled to zero)")
    if current == 0:
        return hold("scaled to zero; members still reporting are leaving")

    rec, reason = _recommend(reports, current, policy)
    if rec == current:
        return hold(reason, rec)
    if policy.cooldown_seconds and state.last_action_time is not None:
        until = state.last_action_time + policy.cooldown_seconds
        if now < until:
            return hold(
                f"cooldown until {_utc(until)} ({_fmt(until - now)}s left) after scaling "
                f"{state.last_action_direction}; wants {rec}: {reason}",
                rec,
            )
    if rec > current:
        return act(rec, reason, rec)
    since = _agreed_since((*history, (now, rec)), current, 2 * policy.interval_seconds)
    agreed = 0.0 if since is None else now - since
    if agreed < policy.scale_down_window_seconds:
        return hold(
            f"stabilizing: wants {rec} for {_fmt(agreed)}s of "
            f"{_fmt(policy.scale_down_window_seconds)}s; {reason}",
            rec,
        )
    return act(rec, reason, rec)


def without_action(state: ScalerState, before: ScalerState) -> ScalerState:
    """``state`` (returned by :func:`decide` with an action) for an action that did not
    take effect (the scale was refused, or could not be recorded): the round's history
    stays, but the last action is still the one in ``before``, so no cooldown starts for
    a change that never happened and the next round may try again."""
    return replace(
        state,
        last_action_time=before.last_action_time,
        last_action_direction=before.last_action_direction,
    )
