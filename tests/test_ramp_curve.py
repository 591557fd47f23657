"""harness.rampcurve on curves of known shape: what bench/ramp.py reports from them."""

from __future__ import annotations

import pytest

from harness.rampcurve import Curve, ramp_of


def stamps_at(rate_by_second: list[int], start: float = 100.0) -> list[float]:
    """Evenly spaced stamps: rate_by_second[i] messages in second i."""
    out: list[float] = []
    for second, rate in enumerate(rate_by_second):
        out += [start + second + (k + 0.5) / rate for k in range(rate)]
    return out


def test_a_steady_drain_is_at_its_pace_at_once() -> None:
    stamps = stamps_at([1000, 1000, 1000])
    ramp = ramp_of(Curve.of_stamps(len(stamps), stamps), 0.25)
    assert ramp.pace == pytest.approx(1000, rel=0.01)
    assert ramp.first_second_msgs == pytest.approx(1000, rel=0.01)
    assert ramp.first_second_ratio == pytest.approx(1.0, rel=0.01)
    assert ramp.ramp_seconds == 0.0
    assert ramp.drain_seconds == pytest.approx(3.0, abs=0.01)


def test_a_slow_first_second_shows_in_the_ratio_and_the_ramp() -> None:
    # 100 messages in the first second, then 1,000 a second for four seconds.
    stamps = stamps_at([100, 1000, 1000, 1000, 1000])
    ramp = ramp_of(Curve.of_stamps(len(stamps), stamps), 0.25)
    assert ramp.pace == pytest.approx(1000, rel=0.01)
    assert ramp.first_second_ratio == pytest.approx(0.1, abs=0.01)
    assert ramp.ramp_seconds == pytest.approx(1.0)
    assert ramp.peak == pytest.approx(1000, rel=0.01)
    assert ramp.mean_rate == pytest.approx(4100 / 5, rel=0.01)
    assert ramp.first_second_to_mean == pytest.approx(100 / 820, rel=0.06)


def test_a_drain_that_stops_and_goes_is_judged_by_its_mean_too() -> None:
    # Fast, stalled, fast, stalled...: the median window is a stalled one, which would
    # make any first second look good; the mean rate does not.
    stamps = stamps_at([4000, 10, 10, 4000, 10, 10, 4000])
    ramp = ramp_of(Curve.of_stamps(len(stamps), stamps), 0.25)
    assert ramp.pace == pytest.approx(10, rel=0.25)
    assert ramp.first_second_ratio > 100
    assert ramp.first_second_to_mean == pytest.approx(4000 / (12040 / 7), rel=0.01)


def test_sampled_counts_start_at_the_last_sample_that_saw_none() -> None:
    curve = Curve(300)
    for t, consumed in [(0.0, 0), (0.5, 0), (1.0, 0), (1.5, 100), (2.0, 200), (2.5, 300)]:
        curve.add(t, consumed)
    assert curve.t0 == 1.0  # the first message came after it: never later than the truth
    assert curve.end == 2.5
    assert curve.consumed_at(1.25) == pytest.approx(50)
    assert curve.rates(0.5) == pytest.approx([200, 200, 200])
    ramp = ramp_of(curve, 0.5)
    assert ramp.first_second_msgs == pytest.approx(200)
    assert ramp.ramp_seconds == 0.0


def test_a_curve_that_never_reaches_its_pace_again_has_no_ramp_time() -> None:
    curve = Curve(10)
    for t, consumed in [(0.0, 0), (1.0, 10)]:
        curve.add(t, consumed)
    # Shorter than one window: no full window, no pace.
    ramp = ramp_of(curve, 2.0)
    assert ramp.pace == 0.0
    assert ramp.ramp_seconds is None
    assert ramp.first_second_ratio == 0.0
