"""The report's per-generation metrics, as pure functions of one generation and the one before.

Both report engines follow these definitions: the pandas oracle calls them directly, the
Spark job expresses the same arithmetic as DataFrame operations (see ``spark_job``), and the
tests check that the two agree and that :func:`min_moves` agrees with brute force. The
assignor's own definitions are used, not copies: :func:`min_moves` is
:func:`shoal.assignor.min_moves` over the event's partitions, and
:func:`owner_counts` is the assignor's.

Definitions (``previous`` is the previous generation's assignment in the log, ``None`` for a
group's first generation):

* *partitions* ``P``: the partitions of the current assignment.
* *move*: a partition of the current assignment that had an owner in ``previous`` and has a
  different one now. A partition without an owner before is an initial placement, not a move.
* *min_moves*: the fewest moves any balanced assignment of the current members needs from
  ``previous``: partitions whose previous owner is not a current member, plus each current
  member's excess over its quota, quotas being ``P // n`` or ``P // n + 1`` with the ``P % n``
  larger quotas going to the members that held the most (ties: smaller id first). 0 for a
  group's first generation and for a generation without members.
* *churn ratio*: moves / min_moves; 1.0 when both are 0; ``None`` (unbounded) when only
  the minimum is 0.
* owner counts: every member (0 if it owns nothing) and every owner that is not a member.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shoal import assignor
from shoal.assignor import owner_counts

__all__ = [
    "CountStats",
    "churn_ratio",
    "count_stats",
    "member_loads",
    "min_moves",
    "moves",
    "owner_counts",
    "percentile",
]


def min_moves(
    partitions: Iterable[int], members: Iterable[str], previous: Mapping[int, str] | None
) -> int:
    """The fewest moves a balanced assignment of ``members`` over ``partitions`` needs.

    The assignor's definition (:func:`shoal.assignor.min_moves`), over the
    partitions the event lists: they are numbered 0..P-1 for the assignor in their order.
    A group's first generation, no members or no partitions need 0.
    """
    keys = list(partitions)
    current = list(members)
    if previous is None or not current or not keys:
        return 0
    index = {p: i for i, p in enumerate(keys)}
    renumbered = {index[p]: owner for p, owner in previous.items() if p in index}
    return assignor.min_moves(len(keys), current, renumbered)


def moves(previous: Mapping[int, str] | None, current: Mapping[int, str]) -> int:
    """Partitions of ``current`` whose owner in ``previous`` exists and differs."""
    if previous is None:
        return 0
    return sum(1 for p, owner in current.items() if previous.get(p, owner) != owner)


def member_loads(
    assignment: Mapping[int, str], members: Iterable[str], loads: Mapping[int, float]
) -> dict[str, float]:
    """Summed partition load per member and non-member owner (missing loads count as 0)."""
    totals = dict.fromkeys(members, 0.0)
    for p, owner in assignment.items():
        totals[owner] = totals.get(owner, 0.0) + float(loads.get(p, 0.0))
    return totals


@dataclass(frozen=True)
class CountStats:
    """Min, max, mean, population standard deviation and max/mean of owner counts."""

    min: float | None
    max: float | None
    mean: float | None
    stddev: float | None
    max_over_mean: float | None
    skew: float

    @classmethod
    def of(cls, values: Sequence[float]) -> CountStats:
        if not values:
            return cls(None, None, None, None, None, 0)
        lo, hi = min(values), max(values)
        mean = statistics.fmean(values)
        std = statistics.pstdev(values)
        return cls(lo, hi, mean, std, hi / mean if mean > 0 else None, hi - lo)


def count_stats(counts: Mapping[str, float]) -> CountStats:
    return CountStats.of(list(counts.values()))


def churn_ratio(moved: int, minimum: int) -> float | None:
    """moves / min_moves; 1.0 when both are 0; None when only the minimum is 0."""
    if minimum == 0:
        return 1.0 if moved == 0 else None
    return moved / minimum


def percentile(values: Sequence[float], q: float) -> float | None:
    """Exact percentile with linear interpolation between closest ranks (q in 0..1), as
    numpy's default and Spark's ``percentile``; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
