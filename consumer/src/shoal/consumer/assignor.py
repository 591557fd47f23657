"""The assignor's public import path, ``shoal.consumer.assignor.assign`` (DESIGN.md).

The assignor itself is :mod:`shoal.assignor`, beside the contracts, so that analytics
uses it without importing the consumer; this module keeps the documented path working.
"""

from shoal.assignor import (
    STRATEGIES,
    assign,
    default_max_moves,
    member_loads,
    min_moves,
    moved,
    owner_counts,
    quotas,
    relieve_stalls,
    skew,
)

__all__ = [
    "STRATEGIES",
    "assign",
    "default_max_moves",
    "member_loads",
    "min_moves",
    "moved",
    "owner_counts",
    "quotas",
    "relieve_stalls",
    "skew",
]
