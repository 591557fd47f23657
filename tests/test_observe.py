"""shoal.operator.observe: from observations to a ConsumerGroup's status (pure, no servers).

Each Ready, Progressing and Degraded reason; observedGeneration on every condition; and
lastTransitionTime, which moves only when a condition's status does.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from shoal.contracts.names import format_time
from shoal.contracts.values import MemberStats, PauseRecord, ValueRefused
from shoal.group.pause import RESET_SOURCE
from shoal.operator.observe import (
    ETCD_FIELDS,
    Observed,
    conditions,
    degraded,
    refusal_changes,
    refusals_in_status,
    stall_changes,
    stall_ended_message,
    stall_started_message,
    stalled_partitions,
    stamp,
    status,
    status_changes,
    waiting_message,
)
from shoal.operator.scheduling import Unschedulable

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def observed(**changes: Any) -> Observed:
    """A healthy group of 3 members, 128 partitions, generation 7; `changes` on top."""
    healthy = Observed(
        generation=7,
        spec_replicas=3,
        replicas=3,
        ready_replicas=3,
        members={"c-0": 43, "c-1": 43, "c-2": 42},
        leader="c-0",
        assignment_generation=12,
        partitions=128,
        unowned=0,
        unclaimed=0,
        lag=0,
        selector="shoal.dev/group=orders",
    )
    return dataclasses.replace(healthy, **changes)


def by_type(found: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in found}


def summary(found: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in found}


# -- conditions: one case per reason ------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "ready", "progressing", "degraded_"),
    [
        pytest.param(
            {},
            ("True", "GroupReady"),
            ("False", "Stable"),
            ("False", "AsExpected"),
            id="ready",
        ),
        pytest.param(
            # As observe_group sees it: the last assignment's targets stay in etcd, the
            # claims went with the members' leases.
            {
                "spec_replicas": 0,
                "replicas": 0,
                "ready_replicas": 0,
                "members": {},
                "leader": None,
                "unclaimed": 128,
                "moving": 128,
            },
            ("True", "ScaledToZero"),
            ("False", "Stable"),
            ("False", "AsExpected"),
            id="scaled-to-zero",
        ),
        pytest.param(
            # Scaled to zero, but a pod is still on its way out.
            {"spec_replicas": 0, "replicas": 1, "ready_replicas": 1, "members": {"c-0": 128}},
            ("False", "ScaledToZero"),
            ("True", "Reconciling"),
            ("False", "AsExpected"),
            id="scaling-to-zero",
        ),
        pytest.param(
            {"ready_replicas": 2, "members": {"c-0": 64, "c-1": 64}},
            ("False", "WaitingForMembers"),
            ("True", "Reconciling"),
            ("False", "AsExpected"),
            id="waiting-for-members",
        ),
        pytest.param(
            {"leader": None},
            ("False", "NoLeader"),
            ("False", "Stable"),
            ("False", "AsExpected"),
            id="no-leader",
        ),
        pytest.param(
            {"unowned": 5},
            ("False", "PartitionsUnassigned"),
            ("False", "Stable"),
            ("False", "AsExpected"),
            id="unowned",
        ),
        pytest.param(
            {"unclaimed": 2},
            ("False", "PartitionsUnassigned"),
            ("True", "Reconciling"),
            ("False", "AsExpected"),
            id="unclaimed",
        ),
        pytest.param(
            # A member joined: registered and ready, the leader has not given it a share.
            {
                "spec_replicas": 4,
                "replicas": 4,
                "ready_replicas": 4,
                "members": {"c-0": 43, "c-1": 43, "c-2": 42, "c-3": 0},
            },
            ("True", "GroupReady"),
            ("True", "Rebalancing"),
            ("False", "AsExpected"),
            id="member-joined",
        ),
        pytest.param(
            # The new assignment is written; partitions are being handed over.
            {"moving": 32},
            ("True", "GroupReady"),
            ("True", "Rebalancing"),
            ("False", "AsExpected"),
            id="hand-over",
        ),
        pytest.param(
            # c-2 left: the assignment still names it for its 42 partitions.
            {
                "spec_replicas": 2,
                "replicas": 2,
                "ready_replicas": 2,
                "members": {"c-0": 43, "c-1": 43},
            },
            ("True", "GroupReady"),
            ("True", "Rebalancing"),
            ("False", "AsExpected"),
            id="member-left",
        ),
        pytest.param(
            # The Status column (Progressing's reason) says it too, not "Stable".
            {"problem": ("NatsUnavailable", "JetStream at nats://x: timeout")},
            ("False", "NatsUnavailable"),
            ("False", "NatsUnavailable"),
            ("True", "NatsUnavailable"),
            id="problem",
        ),
        pytest.param(
            # A problem outranks missing members in Ready (it says why they are missing).
            {"ready_replicas": 0, "members": {}, "problem": ("HandlerInvalid", "no module")},
            ("False", "HandlerInvalid"),
            ("False", "HandlerInvalid"),
            ("True", "HandlerInvalid"),
            id="problem-and-no-members",
        ),
        pytest.param(
            # Scaled to zero is not Ready while the stream producers use cannot be made.
            {
                "spec_replicas": 0,
                "replicas": 0,
                "ready_replicas": 0,
                "members": {},
                "problem": ("NatsAuthFailed", "authorization violation"),
            },
            ("False", "NatsAuthFailed"),
            ("False", "NatsAuthFailed"),
            ("True", "NatsAuthFailed"),
            id="problem-at-zero",
        ),
        pytest.param(
            # c-1 reports partition 3 stalled (its readiness fails with it).
            {"stalled": ((3, "c-1"),), "ready_replicas": 2},
            ("False", "WaitingForMembers"),
            ("False", "PartitionsStalled"),
            ("True", "PartitionsStalled"),
            id="stalled",
        ),
        pytest.param(
            # The leader is moving it: the stall still shows until c-1 stops reporting it.
            {"stalled": ((3, "c-1"),), "moving": 1},
            ("True", "GroupReady"),
            ("False", "PartitionsStalled"),
            ("True", "PartitionsStalled"),
            id="stalled-while-moving",
        ),
        pytest.param(
            # A problem says more than the stall it may cause.
            {"stalled": ((3, "c-1"),), "problem": ("NatsUnavailable", "timeout")},
            ("False", "NatsUnavailable"),
            ("False", "NatsUnavailable"),
            ("True", "NatsUnavailable"),
            id="stalled-and-problem",
        ),
    ],
)
def test_each_reason(
    changes: dict[str, Any],
    ready: tuple[str, str],
    progressing: tuple[str, str],
    degraded_: tuple[str, str],
) -> None:
    found = conditions(observed(**changes))
    assert [c["type"] for c in found] == [
        "Ready",
        "Progressing",
        "Degraded",
        "Paused",
        "MembersSchedulable",
    ]
    assert summary(found) == {
        "Ready": ready,
        "Progressing": progressing,
        "Degraded": degraded_,
        "Paused": ("False", "Running"),
        # No pod refused by the scheduler in any of these (tests/test_scheduling.py).
        "MembersSchedulable": ("True", "Schedulable"),
    }


def test_every_condition_carries_the_observed_generation_and_a_message() -> None:
    for changes in (
        {},
        {"generation": 1, "leader": None},
        {"generation": 99, "problem": ("R", "m")},
    ):
        o = observed(**changes)
        for condition in conditions(o):
            assert condition["observedGeneration"] == o.generation
            assert condition["message"]


def test_messages_say_what_is_wrong() -> None:
    c = by_type(conditions(observed(ready_replicas=1, unowned=3, unclaimed=4)))
    assert c["Ready"]["message"] == "1 of 3 members ready"
    c = by_type(conditions(observed(unowned=3, unclaimed=4)))
    assert c["Ready"]["message"] == "3 partitions without an owner, 4 not being consumed"
    c = by_type(conditions(observed(problem=("StreamConfigConflict", "retention differs"))))
    assert c["Ready"]["message"] == c["Degraded"]["message"] == "retention differs"
    c = by_type(conditions(observed()))
    assert c["Ready"]["message"] == "3 members consume 128 partitions, led by c-0"


def test_progressing_until_pods_ready_pods_and_members_all_match_the_spec() -> None:
    for changes in (
        {"replicas": 4},  # a pod too many (scaling down)
        {"ready_replicas": 2},
        {"members": {"c-0": 64, "c-1": 64}},  # a pod not registered yet
    ):
        assert by_type(conditions(observed(**changes)))["Progressing"]["status"] == "True"


# -- stamp: lastTransitionTime -----------------------------------------------------------------


def test_a_new_condition_is_stamped_now() -> None:
    found = stamp(conditions(observed()), [], T0)
    assert {c["lastTransitionTime"] for c in found} == {T0}


def test_the_time_stays_while_the_status_stays_even_if_reason_and_message_change() -> None:
    before = stamp(conditions(observed(leader=None)), [], T0)
    after = stamp(conditions(observed(unowned=9)), before, T1)
    ready = by_type(after)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "PartitionsUnassigned")
    assert ready["lastTransitionTime"] == T0


def test_the_time_moves_when_the_status_changes() -> None:
    before = stamp(conditions(observed(leader=None)), [], T0)
    after = by_type(stamp(conditions(observed()), before, T1))
    assert after["Ready"]["status"] == "True" and after["Ready"]["lastTransitionTime"] == T1
    # The others did not change status: their times stay.
    assert after["Progressing"]["lastTransitionTime"] == T0
    assert after["Degraded"]["lastTransitionTime"] == T0


def test_a_previous_condition_without_a_time_gets_one() -> None:
    old = [{"type": "Ready", "status": "True", "reason": "GroupReady"}]
    ready = by_type(stamp(conditions(observed()), old, T1))["Ready"]
    assert ready["lastTransitionTime"] == T1


def test_stamp_leaves_its_inputs_alone() -> None:
    new = conditions(observed())
    old = stamp(new, [], T0)
    stamp(new, old, T1)
    assert all("lastTransitionTime" not in c for c in new)
    assert {c["lastTransitionTime"] for c in old} == {T0}


# -- degraded: what a failed reconcile writes --------------------------------------------------


def test_degraded_sets_the_problem_where_the_timer_will() -> None:
    old = stamp(conditions(observed()), [], T0)
    found = degraded(old, "HandlerInvalid", "cannot import x", 8, T1)
    c = by_type(found)
    assert [x["type"] for x in found] == [
        "Ready",
        "Progressing",
        "Degraded",
        "Paused",
        "MembersSchedulable",
    ]
    assert c["Degraded"] == {
        "type": "Degraded",
        "status": "True",
        "reason": "HandlerInvalid",
        "message": "cannot import x",
        "observedGeneration": 8,
        "lastTransitionTime": T1,  # False -> True
    }
    # Ready and Progressing as the status timer's next observation writes them.
    expected = by_type(
        conditions(observed(generation=8, problem=("HandlerInvalid", "cannot import x")))
    )
    for kind, moved in (("Ready", True), ("Progressing", False)):  # Progressing was False
        assert {k: v for k, v in c[kind].items() if k != "lastTransitionTime"} == expected[kind]
        assert c[kind]["lastTransitionTime"] == (T1 if moved else T0)
    # The others stay as the status timer wrote them, times included.
    assert [c["Paused"], c["MembersSchedulable"]] == [
        x for x in old if x["type"] in ("Paused", "MembersSchedulable")
    ]


def test_degraded_again_for_another_reason_keeps_the_transition_time() -> None:
    first = degraded([], "EtcdSecretMissing", "Secret ns/s not found", 1, T0)
    assert by_type(first)["Degraded"] == {
        "type": "Degraded",
        "status": "True",
        "reason": "EtcdSecretMissing",
        "message": "Secret ns/s not found",
        "observedGeneration": 1,
        "lastTransitionTime": T0,
    }
    assert summary(first) == {
        "Ready": ("False", "EtcdSecretMissing"),
        "Progressing": ("False", "EtcdSecretMissing"),
        "Degraded": ("True", "EtcdSecretMissing"),
    }
    second = by_type(
        degraded(first, "EtcdSecretInvalid", "tls.key is not a PEM private key", 2, T1)
    )
    for kind in ("Ready", "Progressing", "Degraded"):
        assert second[kind]["reason"] == "EtcdSecretInvalid"
        assert second[kind]["observedGeneration"] == 2
        assert second[kind]["lastTransitionTime"] == T0


# -- status ------------------------------------------------------------------------------------


def test_status_fields() -> None:
    o = observed(members={"c-0": 44, "c-1": 43, "c-2": 41}, lag=17)
    st = status(o, [], T0)
    assert st["observedGeneration"] == 7
    assert st["replicas"] == st["readyReplicas"] == st["members"] == 3
    assert st["selector"] == "shoal.dev/group=orders"
    assert st["leader"] == "c-0" and st["assignmentGeneration"] == 12
    assert st["partitionsPerMember"] == {"min": 41, "max": 44}
    assert st["skew"] == 3
    assert st["lag"] == 17
    assert summary(st["conditions"])["Ready"] == ("True", "GroupReady")
    assert {c["lastTransitionTime"] for c in st["conditions"]} == {T0}


def test_skew_is_left_out_while_rebalancing_and_the_condition_says_why() -> None:
    joined = observed(
        spec_replicas=4,
        replicas=4,
        ready_replicas=4,
        members={"c-0": 43, "c-1": 43, "c-2": 42, "c-3": 0},
        moving=0,
    )
    st = status(joined, [], T0)
    # None: the status patch deletes the field, so `kubectl get cg` shows no skew of 43.
    assert st["skew"] is None
    assert st["partitionsPerMember"] == {"min": 0, "max": 43}
    progressing = by_type(st["conditions"])["Progressing"]
    assert progressing["message"] == "Rebalancing: 0 of 128 partitions moving between 4 members"
    handing_over = status(observed(moving=32), [], T0)
    assert handing_over["skew"] is None
    assert (
        "32 of 128 partitions moving"
        in by_type(handing_over["conditions"])["Progressing"]["message"]
    )
    # Settled again: the skew is back.
    assert status(observed(), [], T0)["skew"] == 1


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param(
            # After running: every target still names a member that left; nothing claims.
            {"unowned": 0, "unclaimed": 128, "moving": 128},
            id="after-running",
        ),
        pytest.param(
            # Created with replicas: 0 (README: --member-groups gives the others 0).
            {"assignment_generation": 0, "unowned": 128, "unclaimed": 128, "moving": 0},
            id="never-started",
        ),
    ],
)
def test_scaled_to_zero_is_stable_whatever_the_targets_say(changes: dict[str, Any]) -> None:
    """Scaled to zero, the group showed Rebalancing ("128 of 128 partitions moving
    between 0 members") or Reconciling for ever: the targets stay in etcd and count as
    moving or unclaimed, though with no member nothing can move."""
    zero = observed(
        spec_replicas=0, replicas=0, ready_replicas=0, members={}, leader=None, **changes
    )
    st = status(zero, [], T0)
    assert summary(st["conditions"])["Ready"] == ("True", "ScaledToZero")
    assert summary(st["conditions"])["Progressing"] == ("False", "Stable")
    assert st["skew"] == 0


def test_a_member_cut_from_nats_without_a_share_is_not_rebalancing() -> None:
    """The leader gives a member that reports it cannot reach NATS no partition
    (election._eligible). Its zero share read as a newcomer's: "Rebalancing: 0 of 128
    partitions moving" for as long as it stayed cut, and no skew."""
    cut = observed(
        members={"c-0": 64, "c-1": 64, "c-2": 0},
        nats_ok={"c-0": True, "c-1": True, "c-2": False},
        moving=0,
    )
    st = status(cut, [], T0)
    assert summary(st["conditions"])["Progressing"] == ("False", "Stable")
    assert st["skew"] == 64
    # A newcomer that reaches NATS still waits for its share.
    joined = dataclasses.replace(cut, nats_ok={"c-2": True})
    assert summary(conditions(joined))["Progressing"] == ("True", "Rebalancing")


def test_etcd_unread_leaves_what_etcd_said_in_the_status() -> None:
    """With etcd unreadable, the status said leader "", 0 members, assignmentGeneration
    0, partitionsPerMember 0..0 and skew 0, and deleted stalledPartitions: guesses, and
    the return to the true generation looked like a rebalance."""
    unread = observed(
        members={},
        leader=None,
        assignment_generation=0,
        unowned=128,
        unclaimed=128,
        etcd_read=False,
        problem=("EtcdUnavailable", "etcd at x unavailable: timeout"),
    )
    st = status(unread, [], T0)
    assert not set(ETCD_FIELDS) & set(st), st  # left out: the merge patch keeps them
    assert st["replicas"] == 3 and summary(st["conditions"])["Ready"][1] == "EtcdUnavailable"
    assert set(ETCD_FIELDS) <= set(status(observed(), [], T0))


def test_a_resets_pause_is_paused() -> None:
    """A reset's pause (interrupted `shoal-consumer reset`) says so, apart from
    spec.paused's."""
    record = PauseRecord(by="alice@host", time=1_767_225_600.0, source=RESET_SOURCE)
    found = by_type(conditions(observed(paused=record)))
    assert (found["Paused"]["status"], found["Paused"]["reason"]) == ("True", "ResetPaused")
    assert "`shoal-consumer reset`" in found["Paused"]["message"]
    assert found["Progressing"]["reason"] == "Paused"
    spec = PauseRecord(by="kubectl-patch", time=1_767_225_600.0, source="spec.paused")
    assert by_type(conditions(observed(paused=spec)))["Paused"]["reason"] == "SpecPaused"
    # A pause of `shoal-consumer pause` (the operator keeps it): lifted by the command.
    cli = PauseRecord(by="bob@host", time=1_767_225_600.0, source="cli")
    paused = by_type(conditions(observed(paused=cli)))["Paused"]
    assert paused["reason"] == "CommandPaused"
    assert paused["message"].endswith("Resume with `shoal-consumer resume`")


@pytest.mark.parametrize(
    "when", [b"1e17", b"1e300", b"-5", b"NaN", b"Infinity", b"253402300800", b"1" + b"0" * 400]
)
def test_a_pause_time_out_of_range_is_an_unknown_time(when: bytes) -> None:
    """A pause record's time that parses but no clock gives (1e17, 1e300) made
    format_time raise (OverflowError, OSError) in every status tick: no status was
    written at all."""
    record = PauseRecord.parse(b'{"by": "x", "time": %s, "source": "spec.paused"}' % when)
    assert record.time == 0.0 and record.by == "x"
    paused = by_type(conditions(observed(paused=record)))["Paused"]
    assert "by x at an unknown time (spec.paused)" in paused["message"]
    # Made by hand, not parsed: shown as unknown too.
    assert "an unknown time" in PauseRecord(by="x", time=1e300).describe()


def test_status_carries_the_dead_letter_count_when_known() -> None:
    assert status(observed(dead_letters=12), [], T0)["deadLetters"] == 12
    assert status(observed(dead_letters=0), [], T0)["deadLetters"] == 0
    # Unknown (NATS away): left out, so the status keeps the count it had.
    assert "deadLetters" not in status(observed(dead_letters=None), [], T0)
    assert "deadLetters" not in status(observed(), [], T0)


def test_status_without_members_or_lag() -> None:
    o = observed(spec_replicas=0, replicas=0, ready_replicas=0, members={}, leader=None, lag=None)
    st = status(o, [], T0)
    assert st["leader"] == "" and st["skew"] == 0
    assert st["partitionsPerMember"] == {"min": 0, "max": 0}
    assert "lag" not in st  # limits retention: the stream's size is not lag


def test_status_carries_transition_times_over() -> None:
    first = status(observed(), [], T0)
    second = status(observed(lag=5), first["conditions"], T1)
    assert {c["lastTransitionTime"] for c in second["conditions"]} == {T0}


def as_stored(st: dict[str, Any]) -> dict[str, Any]:
    """The status as the API server keeps it after a merge patch: None deletes a field;
    through JSON, as the operator reads it back."""
    kept: dict[str, Any] = json.loads(json.dumps({k: v for k, v in st.items() if v is not None}))
    return kept


def test_an_unchanged_group_needs_no_status_patch() -> None:
    # The status timer of an idle group patches nothing: no request every 5 s per group.
    first = status(observed(), [], T0)
    stored = as_stored(first)
    again = status(observed(), stored["conditions"], T1)
    assert status_changes(stored, again) == {}


def test_a_status_patch_carries_only_what_changed() -> None:
    stored = as_stored(status(observed(), [], T0))
    lagging = status(observed(lag=5), stored["conditions"], T1)
    assert status_changes(stored, lagging) == {"lag": 5}
    down = status(observed(ready_replicas=2), stored["conditions"], T1)
    changed = status_changes(stored, down)
    assert set(changed) == {"readyReplicas", "conditions"}
    assert changed["conditions"] == down["conditions"]  # the whole list: merge patches replace


def test_a_field_to_delete_is_patched_only_while_present() -> None:
    stored = as_stored(status(observed(), [], T0))
    assert stored["skew"] == 1
    rebalancing = status(observed(moving=32), stored["conditions"], T1)
    assert rebalancing["skew"] is None
    assert status_changes(stored, rebalancing)["skew"] is None  # deletes it
    gone = as_stored(rebalancing)
    assert "skew" not in status_changes(gone, status(observed(moving=32), gone["conditions"], T1))


# -- stalled partitions ------------------------------------------------------------------------


def read(members: dict[str, Any]) -> dict[str, MemberStats]:
    """The members' stats as the operator's view reads them: values that are no JSON
    object are left out."""
    result: dict[str, MemberStats] = {}
    for member, raw in members.items():
        try:
            result[member] = MemberStats.parse(json.dumps(raw).encode())
        except ValueRefused:
            pass
    return result


def test_stalled_partitions_are_read_from_the_members_stats() -> None:
    members = {
        "c-1": {"cpu": 0.1, "stalled": [7, 3]},
        "c-0": {"stalled": []},
        "c-2": {"owned": 42},  # a member of an older version reports nothing
    }
    assert stalled_partitions(read(members), 128) == ((3, "c-1"), (7, "c-1"))


@pytest.mark.parametrize(
    "stats",
    [
        {"stalled": "3"},
        {"stalled": 3},
        {"stalled": {"3": True}},
        {"stalled": None},
        {"stalled": ["3", 3.0, None, True, -1, 128, [3], {"p": 3}]},
    ],
    ids=["string", "int", "object", "null", "bad-entries"],
)
def test_garbage_in_a_members_stats_is_ignored(stats: dict[str, Any]) -> None:
    members: dict[str, Any] = {"c-0": stats, "c-1": {"stalled": [5]}, "c-2": "not stats"}
    assert stalled_partitions(read(members), 128) == ((5, "c-1"),)


def test_two_members_reporting_one_partition_are_both_shown() -> None:
    # The old owner still reports it while the new one already does (stats lag behind).
    members = {"c-0": {"stalled": [9]}, "c-1": {"stalled": [9, 9]}}
    assert stalled_partitions(read(members), 16) == ((9, "c-0"), (9, "c-1"))


def test_status_lists_the_stalled_partitions_with_their_members() -> None:
    o = observed(stalled=((3, "c-1"), (7, "c-1"), (12, "c-2")), stall_after=90)
    st = status(o, [], T0)
    assert st["stalledPartitions"] == [
        {"partition": 3, "member": "c-1"},
        {"partition": 7, "member": "c-1"},
        {"partition": 12, "member": "c-2"},
    ]
    progressing = by_type(st["conditions"])["Progressing"]
    assert progressing["message"] == (
        "3 partitions stalled (3, 7 on c-1; 12 on c-2): work waiting and no progress for "
        "90 s or more; the leader moves them elsewhere"
    )
    assert by_type(st["conditions"])["Degraded"]["message"] == progressing["message"]
    # None: the status patch deletes the field once nothing is stalled.
    assert status(observed(), st["conditions"], T1)["stalledPartitions"] is None


def test_a_stall_episode_starts_once_and_ends_once() -> None:
    first = ((3, "c-1"),)
    assert stall_changes(frozenset(), first) == ({"c-1": [3]}, {})
    # Still stalled at the next observations: nothing new.
    assert stall_changes(frozenset(first), first) == ({}, {})
    # Another partition of the same member starts its own episode; 3's goes on.
    both = ((3, "c-1"), (8, "c-1"))
    assert stall_changes(frozenset(first), both) == ({"c-1": [8]}, {})
    # Moved: c-1 stops reporting both; the next owner stalls on 3 again, a new episode.
    assert stall_changes(frozenset(both), ((3, "c-2"),)) == ({"c-2": [3]}, {"c-1": [3, 8]})


def test_an_episode_between_two_observations_starts_and_ends_at_once() -> None:
    # Reported and moved between two runs of the status timer (seen by the StallWatch).
    assert stall_changes(frozenset(), (), {(3, "c-1")}) == ({"c-1": [3]}, {"c-1": [3]})
    # Seen between and still stalled now: it starts, and goes on.
    assert stall_changes(frozenset(), ((3, "c-1"),), {(3, "c-1")}) == ({"c-1": [3]}, {})
    # An episode going on, reported again between (every stats write): nothing new.
    known = frozenset({(3, "c-1")})
    assert stall_changes(known, ((3, "c-1"),), {(3, "c-1")}) == ({}, {})
    assert stall_changes(known, (), {(3, "c-1")}) == ({}, {"c-1": [3]})


def test_stall_event_messages_name_partition_member_and_what_happens() -> None:
    assert stall_started_message("c-1", [3], 60, 3) == (
        "Partition 3 stalled on member c-1: work waiting and no progress for 60 s or more; "
        "the leader moves it to another member"
    )
    assert stall_started_message("c-1", [3, 8], 60, 3).startswith("Partitions 3, 8 stalled on")
    # A lone member: the leader has nowhere to move it (liveness restarts the member).
    assert stall_started_message("c-0", [3, 8], 60, 1).endswith(
        "; no other member can take them: the member restarts if it stays stalled"
    )
    lone = observed(members={"c-0": 128}, stalled=((3, "c-0"),))
    assert by_type(conditions(lone))["Progressing"]["message"].endswith(
        "; no other member can take it: the member restarts if it stays stalled"
    )
    assert stall_ended_message("c-1", [3]) == (
        "Partition 3 no longer reported stalled by member c-1 (progressing again, moved to "
        "another member, or the member left)"
    )


AUTH = ("c-3", "NatsAuthFailed", "NATS refused the credentials")


def test_a_refused_member_degrades_the_group_unless_something_bigger_does() -> None:
    refused = by_type(conditions(observed(refused=(AUTH,), stalled=((5, "c-1"),))))
    told = "member c-3 cannot connect to NATS: NatsAuthFailed: NATS refused the credentials"
    assert (refused["Degraded"]["reason"], refused["Degraded"]["message"]) == (
        "NatsAuthFailed",
        told,
    )  # ahead of the stall: a person must act
    assert refused["Ready"]["reason"] == "GroupReady"  # every replica is ready anyway
    waiting = by_type(conditions(observed(refused=(AUTH,), ready_replicas=2)))
    assert waiting["Ready"]["reason"] == "NatsAuthFailed"
    assert waiting["Ready"]["message"] == f"2 of 3 members ready; {told}"
    bigger = by_type(conditions(observed(refused=(AUTH,), problem=("EtcdUnavailable", "x"))))
    assert bigger["Degraded"]["reason"] == "EtcdUnavailable"


def test_refusal_episodes_are_read_back_from_the_status() -> None:
    written = status(observed(refused=(AUTH, ("c-4", "NatsTLSFailed", "expired"))), [], T0)
    assert refusals_in_status(written) == {("c-3", "NatsAuthFailed"), ("c-4", "NatsTLSFailed")}
    for garbage in (None, {}, {"conditions": "x"}, {"conditions": [1, {"type": "Degraded"}]}):
        assert refusals_in_status(garbage) == frozenset()
    healthy = status(observed(), [], T0)
    assert refusals_in_status(healthy) == frozenset()
    started, ended = refusal_changes({("c-3", "NatsAuthFailed")}, {("c-4", "NatsTLSFailed")})
    assert (started, ended) == ([("c-4", "NatsTLSFailed")], [("c-3", "NatsAuthFailed")])


def test_members_waiting_for_their_handler_are_named_in_ready() -> None:
    """handlerReadyPath: a member whose service does not answer has not joined, on
    purpose; "1 of 3 members ready" alone sent people to the pods' logs."""
    now = 1_800_000_000.0
    why = "GET http://127.0.0.1:8080/healthz: answered 404 Not Found"
    waiting = (("c-1", why, now - 200), ("c-2", why, now - 30))
    found = by_type(conditions(observed(ready_replicas=1, waiting=waiting)))
    ready = found["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "MembersWaitingForHandler")
    assert ready["message"].startswith("1 of 3 members ready; member c-1 waits for its handler")
    assert why in ready["message"] and "member c-2" in ready["message"]
    assert found["Degraded"]["status"] == "False"  # waiting is not broken
    # Pods the scheduler cannot place say more, and so does a NATS refusal.
    placed = by_type(
        conditions(
            observed(ready_replicas=1, waiting=waiting, unschedulable=Unschedulable(1, 3, "0/1", 0))
        )
    )
    assert placed["Ready"]["reason"] == "MembersUnschedulable"
    refused = by_type(conditions(observed(ready_replicas=1, waiting=waiting, refused=(AUTH,))))
    assert refused["Ready"]["reason"] == AUTH[1]
    # All ready: nothing to say (a key left for a moment by a member that just joined).
    assert by_type(conditions(observed(waiting=waiting)))["Ready"]["status"] == "True"


def test_the_waiting_message_lists_the_longest_waits_first_and_counts_the_rest() -> None:
    now = 1_800_000_000.0
    waiting = [(f"c-{i}", "GET x: no answer in time", now - 10 * i) for i in range(5)]
    message = waiting_message(waiting)
    assert message.startswith(
        f"member c-4 waits for its handler since {format_time(now - 40)}: GET x"
    )
    assert "member c-2" in message and "member c-1" not in message
    assert message.endswith("; and 2 more")
    # Since when, not for how long: the same message at every observation.
    assert waiting_message(waiting) == message
    assert waiting_message([("c-0", "m", 0.0)]) == "member c-0 waits for its handler: m"
