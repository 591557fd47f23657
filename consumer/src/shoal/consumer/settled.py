"""The stream sequences this member settled lately, to recognise a redelivery of a
message it already handled.

JetStream redelivers a message whose ack it has not applied within ack_wait of the
delivery. An ack can arrive and still be applied late: on a work-queue stream in file
storage, each applied ack deletes a message from the middle of the stream, and when a
member starts on a large backlog nats-server applies them seconds behind (bench/ramp.py:
on this machine a cold 200,000-message backlog came back 11-15 % redelivered with the
default 5 s ack_wait; a limits stream, whose acks delete nothing, none). An ack can also
be lost with a connection. Either way the message comes back with a delivery count above
one, and its handler would run a second time for nothing.

So the member keeps the sequence of every message it settles (acked, or dead-lettered
and terminated) in a ring indexed by the sequence: slot ``seq % size`` holds the last
settled sequence that maps to it. A redelivered message whose sequence is in its slot
was settled by this member: it is acked again, not handled again. Nothing is pruned and
nothing grows: a slot is overwritten only by a sequence `size` later in the stream, and
then the check fails safe (the handler runs, as at-least-once allows). With 2**19 slots
(4 MiB) that is 524,288 messages of the stream later: about 13 s at 40,000 msg/s, well
beyond the 5 s default ack_wait and the lags measured. A sequence settled by another
member is not here: a message whose ack was lost there is handled again here.
"""

from __future__ import annotations

from array import array

__all__ = ["SettledRing"]

DEFAULT_SLOTS = 1 << 19


class SettledRing:
    def __init__(self, slots: int = DEFAULT_SLOTS) -> None:
        if slots <= 0 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, not {slots}")
        self._mask = slots - 1
        self._seqs = array("q", bytes(8 * slots))  # 0: no stream sequence is 0

    def add(self, seq: int) -> None:
        self._seqs[seq & self._mask] = seq

    def __contains__(self, seq: int) -> bool:
        return self._seqs[seq & self._mask] == seq
