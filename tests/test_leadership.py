"""The operator's leader election decisions (shoal.operator.leadership), without a cluster.

The Lease I/O runs against a real API server in e2e/test_operator_ha.py.
"""

from __future__ import annotations

import datetime
import itertools

import pytest

from shoal.operator.leadership import (
    LEASE_DURATION,
    RENEW_DEADLINE,
    RENEW_INTERVAL,
    RETRY_INTERVAL,
    LeaseRecord,
    Observation,
    may_take,
    micro_time,
    must_step_down,
    observe,
    record_of,
)


def held(holder: str = "op-a", version: str = "1", duration: float = 10) -> LeaseRecord:
    return LeaseRecord(holder=holder, duration=duration, version=version, transitions=0)


def test_a_free_or_own_lease_may_be_taken_at_once() -> None:
    for holder in ("", "op-b"):
        assert may_take(Observation(held(holder), seen_at=100.0), "op-b", now=100.0)


def test_anothers_lease_only_once_it_has_not_changed_for_its_duration() -> None:
    seen = Observation(held("op-a"), seen_at=100.0)
    assert not may_take(seen, "op-b", now=100.0)
    assert not may_take(seen, "op-b", now=109.99)
    assert may_take(seen, "op-b", now=110.0)


def test_a_renewal_restarts_the_count_and_the_same_version_does_not() -> None:
    first = observe(None, held(version="1"), now=100.0)
    again = observe(first, held(version="1"), now=105.0)
    assert again.seen_at == 100.0  # unchanged: counting since it was first seen
    renewed = observe(again, held(version="2"), now=108.0)
    assert renewed.seen_at == 108.0
    assert not may_take(renewed, "op-b", now=112.0)  # would have been taken without it
    assert may_take(renewed, "op-b", now=118.0)


def test_the_holder_steps_down_after_the_renew_deadline() -> None:
    assert not must_step_down(last_renewed=100.0, now=100.0 + RENEW_DEADLINE - 0.01)
    assert must_step_down(last_renewed=100.0, now=100.0 + RENEW_DEADLINE)


@pytest.mark.parametrize(
    ("sent", "seen_later"), list(itertools.product([0.0, 3.3, 50.0], [0.0, 0.2, 1.0, 5.0]))
)
def test_never_two_active(sent: float, seen_later: float) -> None:
    """The holder's last successful renewal was sent at `sent`; a standby saw its result
    `seen_later` after (never before: the write happened after it was sent). Whenever the
    standby may take the Lease, the holder has already stepped down."""
    seen = observe(None, held(version="7", duration=LEASE_DURATION), now=sent + seen_later)
    for tick in range(0, 300):
        now = sent + tick * 0.1
        if may_take(seen, "op-b", now):
            assert must_step_down(sent, now), now


def test_the_timings_allow_a_takeover_within_15_s() -> None:
    # The killed holder's last write precedes the kill; a standby sees it within one
    # poll and takes the Lease at its first poll after the duration: at most the duration
    # plus two polls after the kill, leaving time for kopf to start and act.
    assert RENEW_DEADLINE < LEASE_DURATION
    assert RENEW_INTERVAL < RENEW_DEADLINE / 2  # a failed renewal gets retried in time
    assert LEASE_DURATION + 2 * RETRY_INTERVAL <= 12


def test_record_of_reads_the_api_json() -> None:
    lease = {
        "metadata": {"name": "shoal-operator", "resourceVersion": "42"},
        "spec": {"holderIdentity": "op-a", "leaseDurationSeconds": 10, "leaseTransitions": 3},
    }
    assert record_of(lease) == LeaseRecord("op-a", 10.0, "42", 3)
    released = {"metadata": {"resourceVersion": "43"}, "spec": {}}
    assert record_of(released).holder == ""


def test_micro_time_always_has_six_fractional_digits() -> None:
    # Python's isoformat drops the fraction at 0 microseconds; the API server's MicroTime
    # wants it.
    assert micro_time(1_800_000_000.0) == "2027-01-15T08:00:00.000000Z"
    parsed = datetime.datetime.strptime(micro_time(1.5), "%Y-%m-%dT%H:%M:%S.%fZ")
    assert parsed.microsecond == 500000
