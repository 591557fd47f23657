"""Where a partition's durable starts again when it was deleted under a member.

On a work-queue stream an acked message is gone, so a new durable that delivers all the
stream holds starts exactly where the old one was. On a `limits` (or `interest`) stream
the acked messages stay: a durable recreated with "deliver all" would hand the member
the partition's whole history again, every message a duplicate. The member knows where
the old durable was, from two sources:

* the durable's ack floor, as last read from its info (the lag loop, the doze check):
  every message of the partition at or below it was acked, so starting right after it
  loses nothing; messages acked since that read come again, and the member recognises
  those it settled itself (settled.py) and acks them without running the handler;
* failing that, what it was delivered: the first message it still holds, or else the one
  after the last it was delivered.

Knowing neither (nothing read, nothing delivered), it starts from the stream's start, as
a new group's durables do, and says so.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["restart_sequence"]


def restart_sequence(
    ack_floor: int | None, unsettled: Iterable[int], delivered_high: int
) -> int | None:
    """The stream sequence a recreated durable starts at, or None if nothing is known.

    `ack_floor`: the old durable's ack floor as last read (None: never read);
    `unsettled`: the stream sequences of what the member holds and has not settled;
    `delivered_high`: the highest stream sequence it was delivered (0: none).
    """
    if ack_floor is not None:
        return ack_floor + 1
    lowest = min(unsettled, default=None)
    if lowest is not None:
        return lowest
    if delivered_high > 0:
        return delivered_high + 1
    return None
