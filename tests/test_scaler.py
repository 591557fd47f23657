"""Tests of the pure autoscaling decision (shoal.consumer.scaler).

Synthetic traces are driven step by step (interval 30 s, cooldown 600 s) and the replica
series is asserted; small exhaustive grids pin the rules; hypothesis checks the safety
properties (bounds, no load action while rebalancing, at most one action per cooldown and so
no reversal inside one) on random noisy traces with missing, garbage and stale stats.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import re
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shoal.consumer.scaler import (
    DEFAULT_MAX_STEP_UP,
    DEFAULT_SCALE_DOWN_WINDOW_SECONDS,
    Decision,
    MemberStats,
    Policy,
    ScalerState,
    decide,
    parse_stats,
    without_action,
)

T0 = 1_700_000_000.0
INTERVAL = 30.0
COOLDOWN_STEPS = 20  # 600 s / 30 s
WINDOW_STEPS = 10  # 300 s / 30 s

Stats = Mapping[str, Mapping[str, Any] | None]
Load = Callable[[int, int, float], Stats]


def member(
    now: float,
    cpu: float = 40.0,
    projects: int = 10,
    lag: int = 0,
    rate: float = 5.0,
    inflight: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    stats: dict[str, Any] = {
        "cpu": cpu,
        "active_projects": projects,
        "lag": lag,
        "rate": rate,
        "owned": [0, 1],
        "inflight": inflight,
        "ts": now - 5.0,
        "pid": 1234,
        "rss_mb": 80.0,
    }
    stats.update(extra)
    return stats


def uniform(n: int, now: float, **kw: Any) -> dict[str, Mapping[str, Any] | None]:
    return {f"c-{i}": member(now, **kw) for i in range(n)}


def split(total: int, n: int) -> list[int]:
    """Spread ``total`` over ``n`` members as evenly as integers allow."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def policy(**kw: Any) -> Policy:
    kw.setdefault("enabled", True)
    return Policy(**kw)


def simulate(
    load: Load,
    pol: Policy,
    start: int,
    steps: int,
    rebalancing: Callable[[int], bool] = lambda i: False,
) -> tuple[list[int], list[Decision]]:
    """Run ``steps`` rounds; the replica count after each round and the decisions."""
    state = ScalerState()
    current = start
    series: list[int] = []
    decisions: list[Decision] = []
    for i in range(steps):
        now = T0 + i * INTERVAL
        decision, state = decide(load(i, current, now), current, pol, now, state, rebalancing(i))
        if not decision.dry_run:
            current = decision.replicas
        series.append(current)
        decisions.append(decision)
    return series, decisions


def changes(series: list[int], start: int) -> list[tuple[int, int, int]]:
    """(step, before, after) for every change of the series."""
    out = []
    before = start
    for i, value in enumerate(series):
        if value != before:
            out.append((i, before, value))
        before = value
    return out


def assert_spaced(decisions: list[Decision], steps: int = COOLDOWN_STEPS) -> None:
    acted = [i for i, d in enumerate(decisions) if d.action != "none"]
    for a, b in itertools.pairwise(acted):
        assert b - a >= steps, f"actions at steps {a} and {b} inside one cooldown"


# -- parse_stats ---------------------------------------------------------------------------


def test_parse_stats_valid_and_defaults() -> None:
    parsed = parse_stats({"cpu": 12, "ts": 5.0, "active_projects": 3, "lag": 7})
    assert parsed == MemberStats(
        cpu=12.0, active_projects=3, lag=7, rate=0.0, owned=(), inflight=0, ts=5.0
    )
    full = parse_stats(member(100.0, cpu=95.5, projects=4, lag=9, rate=2.5, inflight=3))
    assert full is not None
    assert (full.cpu, full.active_projects, full.lag, full.rate, full.inflight) == (
        95.5,
        4,
        9,
        2.5,
        3,
    )
    assert full.owned == (0, 1)
    assert parse_stats(member(100.0, owned=[3, 1, 3])) is not None
    assert parse_stats(member(100.0, cpu=250.0)) is not None  # over the limit: still real


GARBAGE: list[Any] = [
    None,
    [],
    "cpu=90",
    42,
    {},
    {"cpu": 10, "active_projects": 1, "lag": 0},  # no ts
    {"ts": 1.0, "active_projects": 1, "lag": 0},  # no cpu
    {"cpu": 10, "ts": 1.0, "lag": 0},  # no active_projects
    {"cpu": 10, "ts": 1.0, "active_projects": 1},  # no lag
    {"cpu": "90", "ts": 1.0, "active_projects": 1, "lag": 0},
    {"cpu": True, "ts": 1.0, "active_projects": 1, "lag": 0},
    {"cpu": math.nan, "ts": 1.0, "active_projects": 1, "lag": 0},
    {"cpu": math.inf, "ts": 1.0, "active_projects": 1, "lag": 0},
    {"cpu": -1, "ts": 1.0, "active_projects": 1, "lag": 0},
    {"cpu": 1e9, "ts": 1.0, "active_projects": 1, "lag": 0},
    {"cpu": 10, "ts": "now", "active_projects": 1, "lag": 0},
    {"cpu": 10, "ts": 0, "active_projects": 1, "lag": 0},
    {"cpu": 10, "ts": math.nan, "active_projects": 1, "lag": 0},
    {"cpu": 10, "ts": 1.0, "active_projects": -1, "lag": 0},
    {"cpu": 10, "ts": 1.0, "active_projects": 1.5, "lag": 0},
    {"cpu": 10, "ts": 1.0, "active_projects": False, "lag": 0},
    {"cpu": 10, "ts": 1.0, "active_projects": 1, "lag": -5},
    {"cpu": 10, "ts": 1.0, "active_projects": 1, "lag": "12"},
    {"cpu": 10, "ts": 1.0, "active_projects": 1, "lag": 0, "rate": -1.0},
    {"cpu": 10, "ts": 1.0, "active_projects": 1, "lag": 0, "rate": math.inf},
    {"cpu": 10, "ts": 1.0, "active_projects": 1, "lag": 0, "inflight": -1},
    {"cpu": 10, "ts": 1.0, "active_projects": 1, "lag": 0, "owned": "0,1"},
    {"cpu": 10, "ts": 1.0, "active_projects": 1, "lag": 0, "owned": [0, -1]},
    {"cpu": 10, "ts": 1.0, "active_projects": 1, "lag": 0, "owned": [0, "1"]},
    {"cpu": 10, "ts": 1.0, "active_projects": 1, "lag": 0, "owned": None},
]


@pytest.mark.parametrize("raw", GARBAGE, ids=range(len(GARBAGE)))
def test_parse_stats_garbage_is_none(raw: Any) -> None:
    assert parse_stats(raw) is None


def test_huge_int_lag_is_not_a_crash() -> None:
    assert parse_stats({"cpu": 1, "ts": 1.0, "active_projects": 1, "lag": 10**400}) is not None


# -- Policy.from_spec ----------------------------------------------------------------------


def test_from_spec_defaults() -> None:
    pol = Policy.from_spec({"handler": "pkg.mod:fn"})
    assert pol == Policy()
    assert (pol.enabled, pol.interval_seconds, pol.cooldown_seconds, pol.cpu_threshold) == (
        False,
        30,
        600,
        90,
    )
    assert (pol.max_projects_per_member, pol.min_projects_per_member) == (50, 2)
    assert pol.target_lag_per_member is None and pol.dry_run is False
    assert (pol.min_replicas, pol.max_replicas, pol.partitions) == (1, 10, 128)
    assert pol.tolerance == 0.10
    assert pol.max_step_up == DEFAULT_MAX_STEP_UP == 4
    assert pol.scale_down_window_seconds == DEFAULT_SCALE_DOWN_WINDOW_SECONDS == 300


def test_from_spec_camel_case() -> None:
    spec = {
        "handler": "pkg.mod:fn",
        "replicas": 3,
        "minReplicas": 2,
        "maxReplicas": 6,
        "partitions": 8,
        "autoscaling": {
            "enabled": True,
            "intervalSeconds": 15,
            "cooldownSeconds": 120,
            "cpuThreshold": 80,
            "maxProjectsPerMember": 40,
            "minProjectsPerMember": 0,
            "targetLagPerMember": 2000,
            "dryRun": True,
        },
        "nats": {"url": "nats://x"},
    }
    pol = Policy.from_spec(spec)
    assert pol == Policy(
        enabled=True,
        interval_seconds=15,
        cooldown_seconds=120,
        cpu_threshold=80,
        max_projects_per_member=40,
        min_projects_per_member=0,
        target_lag_per_member=2000,
        dry_run=True,
        min_replicas=2,
        max_replicas=6,
        partitions=8,
        scale_down_window_seconds=120,
    )
    assert pol.upper == 6 and pol.lower == 2 and pol.stale_after_seconds == 45


@pytest.mark.parametrize(
    ("garbage", "where"),
    [
        ({"autoscaling": {"enabled": "yes"}}, "spec.autoscaling.enabled"),
        ({"autoscaling": {"intervalSeconds": 0}}, "spec.autoscaling.intervalSeconds"),
        ({"autoscaling": {"cooldownSeconds": -1}}, "spec.autoscaling.cooldownSeconds"),
        ({"autoscaling": {"cpuThreshold": "90"}}, "spec.autoscaling.cpuThreshold"),
        ({"autoscaling": {"targetLagPerMember": 0}}, "spec.autoscaling.targetLagPerMember"),
        ({"autoscaling": {"maxProjectsPerMember": True}}, "spec.autoscaling.maxProjects"),
        ({"autoscaling": ["enabled"]}, "spec.autoscaling"),
        ({"minReplicas": -1}, "spec.minReplicas"),
        ({"maxReplicas": 0}, "spec.maxReplicas"),
        ({"partitions": 2.5}, "spec.partitions"),
    ],
)
def test_from_spec_garbage_raises(garbage: Mapping[str, Any], where: str) -> None:
    # A valid spec but for the garbage: the error must be about the garbage.
    with pytest.raises(ValueError, match=re.escape(where)):
        Policy.from_spec({"handler": "pkg.mod:fn", **garbage})


def test_from_spec_integral_floats_and_null_target() -> None:
    pol = Policy.from_spec(
        {"handler": "a:b", "partitions": 16.0, "autoscaling": {"targetLagPerMember": None}}
    )
    assert pol.partitions == 16 and pol.target_lag_per_member is None


# -- step load, ramp, spike, sawtooth -------------------------------------------------------


def test_step_load_hot_member_scales_once_per_cooldown() -> None:
    """CPU jumps to 95% on one member at step 10 and stays: +1, then the cooldown holds."""

    def load(i: int, n: int, now: float) -> Stats:
        stats = uniform(n, now)
        if i >= 10:
            stats["c-0"] = member(now, cpu=95.0)
        return stats

    series, decisions = simulate(load, policy(), start=2, steps=60)
    assert changes(series, 2) == [(10, 2, 3), (30, 3, 4), (50, 4, 5)]
    assert decisions[10].reason == "cpu 95% on c-0 >= 90%"
    assert decisions[10].action == "up"
    assert decisions[11].reason.startswith("cooldown until ")
    assert "wants 4" in decisions[11].reason and decisions[11].recommended == 4
    assert decisions[10].signals["cpu_max"] == 95.0
    assert decisions[10].signals["members_reporting"] == 2


def test_step_load_shared_cpu_settles_after_one_member() -> None:
    """Total CPU demand 190% spread over the members: 95% each on 2, 63% on 3 -> one +1."""

    def load(i: int, n: int, now: float) -> Stats:
        return uniform(n, now, cpu=(80.0 if i < 5 else 190.0) / n, projects=20)

    series, decisions = simulate(load, policy(), start=2, steps=80)
    assert changes(series, 2) == [(5, 2, 3)]
    assert_spaced(decisions)


def test_ramp_of_active_projects() -> None:
    """Active projects grow by 10 per round: +1 whenever the average passes 50."""

    def load(i: int, n: int, now: float) -> Stats:
        total = 40 + 10 * i
        return {f"c-{k}": member(now, projects=p) for k, p in enumerate(split(total, n))}

    series, decisions = simulate(load, policy(), start=1, steps=70)
    assert changes(series, 1) == [(2, 1, 2), (22, 2, 3), (42, 3, 4), (62, 4, 5)]
    assert decisions[2].reason == "avg 60 active projects per member > 50"
    assert series == sorted(series)
    assert_spaced(decisions)


def test_short_spike_does_not_scale_down_inside_the_cooldown() -> None:
    """A one-round CPU spike adds a member; the quiet that follows removes it only once the
    cooldown is over (and the window agreed), then one member per cooldown."""

    def load(i: int, n: int, now: float) -> Stats:
        stats = {f"c-{k}": member(now, cpu=10.0, projects=p) for k, p in enumerate(split(3, n))}
        if i == 5:
            stats["c-1"] = member(now, cpu=97.0, projects=1)
        return stats

    series, decisions = simulate(load, policy(), start=3, steps=80)
    assert changes(series, 3) == [(5, 3, 4), (25, 4, 3), (45, 3, 2), (65, 2, 1)]
    assert all(series[i] == 4 for i in range(5, 25))
    assert decisions[6].recommended == 3 and decisions[6].action == "none"
    assert decisions[25].reason == "avg 0.8 active projects per member < 2"
    assert_spaced(decisions)


def test_sawtooth_below_min_never_completes_a_window() -> None:
    """Load swinging between idle and normal every 2 minutes never scales down."""

    def load(i: int, n: int, now: float) -> Stats:
        return uniform(n, now, projects=1 if (i // 4) % 2 == 0 else 30)

    series, decisions = simulate(load, policy(), start=4, steps=120)
    assert series == [4] * 120
    assert any("stabilizing" in d.reason for d in decisions)


def test_sawtooth_over_max_scales_up_only_once_per_cooldown() -> None:
    def load(i: int, n: int, now: float) -> Stats:
        total = 60 * 3 if (i // 3) % 2 == 0 else 3
        return {f"c-{k}": member(now, projects=p) for k, p in enumerate(split(total, n))}

    series, decisions = simulate(load, policy(max_replicas=6), start=3, steps=120)
    steps = changes(series, 3)
    assert [(a, b) for _, a, b in steps] == [(3, 4)]  # 180 over 4 = 45: up rule stops
    assert_spaced(decisions)


# -- noise around each threshold -----------------------------------------------------------


def _no_reversal(decisions: list[Decision]) -> None:
    assert_spaced(decisions)
    acts = [d.action for d in decisions if d.action != "none"]
    assert len(acts) <= 1 + len(decisions) // COOLDOWN_STEPS


@pytest.mark.parametrize("seed", range(5))
def test_cpu_noise_around_threshold(seed: int) -> None:
    rng = random.Random(seed)

    def load(i: int, n: int, now: float) -> Stats:
        stats = uniform(n, now, cpu=40.0)
        stats["c-0"] = member(now, cpu=rng.uniform(89.0, 91.0))
        return stats

    series, decisions = simulate(load, policy(max_replicas=8), start=2, steps=200)
    _no_reversal(decisions)
    assert all(d.action in ("up", "none") for d in decisions)
    assert 2 <= min(series) and max(series) <= 8


@pytest.mark.parametrize("seed", range(5))
def test_projects_noise_around_max(seed: int) -> None:
    rng = random.Random(seed)

    def load(i: int, n: int, now: float) -> Stats:
        return uniform(n, now, projects=rng.randint(49, 51))

    _, decisions = simulate(load, policy(max_replicas=8), start=2, steps=200)
    _no_reversal(decisions)
    assert all(d.action in ("up", "none") for d in decisions)


@pytest.mark.parametrize("seed", range(5))
def test_projects_noise_around_min(seed: int) -> None:
    rng = random.Random(seed)

    def load(i: int, n: int, now: float) -> Stats:
        return uniform(n, now, projects=rng.choice([1, 2, 2, 3]))

    series, decisions = simulate(load, policy(), start=6, steps=200)
    _no_reversal(decisions)
    assert series == [6] * 200  # the low reading never lasts a whole window


@pytest.mark.parametrize("seed", range(5))
def test_noise_on_both_sides_never_reverses_inside_a_cooldown(seed: int) -> None:
    """Noisy load that swings between busy and idle phases of random length, so the
    scaler has reasons to go both ways: it must, and never inside a cooldown."""
    rng = random.Random(seed)
    phases: list[bool] = []  # busy or idle, one entry per step
    while len(phases) < 400:
        phases += [rng.random() < 0.5] * rng.randint(15, 90)

    def load(i: int, n: int, now: float) -> Stats:
        if phases[i]:
            return uniform(n, now, cpu=rng.uniform(50.0, 99.0), projects=rng.randint(20, 90))
        return uniform(n, now, cpu=rng.uniform(1.0, 40.0), projects=rng.randint(0, 1))

    _, decisions = simulate(load, policy(), start=4, steps=400)
    _no_reversal(decisions)
    # A scaler that never acts never reverses: the noise must have made it act both ways.
    actions = {d.action for d in decisions}
    assert {"up", "down"} <= actions, actions


# -- missing, garbage, stale stats ---------------------------------------------------------


def test_member_without_stats_is_ignored_for_scale_up() -> None:
    now = T0
    stats: dict[str, Mapping[str, Any] | None] = {
        "c-0": None,
        "c-1": member(now, cpu=95.0),
        "c-2": member(now),
    }
    decision, state = decide(stats, 3, policy(), now, ScalerState())
    assert decision.action == "up" and decision.replicas == 4
    assert decision.signals["members_reporting"] == 2
    assert decision.ignored == {"c-0": "no stats"}
    assert state.ignored == frozenset({"c-0"})


def test_missing_member_blocks_scale_down() -> None:
    """A silent member might be the busy one: missing data may scale up, never down."""

    def load(i: int, n: int, now: float) -> Stats:
        stats = uniform(n, now, projects=0)
        stats["c-0"] = None
        return stats

    series, decisions = simulate(load, policy(), start=3, steps=40)
    assert series == [3] * 40
    assert "needs stats from all 3 members (2 reporting)" in decisions[-1].reason


@pytest.mark.parametrize("raw", GARBAGE[1:], ids=range(1, len(GARBAGE)))
def test_garbage_stats_are_ignored(raw: Any) -> None:
    now = T0
    stats: dict[str, Any] = {"c-0": member(now, cpu=95.0), "c-1": raw}
    decision, _ = decide(stats, 2, policy(), now, ScalerState())
    assert decision.action == "up"
    assert decision.signals["members_reporting"] == 1
    assert "c-1" in decision.ignored


def test_only_garbage_means_no_data() -> None:
    stats: dict[str, Any] = {"c-0": {"cpu": "hot"}, "c-1": None}
    decision, _ = decide(stats, 2, policy(), T0, ScalerState())
    assert (decision.action, decision.replicas, decision.reason) == ("none", 2, "no data")
    assert decision.signals["cpu_max"] is None
    decision, _ = decide({}, 2, policy(), T0, ScalerState())
    assert decision.reason == "no data"


def test_ignored_member_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="shoal.consumer.scaler")
    state = ScalerState()
    bad: dict[str, Any] = {"c-0": member(T0), "c-1": {"cpu": "x"}}
    good: dict[str, Any] = {"c-0": member(T0), "c-1": member(T0)}
    for i, stats in enumerate([bad, bad, bad, good, bad, bad]):
        now = T0 + i * INTERVAL
        fresh = {k: (dict(v, ts=now) if "ts" in v else v) for k, v in stats.items()}
        _, state = decide(fresh, 2, policy(), now, state)
    warnings = [r for r in caplog.records if "c-1" in r.getMessage()]
    assert len(warnings) == 2  # once, and once more after it recovered in between


@pytest.mark.parametrize(
    ("age", "used"),
    [
        (0.0, True),
        (89.0, True),
        (90.0, True),
        (90.5, False),
        (3600.0, False),
        (-60.0, True),
        (-91.0, False),
        (-1e6, False),
    ],
)
def test_stale_stats_count_as_missing(age: float, used: bool) -> None:
    now = T0
    stats = {"c-0": member(now, cpu=95.0, ts=now - age)}
    decision, _ = decide(stats, 2, policy(), now, ScalerState())
    assert (decision.action == "up") is used
    assert ("c-0" in decision.ignored) is not used


@pytest.mark.parametrize(
    ("interval", "period", "age", "used"),
    [
        # Rounds longer than the stats' period: three rounds decide, as before.
        (30, 6.0, 89.0, True),
        (30, 6.0, 91.0, False),
        # A 1 s round reads stats written every 3 s and read every 3 s: up to 6 s old
        # while healthy, stale only after three of their periods.
        (1, 6.0, 5.9, True),
        (1, 6.0, 17.5, True),
        (1, 6.0, 18.5, False),
        (1, 0.0, 3.5, False),  # (no period given: the interval alone)
        (2, 9.4, 28.0, True),  # 64 members: written every 6.4 s
        (2, 9.4, 28.5, False),
    ],
)
def test_stats_are_stale_after_three_rounds_or_three_of_their_periods(
    interval: int, period: float, age: float, used: bool
) -> None:
    now = T0
    pol = policy(interval_seconds=interval, report_period_seconds=period)
    assert pol.stale_after_seconds == 3 * max(interval, period)
    stats = {"c-0": member(now, cpu=95.0, ts=now - age)}
    decision, _ = decide(stats, 2, pol, now, ScalerState())
    assert (decision.action == "up") is used
    assert ("c-0" in decision.ignored) is not used


def test_a_negative_report_period_is_refused() -> None:
    with pytest.raises(ValueError, match="report_period_seconds >= 0"):
        Policy(report_period_seconds=-1.0)


# -- rebalance, disabled, dry run ----------------------------------------------------------


def test_rebalance_in_progress_means_no_decision() -> None:
    stats = uniform(3, T0, cpu=99.0, projects=90, lag=10**6)
    pol = policy(target_lag_per_member=100)
    decision, state = decide(stats, 3, pol, T0, ScalerState(), rebalancing=True)
    assert (decision.action, decision.replicas, decision.reason) == (
        "none",
        3,
        "rebalance in progress",
    )
    assert decision.signals["cpu_max"] == 99.0  # still reported
    assert state.last_action_time is None


def test_rebalance_restarts_the_scale_down_window() -> None:
    def load(i: int, n: int, now: float) -> Stats:
        return uniform(n, now, projects=0)

    series, _ = simulate(load, policy(), start=3, steps=40, rebalancing=lambda i: i == 8)
    # Without the rebalance the first down is at step 10; with it, at 9 + 10.
    assert changes(series, 3)[0] == (19, 3, 2)


def test_disabled_reports_signals_but_never_acts() -> None:
    pol = policy(enabled=False)
    for current in (0, 2, 20):
        decision, state = decide(uniform(2, T0, cpu=99.0), current, pol, T0, ScalerState())
        assert (decision.action, decision.replicas) == ("none", current)
        assert decision.reason == "autoscaling disabled"
        assert decision.signals["cpu_max"] == 99.0
        assert decision.signals["members_reporting"] == 2
        assert state.last_action_time is None


def test_dry_run_reports_and_keeps_the_cooldown() -> None:
    def load(i: int, n: int, now: float) -> Stats:
        return uniform(n, now, cpu=95.0)

    series, decisions = simulate(load, policy(dry_run=True), start=2, steps=45)
    assert series == [2] * 45  # nothing applied
    acted = [i for i, d in enumerate(decisions) if d.action != "none"]
    assert acted == [0, 20, 40]
    assert all(d.dry_run for d in decisions)
    assert decisions[0].replicas == 3 and decisions[0].action == "up"


# -- lag -----------------------------------------------------------------------------------


def lagged(n: int, now: float, total: int, **kw: Any) -> dict[str, Mapping[str, Any] | None]:
    return {f"c-{k}": member(now, lag=lag, **kw) for k, lag in enumerate(split(total, n))}


def test_lag_proportional_scale_up() -> None:
    pol = policy(target_lag_per_member=2000)
    decision, _ = decide(lagged(3, T0, 12000), 3, pol, T0, ScalerState())
    assert (decision.action, decision.replicas) == ("up", 6)
    assert decision.reason == "lag 12000 over 3 members, target 2000 -> 6"
    assert decision.signals["lag_total"] == 12000
    assert decision.signals["lag_per_member"] == 4000


@pytest.mark.parametrize(
    ("n", "lag", "want"),
    [
        (1, 2000, 1),
        (1, 2199, 1),  # +9.95%: within tolerance
        (1, 2200, 1),  # +10% exactly: within
        (1, 2201, 2),
        (1, 1801, 1),
        (2, 4400, 2),
        (2, 4401, 3),
        (2, 3600, 2),  # -10%: within
        (2, 3599, 2),  # outside, but ceil(1.8) = 2
        (4, 3999, 3),  # ceil(2) = 2 < 4: down by one only
        (4, 0, 3),
        (3, 0, 2),
    ],
)
def test_lag_tolerance_grid(n: int, lag: int, want: int) -> None:
    pol = policy(target_lag_per_member=2000, scale_down_window_seconds=0)
    decision, _ = decide(lagged(n, T0, lag), n, pol, T0, ScalerState())
    assert decision.replicas == want, decision.reason
    if want == n and lag and abs(lag - 2000 * n) <= 200 * n:
        assert decision.reason.startswith("within tolerance")


def test_lag_step_is_capped() -> None:
    pol = policy(target_lag_per_member=1000)
    decision, _ = decide(lagged(2, T0, 100_000), 2, pol, T0, ScalerState())
    assert decision.replicas == 2 + DEFAULT_MAX_STEP_UP
    assert "(step capped at +4)" in decision.reason
    pol = policy(target_lag_per_member=1000, max_step_up=1)
    decision, _ = decide(lagged(2, T0, 100_000), 2, pol, T0, ScalerState())
    assert decision.replicas == 3


def test_lag_capped_by_partitions_and_max() -> None:
    pol = policy(target_lag_per_member=2000, max_replicas=10, partitions=3)
    decision, _ = decide(lagged(2, T0, 12000), 2, pol, T0, ScalerState())
    assert decision.replicas == 3 and "capped at partitions 3" in decision.reason
    pol = policy(target_lag_per_member=2000, max_replicas=4, partitions=8)
    decision, _ = decide(lagged(3, T0, 12000), 3, pol, T0, ScalerState())
    assert decision.replicas == 4 and "capped at maxReplicas 4" in decision.reason
    decision, _ = decide(lagged(4, T0, 12000), 4, pol, T0, ScalerState())
    assert decision.action == "none" and "already at maxReplicas 4" in decision.reason


def test_lag_scale_down_series() -> None:
    """Backlog drained: one member less per cooldown, after a full window, down to the
    count the remaining lag needs."""

    def load(i: int, n: int, now: float) -> Stats:
        return lagged(n, now, 2500, projects=10)

    series, decisions = simulate(load, policy(target_lag_per_member=2000), start=5, steps=80)
    assert changes(series, 5) == [(10, 5, 4), (30, 4, 3), (50, 3, 2)]
    # 2500 at target 2000 needs ceil(1.25) = 2 members.
    assert decisions[-1].reason == "lag 2500 over 2 members, target 2000 -> 2"


def test_lag_up_uses_partial_data_as_a_lower_bound() -> None:
    stats = lagged(2, T0, 12000)
    stats["c-2"] = None
    decision, _ = decide(stats, 3, policy(target_lag_per_member=2000), T0, ScalerState())
    assert decision.replicas == 6 and decision.signals["members_reporting"] == 2


def test_lag_and_projects_take_the_larger_recommendation() -> None:
    pol = policy(target_lag_per_member=2000)
    decision, _ = decide(lagged(2, T0, 4000, projects=80), 2, pol, T0, ScalerState())
    assert decision.replicas == 3  # lag is on target, projects ask +1
    decision, _ = decide(lagged(2, T0, 10000, projects=80), 2, pol, T0, ScalerState())
    assert decision.replicas == 5


# -- hysteresis ----------------------------------------------------------------------------


def test_scale_down_that_would_trip_cpu_is_held() -> None:
    pol = policy(scale_down_window_seconds=0)
    decision, _ = decide(uniform(2, T0, cpu=50.0, projects=1), 2, pol, T0, ScalerState())
    assert decision.action == "none"
    assert "a member less would put cpu at ~100% >= 90%" in decision.reason


def test_scale_down_that_would_trip_projects_is_held() -> None:
    pol = policy(scale_down_window_seconds=0, min_projects_per_member=30)
    decision, _ = decide(uniform(2, T0, projects=29), 2, pol, T0, ScalerState())
    assert "a member less would put 58 active projects per member > 50" in decision.reason


def test_never_scales_to_zero() -> None:
    # A group at 0 has no member, so no leader to scale it up again: the policy (like the
    # spec and the CRD) refuses minReplicas 0, and an idle single member stays.
    with pytest.raises(ValueError, match="min_replicas >= 1"):
        policy(min_replicas=0)
    pol = policy(min_replicas=1, scale_down_window_seconds=0, cooldown_seconds=0)
    stats = uniform(1, T0, cpu=0.0, projects=0, lag=0, inflight=0)
    decision, _ = decide(stats, 1, pol, T0, ScalerState())
    assert (decision.action, decision.replicas) == ("none", 1)


# -- the seed rules on an exhaustive grid ---------------------------------------------------


def seed_oracle(n: int, cpu: float, avg: int) -> int:
    if cpu >= 90 or avg > 50:
        return n + 1
    if avg < 2 and n > 1 and cpu * n / (n - 1) < 90 and avg * n / (n - 1) <= 50:
        return n - 1
    return n


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_seed_rules_grid(n: int) -> None:
    pol = policy(scale_down_window_seconds=0, cooldown_seconds=0)
    for cpu, avg in itertools.product(
        [0.0, 30.0, 44.9, 45.0, 50.0, 89.9, 90.0, 91.0, 100.0, 150.0],
        [0, 1, 2, 3, 49, 50, 51, 80],
    ):
        decision, _ = decide(uniform(n, T0, cpu=cpu, projects=avg), n, pol, T0, ScalerState())
        assert decision.replicas == seed_oracle(n, cpu, avg), (n, cpu, avg, decision.reason)
        assert decision.action == (
            "up" if decision.replicas > n else "down" if decision.replicas < n else "none"
        )


def test_window_needs_a_full_run_of_agreement() -> None:
    def load(i: int, n: int, now: float) -> Stats:
        return uniform(n, now, projects=0 if i != 6 else 10)

    series, decisions = simulate(load, policy(), start=3, steps=30)
    # Agreement restarts at step 7: first down at 7 + 10.
    assert changes(series, 3)[0] == (17, 3, 2)
    assert decisions[16].reason.startswith("stabilizing: wants 2 for 270s of 300s")


def test_a_scale_down_needs_a_window_of_readings_not_two_readings_a_window_apart() -> None:
    """The window was proven by its first and last readings alone: rounds that did not
    happen (failed rounds back off 30, 60, 120, 240 s: an API outage, a refused patch)
    leave no entry to break the run, so one idle reading before an outage and one after
    it scaled the group down at the first successful round, with 5 minutes unobserved.
    A gap of more than two intervals now breaks the agreement; a full window after it
    still scales down."""
    pol = policy(cooldown_seconds=600, partitions=128)
    decision, state = decide(uniform(3, T0, projects=0), 3, pol, T0, ScalerState())
    assert (decision.action, decision.recommended) == ("none", 2), decision.reason
    # The rounds at T0 + 30 .. T0 + 270 failed (nothing decided, nothing recorded).
    now = T0 + 10 * INTERVAL
    decision, state = decide(uniform(3, now, projects=0), 3, pol, now, state)
    assert decision.action == "none", decision.reason
    assert decision.reason.startswith("stabilizing: wants 2 for 0s of 300s"), decision.reason
    for _ in range(10):
        now += INTERVAL
        decision, state = decide(uniform(3, now, projects=0), 3, pol, now, state)
    assert (decision.action, decision.replicas) == ("down", 2), decision.reason


# -- bounds --------------------------------------------------------------------------------


def test_bounds_grid() -> None:
    loads = {
        "hot": dict(cpu=99.0, projects=90, lag=50_000),
        "idle": dict(cpu=1.0, projects=0, lag=0),
        "calm": dict(cpu=40.0, projects=10, lag=900),
    }
    for current, lo, hi, parts, (name, kw), target in itertools.product(
        range(0, 9), range(1, 3), range(1, 6), (1, 3, 8), loads.items(), (None, 1000)
    ):
        pol = policy(
            min_replicas=lo,
            max_replicas=hi,
            partitions=parts,
            target_lag_per_member=target,
            scale_down_window_seconds=0,
        )
        upper, lower = min(hi, parts), min(lo, hi, parts)
        stats = uniform(current, T0, **kw)
        decision, _ = decide(stats, current, pol, T0, ScalerState())
        context = (current, lo, hi, parts, name, target, decision.reason)
        if current < lower:
            assert decision.replicas == lower and decision.reason.startswith("below minReplicas")
        elif current > upper:
            assert decision.replicas == upper and decision.reason.startswith("above ")
        else:
            assert lower <= decision.replicas <= upper, context
            assert decision.replicas - current <= DEFAULT_MAX_STEP_UP
            assert current - decision.replicas <= 1
            if name == "calm" and target is None:
                assert decision.replicas == current, context


def test_below_min_goes_to_min_even_without_data_or_in_cooldown() -> None:
    state = ScalerState(last_action_time=T0 - 10, last_action_direction="down")
    decision, state = decide({}, 0, policy(min_replicas=2), T0, state)
    assert (decision.action, decision.replicas) == ("up", 2)
    assert decision.reason == "below minReplicas (0 < 2)"
    assert state.last_action_time == T0 and state.last_action_direction == "up"


def test_above_partitions_is_clamped() -> None:
    decision, _ = decide(uniform(6, T0), 6, policy(partitions=4), T0, ScalerState())
    assert (decision.action, decision.replicas) == ("down", 4)
    assert decision.reason == "above partitions (6 > 4)"


@pytest.mark.parametrize(
    ("current", "wanted", "reason"),
    [(1, 2, "below minReplicas (1 < 2)"), (6, 4, "above maxReplicas (6 > 4)")],
)
def test_bounds_are_enforced_while_a_partition_is_unclaimed(
    current: int, wanted: int, reason: str
) -> None:
    """Issue 24, defect 10c: one partition that nobody claims (a hand-over that never
    ends) held every decision back, even the clamp into [minReplicas, maxReplicas]. The
    bounds are hard limits, not load heuristics: they do not wait for a hand-over."""
    pol = policy(min_replicas=2, max_replicas=4)
    decision, _ = decide(uniform(current, T0), current, pol, T0, ScalerState(), rebalancing=True)
    assert (decision.replicas, decision.reason) == (wanted, reason)
    # Load-based decisions still wait for the hand-over.
    hot = uniform(3, T0, cpu=99.0)
    decision, _ = decide(hot, 3, pol, T0, ScalerState(), rebalancing=True)
    assert (decision.action, decision.reason) == ("none", "rebalance in progress")


# -- purity and the safety properties on random traces -------------------------------------


def test_decide_is_pure_and_deterministic() -> None:
    stats = uniform(3, T0, cpu=95.0)
    state = ScalerState(history=((T0 - 30, 3),), ignored=frozenset({"x"}))
    before = repr(state), repr(stats)
    first = decide(stats, 3, policy(), T0, state)
    second = decide(stats, 3, policy(), T0, state)
    assert first == second
    assert (repr(state), repr(stats)) == before


@pytest.mark.parametrize("current", [-1, True, 2.0])
def test_bad_current_raises(current: Any) -> None:
    with pytest.raises(ValueError):
        decide({}, current, policy(), T0, ScalerState())


member_stats = st.one_of(
    st.none(),
    st.sampled_from(GARBAGE[1:6]),
    st.builds(
        lambda cpu, projects, lag, inflight, age: {
            "cpu": cpu,
            "active_projects": projects,
            "lag": lag,
            "inflight": inflight,
            "age": age,
        },
        st.floats(0, 130),
        st.integers(0, 120),
        st.integers(0, 30_000),
        st.integers(0, 5),
        st.sampled_from([0.0, 0.0, 0.0, 10.0, 200.0]),
    ),
)
round_strategy = st.lists(member_stats, min_size=10, max_size=10)


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    lo = draw(st.integers(1, 3))
    hi = draw(st.integers(max(lo, 1), 8))
    return policy(
        enabled=draw(st.sampled_from([True, True, True, False])),
        cooldown_seconds=draw(st.sampled_from([0, 60, 600])),
        scale_down_window_seconds=draw(st.sampled_from([0, 90, 300])),
        min_replicas=lo,
        max_replicas=hi,
        partitions=draw(st.integers(1, 12)),
        max_step_up=draw(st.integers(1, 4)),
        target_lag_per_member=draw(st.one_of(st.none(), st.integers(100, 5000))),
        dry_run=draw(st.booleans()),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pol=policies(),
    start=st.integers(0, 10),
    level=st.sampled_from([0.0, 0.02, 0.5, 1.0]),
    rounds=st.lists(
        st.tuples(st.integers(0, 9).map(lambda k: k == 0), round_strategy), max_size=60
    ),
)
def test_random_traces_keep_the_safety_properties(
    pol: Policy, start: int, level: float, rounds: list[tuple[bool, list[Any]]]
) -> None:
    """``level`` scales the load of the whole trace (idle to busy) so that downs happen."""
    state = ScalerState()
    current = start
    last_load_action: float | None = None
    actions: list[str] = []
    for i, (rebalancing, raws) in enumerate(rounds):
        now = T0 + i * INTERVAL
        stats: dict[str, Any] = {}
        for k in range(min(current, len(raws))):
            raw = raws[k]
            if isinstance(raw, dict) and "age" in raw:
                raw = {
                    "cpu": raw["cpu"] * level,
                    "active_projects": int(raw["active_projects"] * level),
                    "lag": int(raw["lag"] * level),
                    "inflight": raw["inflight"] if level else 0,
                    "ts": now - raw["age"],
                }
            stats[f"c-{k}"] = raw
        decision, new_state = decide(stats, current, pol, now, state, rebalancing)
        assert (decision, new_state) == decide(stats, current, pol, now, state, rebalancing)
        assert decision.dry_run is pol.dry_run
        assert (decision.action == "none") is (decision.replicas == current)
        in_range = pol.lower <= current <= pol.upper
        if rebalancing and in_range:
            assert decision.action == "none"  # only the bounds do not wait for a hand-over
        if decision.action != "none" or in_range:
            assert pol.lower <= decision.replicas <= pol.upper
        if in_range and decision.action != "none":
            # A load decision: spaced by the cooldown (so never a reversal inside one),
            # one member down at a time, a capped step up, and only with data.
            assert decision.signals["members_reporting"]
            if last_load_action is not None:
                assert now - last_load_action >= pol.cooldown_seconds
            if new_state.last_action_direction == "down":
                assert decision.replicas == current - 1
            else:
                assert 0 < decision.replicas - current <= pol.max_step_up
            last_load_action = now
        elif decision.action != "none":
            last_load_action = now  # a clamp also starts a cooldown
        actions.append(decision.action)
        state = new_state
        if not decision.dry_run:
            current = decision.replicas
        assert len(state.history) <= (pol.scale_down_window_seconds / INTERVAL) + 3
    for action in sorted(set(actions)):
        event(f"action {action}")


def test_a_failed_action_starts_no_cooldown() -> None:
    """Issue 24, defect 8 (the pure part): the state for an action that did not take
    effect keeps the round's history but not the action, so the next round acts again."""
    before = ScalerState(last_action_time=T0 - 3600, last_action_direction="down")
    hot = uniform(2, T0, cpu=99.0)
    decision, after = decide(hot, 2, policy(), T0, before)
    assert decision.action == "up" and after.last_action_time == T0
    failed = without_action(after, before)
    assert (failed.last_action_time, failed.last_action_direction) == (T0 - 3600, "down")
    assert failed.history == after.history
    again, _ = decide(uniform(2, T0 + 30, cpu=99.0), 2, policy(), T0 + 30, failed)
    assert (again.action, again.replicas) == ("up", 3), again.reason
