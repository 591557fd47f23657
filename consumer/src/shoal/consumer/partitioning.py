"""Project ids to partitions: the public import path of ``partition_for`` (DESIGN.md).

The names themselves (subjects, streams, keys) live in :mod:`shoal.contracts.names`;
this module keeps the documented import path working.
"""

from shoal.contracts.names import DEFAULT_PARTITIONS, partition_for

__all__ = ["DEFAULT_PARTITIONS", "partition_for"]
