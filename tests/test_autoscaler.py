"""The autoscaling loop's pure parts, the CPU ceiling, and one loop round on a real etcd.

The loop's proof is e2e/test_autoscaling.py (real API server, pods, NATS); here a
recording stand-in for the Kubernetes calls lets a round run against a real etcd fast.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import etcd3
import pytest
from kubernetes.client import ApiException

from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer import autoscaler as autoscaler_module
from shoal.consumer.autoscaler import (
    LEADER_COST,
    VICTIM_COST,
    Autoscaler,
    ScaleFailed,
    choose_victim,
    deletion_costs,
    event_message,
    handover_in_progress,
    resume_state,
    retry_delay,
)
from shoal.consumer.cpu import (
    CpuMeter,
    ceiling_cores,
    cgroup_limit_cores,
    parse_cfs,
    parse_cpu_max,
    parse_millicores,
)
from shoal.consumer.membership import Membership
from shoal.consumer.scaler import Decision
from shoal.contracts.values import MemberStats, ScaleRecord
from shoal.group.config import GroupConfig
from shoal.group.view import Claim, GroupView, Target
from shoal.operator.builders import consumer_env, cpu_millicores
from shoal.operator.observe import last_scale
from shoal.operator.settings import OperatorSettings

# -- hand-over detection ------------------------------------------------------------------


def scale_record(
    time: float, before: int, after: int, reason: str, dry_run: bool, epoch: int
) -> ScaleRecord:
    return ScaleRecord(
        time=time,
        from_replicas=before,
        to_replicas=after,
        reason=reason,
        dry_run=dry_run,
        epoch=epoch,
    )


def _targets(owners: dict[int, str]) -> dict[int, Target]:
    return {p: Target(m, 1, 1, None, 1) for p, m in owners.items()}


def _claims(owners: dict[int, str]) -> dict[int, Claim]:
    return {p: Claim(m, 1, 1) for p, m in owners.items()}


def test_settled_group_is_not_handing_over() -> None:
    owners = {p: "a" if p % 2 else "b" for p in range(8)}
    assert not handover_in_progress(8, _targets(owners), _claims(owners))


@pytest.mark.parametrize(
    ("targets", "claims"),
    [
        ({p: "a" for p in range(7)}, {p: "a" for p in range(8)}),  # a partition unowned
        ({p: "a" for p in range(8)}, {p: "a" for p in range(7)}),  # one not claimed yet
        ({p: "a" for p in range(8)}, {**{p: "a" for p in range(7)}, 7: "b"}),  # old owner
    ],
)
def test_any_unfinished_partition_is_a_handover(
    targets: dict[int, str], claims: dict[int, str]
) -> None:
    assert handover_in_progress(8, _targets(targets), _claims(claims))


# -- the victim ---------------------------------------------------------------------------


def test_victim_is_the_non_leader_with_fewest_partitions() -> None:
    owners = {**{p: "lead" for p in range(2)}, **{p: "x" for p in range(2, 6)}}
    owners.update({p: "y" for p in range(6, 9)})
    assert choose_victim(owners, ["lead", "x", "y"], "lead") == "y"


def test_leader_is_never_the_victim_even_with_fewest() -> None:
    owners = {0: "lead", **{p: "x" for p in range(1, 5)}, **{p: "y" for p in range(5, 9)}}
    assert choose_victim(owners, ["lead", "x", "y"], "lead") in {"x", "y"}
    assert choose_victim(owners, ["lead"], "lead") is None


def test_victim_ties_are_stable() -> None:
    """However etcd happens to list the members and the owners, the tie between b and c
    (one partition each; d has two, a leads) goes to the same member: the greatest id."""
    owners = {0: "a", 1: "b", 2: "c", 3: "d", 4: "d"}
    picks = {
        choose_victim(dict(items), list(members), "a")
        for members in itertools.permutations(["a", "b", "c", "d"])
        for items in itertools.permutations(owners.items())
    }
    assert picks == {"c"}


def test_deletion_costs_rank_victim_lowest_and_leader_highest() -> None:
    owners = {0: "lead", 1: "x", 2: "x", 3: "y"}
    costs = deletion_costs(owners, ["lead", "x", "y", "new"], "lead", "y")
    assert costs == {"lead": LEADER_COST, "x": 2, "y": VICTIM_COST, "new": 0}
    assert min(costs, key=lambda m: costs[m]) == "y"


# -- the record in etcd -------------------------------------------------------------------


def test_scale_record_round_trips_and_garbage_is_none() -> None:
    record = scale_record(1.5, 2, 3, "lag 9000", False, 7)
    assert ScaleRecord.parse(record.to_json()) == record
    for garbage in (b"", b"{", b"[]", b'{"time": "x", "from": 1, "to": 2, "reason": ""}', b"{}"):
        assert ScaleRecord.parse(garbage) is None


def test_a_new_leader_keeps_the_cooldown_by_its_own_clock() -> None:
    # The record's time is another host's wall clock: an hour behind or ahead, it does
    # not matter; the cooldown runs from when this process saw the record.
    for written_by_other_clock in (100.0, 5000.0 - 3600, 5000.0 + 3600):
        record = scale_record(written_by_other_clock, 4, 3, "idle", False, 1)
        state = resume_state(record, seen_ago=30.0, now=5000.0)
        assert state.last_action_time == 4970.0 and state.last_action_direction == "down"
    assert resume_state(None, 0.0, 5000.0).last_action_time is None


def test_event_message_names_change_reason_and_signals() -> None:
    decision = Decision(
        replicas=4,
        reason="lag 30000 over 1 member, target 4000 -> 8 (step capped at +4)",
        signals={"lag_total": 30000, "cpu_max": 12.345, "projects_avg": None},
        action="up",
    )
    text = event_message(decision, 1)
    assert text.startswith("Scaled 1 -> 4: lag 30000")
    assert "lag_total=30000" in text and "cpu_max=12.35" in text and "projects_avg" not in text
    dry = Decision(4, "x", {}, "up", dry_run=True)
    assert event_message(dry, 1).startswith("dry run: would scale 1 -> 4")


# -- status.lastScale ---------------------------------------------------------------------


def test_last_scale_credits_a_fresh_matching_record() -> None:
    now = time.time()
    value, ours = last_scale(2, 3, scale_record(now - 1, 2, 3, "cpu 95%", False, 1), now)
    assert ours and value["reason"] == "autoscaler: cpu 95%"
    assert (value["from"], value["to"]) == (2, 3)


@pytest.mark.parametrize(
    "record",
    [
        None,
        scale_record(0.0, 2, 3, "old", False, 1),  # too old
        scale_record(-1.0, 3, 4, "other change", False, 1),  # another change
        scale_record(-1.0, 2, 3, "dry", True, 1),  # a dry run changes nothing
    ],
)
def test_last_scale_otherwise_says_spec_changed(record: ScaleRecord | None) -> None:
    now = time.time()
    if record is not None and record.time < 0:
        record = record.model_copy(update={"time": now - 1})
    value, ours = last_scale(2, 3, record, now)
    assert not ours and value["reason"] == "spec.replicas changed"


# -- CPU ----------------------------------------------------------------------------------


def test_cgroup_v2_and_v1_quotas() -> None:
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("50000 100000\n") == 0.5
    assert parse_cpu_max("200000 100000") == 2.0
    assert parse_cpu_max("garbage") is None
    assert parse_cfs("-1", "100000") is None
    assert parse_cfs("25000\n", "100000\n") == 0.25
    assert parse_cfs("x", "100000") is None


def test_cgroup_files_are_read(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_limit_cores(tmp_path) == 1.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_limit_cores(v1) == 0.5
    assert cgroup_limit_cores(tmp_path / "none") is None


def test_ceiling_is_the_tightest_limit_and_at_most_one_process() -> None:
    assert ceiling_cores(None, None) == 1.0  # never the host's core count
    assert ceiling_cores(0.5, None) == 0.5
    assert ceiling_cores(None, 0.25) == 0.25
    assert ceiling_cores(0.5, 0.25) == 0.25
    assert ceiling_cores(4.0, 2.0) == 1.0  # one Python process cannot use more
    assert parse_millicores("500") == 0.5
    assert parse_millicores("0") is None and parse_millicores("x") is None


def test_cpu_meter_is_relative_to_its_ceiling() -> None:
    half, whole = CpuMeter(ceiling=0.5), CpuMeter(ceiling=1.0)
    spent = time.process_time()
    while time.process_time() - spent < 0.1:
        pass  # burn CPU (however much of the host this process gets)
    a, b = half.read(), whole.read()
    # The same usage reads twice as high against half the ceiling.
    assert b > 0 and a == pytest.approx(2 * b, rel=0.05)


@pytest.mark.parametrize(
    ("quantity", "millicores"),
    [("500m", 500), ("2", 2000), ("0.5", 500), (1, 1000), ("1.5", 1500), ("250.5m", 251)],
)
def test_cpu_quantities(quantity: object, millicores: int) -> None:
    assert cpu_millicores(quantity) == millicores


@pytest.mark.parametrize("quantity", [None, "", "x", "0", True, "-1"])
def test_unreadable_cpu_quantities_give_no_hint(quantity: object) -> None:
    assert cpu_millicores(quantity) is None


def test_builder_passes_the_cpu_limit_and_enables_the_autoscaler() -> None:
    settings = OperatorSettings()
    spec = {"handler": "m:f", "resources": {"limits": {"cpu": "500m"}}}
    env = {v["name"]: v.get("value") for v in consumer_env("g", "ns", spec, settings)}
    assert env["SHOAL_CPU_LIMIT_MILLICORES"] == "500"
    assert env["SHOAL_AUTOSCALER"] == "kubernetes"
    bare = {v["name"] for v in consumer_env("g", "ns", {"handler": "m:f"}, settings)}
    assert "SHOAL_CPU_LIMIT_MILLICORES" not in bare


# -- one round against a real etcd --------------------------------------------------------


class RecordingTarget:
    """Stands in for the API server: a ConsumerGroup in memory, calls recorded."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.calls: list[tuple[str, Any]] = []

    async def read(self) -> dict[str, Any]:
        return {"metadata": {"uid": "u1"}, "spec": dict(self.spec)}

    async def scale(self, replicas: int) -> None:
        self.calls.append(("scale", replicas))
        self.spec["replicas"] = replicas

    async def event(self, reason: str, message: str, uid: str, warning: bool = False) -> None:
        self.calls.append(("event", reason))

    async def set_deletion_costs(self, costs: dict[str, int]) -> None:
        self.calls.append(("costs", costs))


class FakeLeader:
    is_leader = True

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.expected: tuple[int, float] | None = None

    def expect_scale(self, replicas: int, until: float) -> None:
        self.expected = (replicas, until)


async def _group(etcd: Etcd, config: GroupConfig, members: dict[str, dict[str, Any]]) -> int:
    """Write a settled group of `members` with us as leader; returns the leader epoch."""
    keys = config.keys
    epoch = await etcd.create_returning_revision(keys.leader, config.member_id.encode(), None)
    assert epoch is not None
    names = sorted(members)
    for p in range(config.partitions):
        owner = names[p % len(names)]
        target = {"owner": owner, "generation": 1, "epoch": epoch, "ts": time.time()}
        await etcd.put(keys.partition(p), json.dumps(target).encode())
        await etcd.put(keys.claim(p), owner.encode())
    for name, stats in members.items():
        await etcd.put(keys.member(name), json.dumps(stats).encode())
    return epoch


def _stats(lag: int, **extra: Any) -> dict[str, Any]:
    return {"cpu": 10.0, "active_projects": 5, "lag": lag, "ts": time.time(), **extra}


@pytest.mark.e2e
async def test_a_round_scales_down_sparing_the_leader_and_records_it(
    etcd: Etcd, group: str, namespace: str
) -> None:
    config = GroupConfig(namespace=namespace, group=group, partitions=8, member_id="lead")
    epoch = await _group(etcd, config, {"lead": _stats(0), "x": _stats(0), "y": _stats(0)})
    view = GroupView(etcd, config.keys, config.partitions)
    watcher = asyncio.create_task(view.run())
    try:
        await view.synced.wait()
        spec = {
            "handler": "shoal.consumer.handlers:noop",
            "replicas": 3,
            "minReplicas": 1,
            "maxReplicas": 4,
            "partitions": 8,
            "autoscaling": {"enabled": True, "cooldownSeconds": 0, "targetLagPerMember": 100},
        }
        target, leader = RecordingTarget(spec), FakeLeader(epoch)
        scaler = Autoscaler(config, etcd, view, leader, target)
        await scaler.round()
        assert [c[0] for c in target.calls] == ["costs", "costs", "scale", "event"], target.calls
        # Every member marked (the leader highest), then only the victim's mark changes.
        assert target.calls[0][1] == {"lead": LEADER_COST, "x": 3, "y": 2}
        assert target.calls[1][1] == {"y": VICTIM_COST}  # fewest partitions, not the leader
        assert target.calls[2] == ("scale", 2)
        assert target.calls[3] == ("event", "ScaledDown")
        assert leader.expected is not None and leader.expected[0] == 2
        _, kvs = await etcd.get_prefix(config.keys.scale)
        record = ScaleRecord.parse(kvs[config.keys.scale].value)
        assert record is not None and (record.from_replicas, record.to_replicas) == (3, 2)

        # Dry run: reported, recorded, nothing changed.
        target.calls.clear()
        target.spec["autoscaling"] = {"enabled": True, "cooldownSeconds": 0, "dryRun": True}
        target.spec["autoscaling"]["targetLagPerMember"] = 100
        await scaler.round()
        # (y, still a member here, keeps its mark until it leaves.)
        assert target.calls == [("event", "WouldScaleDown")]

        # Garbage in the record is ignored by a new leader's loop.
        await etcd.put(config.keys.scale, b"not json")
        await view.changed(1.0)
        fresh = Autoscaler(config, etcd, view, leader, RecordingTarget(dict(spec)))
        await fresh.round()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await etcd.delete_prefix(config.keys.prefix)


class ManualClock:
    """This process's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.e2e
@pytest.mark.parametrize("skew", [-3600.0, 3600.0])
async def test_the_cooldown_survives_a_leader_change_whatever_the_clocks(
    etcd: Etcd, group: str, namespace: str, skew: float
) -> None:
    """The last scale was written by a leader whose wall clock was an hour behind (so the
    record looks an hour old: the old code scaled at once, inside the cooldown) or an hour
    ahead (the old code waited an hour more). The new leader holds exactly one cooldown
    from when it saw the record, by its own monotonic clock."""
    config = GroupConfig(namespace=namespace, group=group, partitions=8, member_id="lead")
    hot = _stats(10_000)
    epoch = await _group(etcd, config, {"lead": hot, "x": hot})
    written = scale_record(time.time() + skew, 1, 2, "lag", False, epoch - 1)
    await etcd.put(config.keys.scale, written.to_json())
    view = GroupView(etcd, config.keys, config.partitions)
    watcher = asyncio.create_task(view.run())
    try:
        await view.synced.wait()
        spec = {
            "handler": "shoal.consumer.handlers:noop",
            "replicas": 2,
            "minReplicas": 1,
            "maxReplicas": 6,
            "partitions": 8,
            "autoscaling": {"enabled": True, "cooldownSeconds": 60, "targetLagPerMember": 100},
        }
        target, leader, mono = RecordingTarget(spec), FakeLeader(epoch), ManualClock()
        scaler = Autoscaler(config, etcd, view, leader, target, monotonic=mono)
        scaler._observe_record()  # the run loop does this every second, leader or not
        mono.now += 30  # half the cooldown later, this member becomes leader
        await scaler.round()
        assert ("scale", 6) not in target.calls, "scaled inside the predecessor's cooldown"
        assert scaler.last_reason.startswith("cooldown until"), scaler.last_reason
        # Half a cooldown from then (a full one since the record was seen) it may act.
        scaler.state = None  # as after another leader change: resumed from the record
        mono.now += 31
        for member in ("lead", "x"):
            await etcd.put(config.keys.member(member), json.dumps(_stats(10_000)).encode())
        await view.changed(1.0)
        await scaler.round()
        assert ("scale", 6) in target.calls, (scaler.last_reason, target.calls)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await etcd.delete_prefix(config.keys.prefix)


class DenyingTarget(RecordingTarget):
    """An API server that refuses the next `denials` scale patches with `status`."""

    def __init__(self, spec: dict[str, Any], status: int, denials: int = 1) -> None:
        super().__init__(spec)
        self.status, self.denials = status, denials

    async def scale(self, replicas: int) -> None:
        if self.denials:
            self.denials -= 1
            self.calls.append(("denied", replicas))
            raise ApiException(status=self.status, reason="Denied")
        await super().scale(replicas)

    async def event(self, reason: str, message: str, uid: str, warning: bool = False) -> None:
        self.calls.append(("warning" if warning else "event", reason))


HOT_SPEC = {
    "handler": "shoal.consumer.handlers:noop",
    "replicas": 2,
    "minReplicas": 1,
    "maxReplicas": 4,
    "partitions": 8,
    "autoscaling": {"enabled": True, "cooldownSeconds": 600, "targetLagPerMember": 100},
}


@pytest.mark.e2e
@pytest.mark.parametrize("status", [403, 409, 422])
async def test_a_denied_scale_starts_no_cooldown_and_is_retried(
    etcd: Etcd, group: str, namespace: str, status: int
) -> None:
    """Issue 24, defect 8: the API server refused the patch, yet the loop started its
    600 s cooldown, so the group stayed too small for ten minutes with nothing scaled.
    Now a refused scale leaves no cooldown (in memory, or in etcd for a successor), is
    reported once as a Warning Event, and the next round scales."""
    config = GroupConfig(namespace=namespace, group=group, partitions=8, member_id="lead")
    epoch = await _group(etcd, config, {"lead": _stats(1000), "x": _stats(1000)})
    view = GroupView(etcd, config.keys, config.partitions)
    watcher = asyncio.create_task(view.run())
    try:
        await view.synced.wait()
        target = DenyingTarget(dict(HOT_SPEC), status, denials=2)
        scaler = Autoscaler(config, etcd, view, FakeLeader(epoch), target)
        for _ in range(2):
            with pytest.raises(ScaleFailed, match=rf"could not scale 2 -> 4: API {status}"):
                await scaler.round()
        assert scaler.state is not None and scaler.state.last_action_time is None
        # Reported once per episode, not once per try.
        assert [c for c in target.calls if c[0] == "warning"] == [("warning", "ScaleFailed")]
        # The decision recorded before the patch is withdrawn: a successor would
        # otherwise hold a cooldown for a scale that never happened.
        _, kvs = await etcd.get_prefix(config.keys.scale)
        assert config.keys.scale not in kvs
        await scaler.round()
        assert ("scale", 4) in target.calls, (scaler.last_reason, target.calls)
        assert scaler.state.last_action_time is not None  # the cooldown runs from now
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await etcd.delete_prefix(config.keys.prefix)


@pytest.mark.e2e
async def test_an_etcd_error_while_recording_starts_no_cooldown(
    etcd: Etcd, group: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24, defect 8: the decision could not be recorded in etcd (so nothing was
    scaled), yet the cooldown started."""
    config = GroupConfig(namespace=namespace, group=group, partitions=8, member_id="lead")
    epoch = await _group(etcd, config, {"lead": _stats(1000), "x": _stats(1000)})
    view = GroupView(etcd, config.keys, config.partitions)
    watcher = asyncio.create_task(view.run())
    try:
        await view.synced.wait()
        target = RecordingTarget(dict(HOT_SPEC))
        scaler = Autoscaler(config, etcd, view, FakeLeader(epoch), target)
        real = etcd.guarded_put_many

        async def unreachable(*args: Any, **kwargs: Any) -> bool:
            raise etcd3.exceptions.ConnectionFailedError()

        monkeypatch.setattr(etcd, "guarded_put_many", unreachable)
        with pytest.raises(ScaleFailed, match="could not scale 2 -> 4"):
            await scaler.round()
        assert ("scale", 4) not in target.calls
        monkeypatch.setattr(etcd, "guarded_put_many", real)
        await scaler.round()
        assert ("scale", 4) in target.calls, (scaler.last_reason, target.calls)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await etcd.delete_prefix(config.keys.prefix)


def test_failed_rounds_back_off_from_the_next_evaluation_to_five_minutes() -> None:
    """A permanent denial is retried at the next evaluation, then ever more rarely: one
    log line per try, at most one every MAX_BACKOFF_SECONDS."""
    delays = [retry_delay(30.0, failures) for failures in range(1, 8)]
    assert delays == [30.0, 60.0, 120.0, 240.0, 300.0, 300.0, 300.0]
    assert retry_delay(1.0, 1) == 1.0


@pytest.mark.e2e
@pytest.mark.timeout(60)
async def test_healthy_members_stats_are_never_stale_at_a_short_interval(
    etcd: Etcd, make_config: Callable[..., GroupConfig], caplog: pytest.LogCaptureFixture
) -> None:
    """intervalSeconds 1 on the real cadences: members write their routine stats every
    keepalive (3 s) and the leader reads them every 3 s (view.STATS_POLL_SECONDS), so a
    healthy member's stats are up to about 6 s old when a round reads them. Stale after
    three autoscaler intervals (3 s) made the loop ignore healthy members in most rounds
    ("stale stats"), and a group with ignored members is never scaled down. Stats are
    stale only after three of their own periods too: this idle group of 3 goes down."""
    leader_config = make_config(member_id="lead")
    names = ("lead", "x", "y")
    memberships = [
        Membership(etcd, leader_config.model_copy(update={"member_id": name}), _idle_stats)
        for name in names
    ]
    for membership in memberships:
        await membership.join()
    keep_alive = [asyncio.create_task(m.run()) for m in memberships]
    view = GroupView(etcd, leader_config.keys, leader_config.partitions)
    watcher = asyncio.create_task(view.run())
    try:
        await view.synced.wait()
        view.follow_stats(True)
        async with asyncio.timeout(10):
            await view.stats_synced.wait()
        epoch = await etcd.create_returning_revision(
            leader_config.keys.leader, b"lead", memberships[0].lease_id
        )
        assert epoch is not None
        for p in range(leader_config.partitions):  # settled: no hand-over holds the loop
            owner = names[p % len(names)]
            target = {"owner": owner, "generation": 1, "epoch": epoch, "ts": time.time()}
            await etcd.put(leader_config.keys.partition(p), json.dumps(target).encode())
            await etcd.put(leader_config.keys.claim(p), owner.encode())
        spec = {
            "handler": "shoal.consumer.handlers:noop",
            "replicas": 3,
            "minReplicas": 1,
            "maxReplicas": 4,
            "partitions": leader_config.partitions,
            # (An idle group: 0 active projects per member, under minProjectsPerMember.)
            "autoscaling": {"enabled": True, "intervalSeconds": 1, "cooldownSeconds": 0},
        }
        recording = RecordingTarget(spec)
        scaler = Autoscaler(leader_config, etcd, view, FakeLeader(epoch), recording)
        caplog.set_level(logging.WARNING, logger="shoal.consumer.scaler")
        await asyncio.sleep(3.5)  # past the join's first stats
        for _ in range(8):  # rounds that find the stats at every age they reach
            await scaler.round()
            await asyncio.sleep(1.0)
        assert "stale stats" not in caplog.text
        assert ("scale", 2) in recording.calls, recording.calls
    finally:
        view.follow_stats(False)
        for task in (watcher, *keep_alive):
            task.cancel()
        await asyncio.gather(watcher, *keep_alive, return_exceptions=True)
        for membership in memberships:
            await membership.close()
        await etcd.delete_prefix(leader_config.keys.prefix)


def _idle_stats() -> MemberStats:
    return MemberStats(ts=time.time(), cpu=5.0, active_projects=0, lag=0)


@pytest.mark.e2e
async def test_a_leadership_change_inside_one_interval_drops_the_old_terms_state(
    etcd: Etcd, group: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run() forgot its ScalerState (and its pod marks) only when it saw is_leader False
    at the top of its loop, between two sleeps of intervalSeconds. Leadership lost and
    won back under a new epoch inside one sleep (another member led meanwhile, scaled and
    resigned: a rolling restart) kept the old term's state, which knew nothing of the
    other leader's scale: it scaled again at once, inside the cooldown that scale started.
    A round under a new epoch now resumes from etcd's record, as a new term does."""
    config = GroupConfig(namespace=namespace, group=group, partitions=8, member_id="lead")
    # Lag 200 over 2 members, target 100: within tolerance, no action.
    epoch = await _group(etcd, config, {"lead": _stats(100), "x": _stats(100)})
    view = GroupView(etcd, config.keys, config.partitions)
    watcher = asyncio.create_task(view.run())
    spec = {
        "handler": "shoal.consumer.handlers:noop",
        "replicas": 2,
        "minReplicas": 1,
        "maxReplicas": 8,
        "partitions": 8,
        "autoscaling": {
            "enabled": True,
            "intervalSeconds": 2,
            "cooldownSeconds": 600,
            "targetLagPerMember": 100,
        },
    }
    target, leader = RecordingTarget(spec), FakeLeader(epoch)
    scaler = Autoscaler(config, etcd, view, leader, target)
    # run()'s sleep between rounds, held open by the test, so that the leadership change
    # below happens inside it.
    gate = asyncio.Event()

    class _Asyncio:
        def __getattr__(self, name: str) -> Any:
            return getattr(asyncio, name)

        async def sleep(self, delay: float) -> None:
            await gate.wait()
            gate.clear()

    def decided(rounds: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return scaler.decisions >= rounds

        return check

    monkeypatch.setattr(autoscaler_module, "asyncio", _Asyncio())
    await view.synced.wait()
    loop = asyncio.create_task(scaler.run())
    try:
        await eventually_async(decided(1), 10, "the first round", interval=0.02)
        assert not [c for c in target.calls if c[0] == "scale"]
        # Inside the sleep: member x led (a new epoch), scaled 2 -> 3 (recorded, then
        # the patch) and resigned; we won the next campaign.
        keys = config.keys
        await etcd.delete(keys.leader)
        other = await etcd.create_returning_revision(keys.leader, b"x", None)
        assert other is not None
        await etcd.put(keys.scale, scale_record(time.time(), 2, 3, "lag", False, other).to_json())
        target.spec["replicas"] = 3
        await etcd.delete(keys.leader)
        mine = await etcd.create_returning_revision(keys.leader, b"lead", None)
        assert mine is not None
        leader.epoch = mine
        # The load grows a little: the lag rule wants 5.
        for name in ("lead", "x"):
            await etcd.put(keys.member(name), json.dumps(_stats(250)).encode())
        while view.members()["x"].lag != 250:
            await view.changed(0.5)
        gate.set()  # the sleep ends
        await eventually_async(decided(2), 10, "the round after the sleep", interval=0.02)
        scales = [c for c in target.calls if c[0] == "scale"]
        assert not scales, f"scaled {scales} inside the 600 s cooldown: {scaler.last_reason!r}"
        assert scaler.last_reason.startswith("cooldown until"), scaler.last_reason
    finally:
        loop.cancel()
        watcher.cancel()
        await asyncio.gather(loop, watcher, return_exceptions=True)
        await etcd.delete_prefix(config.keys.prefix)
