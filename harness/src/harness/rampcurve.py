"""A drain's consumption curve, and how fast it reached its pace (bench/ramp.py).

Pure arithmetic over (time, messages consumed so far) samples, apart from the I/O that
takes them, so that tests/test_ramp_curve.py can check it on curves of known shape."""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field

__all__ = ["Curve", "Ramp", "ramp_of"]


@dataclass
class Curve:
    """How many of `total` messages were consumed by when: (monotonic time, count)
    samples, in time order."""

    total: int
    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def add(self, t: float, count: int) -> None:
        self.times.append(t)
        self.counts.append(count)

    @classmethod
    def of_stamps(cls, total: int, stamps: list[float]) -> Curve:
        """One sample per handled message (harness.handlers:stamped)."""
        curve = cls(total)
        if stamps:
            curve.add(stamps[0] - 1e-6, 0)
        for i, t in enumerate(stamps):
            curve.add(t, i + 1)
        return curve

    def consumed_at(self, t: float) -> float:
        """Messages consumed by time t (linear between samples)."""
        i = bisect.bisect_right(self.times, t)
        if i == 0:
            return float(self.counts[0])
        if i == len(self.times):
            return float(self.counts[-1])
        t1, t2 = self.times[i - 1], self.times[i]
        c1, c2 = self.counts[i - 1], self.counts[i]
        return c1 + (c2 - c1) * ((t - t1) / (t2 - t1) if t2 > t1 else 1.0)

    @property
    def t0(self) -> float:
        """The last sample that saw nothing consumed (the first message came after it)."""
        return self.times[bisect.bisect_right(self.counts, 0) - 1]

    @property
    def end(self) -> float:
        return self.times[bisect.bisect_left(self.counts, self.total)]

    def rates(self, bucket: float) -> list[float]:
        """Rates over consecutive `bucket`-second windows from t0 (full windows only)."""
        out, t = [], self.t0
        while t + bucket <= self.end:
            out.append((self.consumed_at(t + bucket) - self.consumed_at(t)) / bucket)
            t += bucket
        return out


@dataclass
class Ramp:
    first_second_msgs: float
    pace: float  # median msg/s
    ramp_seconds: float | None
    drain_seconds: float
    peak: float  # the fastest window's msg/s
    total: int

    @property
    def first_second_ratio(self) -> float:
        return self.first_second_msgs / self.pace if self.pace else 0.0

    @property
    def mean_rate(self) -> float:
        return self.total / self.drain_seconds if self.drain_seconds else 0.0

    @property
    def first_second_to_mean(self) -> float:
        """The first second against the whole drain's mean rate: a second baseline, since
        a drain that stops and goes has a median pace below what it mostly ran at."""
        return self.first_second_msgs / self.mean_rate if self.mean_rate else 0.0


def ramp_of(curve: Curve, bucket: float) -> Ramp:
    """First second after the first message, median pace over `bucket`-second windows
    (issue 29's definitions), and when a window first reached 90 % of that pace."""
    t0 = curve.t0
    rates = curve.rates(bucket)
    pace = statistics.median(rates) if rates else 0.0
    ramp = next((i * bucket for i, r in enumerate(rates) if r >= 0.9 * pace), None)
    first = curve.consumed_at(t0 + 1.0) - curve.consumed_at(t0)
    return Ramp(first, pace, ramp, curve.end - t0, max(rates, default=0.0), curve.total)
