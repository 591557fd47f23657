"""Per-project order when a partition is taken over: its earlier deliveries come first.

A partition's durable may have messages outstanding when a runner starts on it:
delivered to an earlier owner (another member, or this one before a fence) and not
settled. An orderly hand-over gives them back with naks, so JetStream redelivers them
at once, and before anything newer (a pull is served from the redelivery queue first).
After a crash, a fence or a lost lease nobody gave them back: they come back only when
their ack_wait runs out, and a runner that pulled at once would meanwhile run newer
messages of the same projects first (the inversions issue #32 measured: 67 after an etcd
freeze and a kill, 19 after a member cut from etcd).

So, unless the group chose `orderAfterFailure: Fast`, a runner that finds outstanding
messages (the durable's num_ack_pending) holds everything it receives in a `Gate` until
they have all come back, then lets the held messages into the dispatcher in stream
order: each project's earlier message first. The gate opens when

- as many messages from at or below the durable's last delivered sequence (as read at
  the start) have arrived as were outstanding, or
- the durable says that nobody but us holds any (num_ack_pending minus what we hold: an
  earlier owner acked its last ones, or a nak came back), or
- ack_wait plus a margin has passed and the durable does not say that someone else
  still holds deliveries: anything outstanding has been redelivered by then (the earlier
  owner stopped renewing its deliveries when it was fenced or died, before its claim
  could be taken). Not always: keep-alives (in-progress acks) the earlier owner wrote into
  a network gone silent reach the server when it heals, and renew those deliveries by
  ack_wait from then. So at its deadline a gate reads the durable once more and, while
  deliveries are still held elsewhere, waits another ack_wait, at most MAX_EXTENSIONS
  times (a durable that says something odd must not hold a partition for good).

An orderly hand-over costs next to nothing: the giver wrote its hand-over record in the
same etcd transaction that deleted its claim, and the next owner's view, having seen both
at one revision (GroupView.handed_over_cleanly), knows exactly what was given back: the
record's sequences. Those are on the durable's redelivery queue, which a pull serves
before anything new, but in the order the naks arrived, not in stream order: when an
owner gives back its messages while some given back to it are still queued (it had no
room to pull them all), its lower sequences queue behind those, and the next owner would
run a project's later message first (the fault suite's maxDeliver-2 scenario: 19-35
inversions, three moves of a held backlog). So the next owner holds what arrives until
every recorded sequence is back (`Gate.for_given_back`, whatever orderAfterFailure says:
planned moves always kept order), which its first pulls bring. Anything else (a crash, a
fence, a lost lease, a view that started later) costs one consumer-info request, and the
wait if something is outstanding.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# What the gate waits beyond ack_wait: the server checks for expired deliveries on a
# timer of its own, and the runner's pulls have to come back.
MARGIN_SECONDS = 1.0
# How many more ack_waits a gate waits when, at its deadline, the durable says deliveries
# are still held elsewhere (renewed late: see the module docstring).
MAX_EXTENSIONS = 3


@dataclass(slots=True)
class Waiting:
    """One message held by the gate."""

    msg: Any
    seq: int
    delivered: int
    kept: float  # when it arrived or was last kept alive (monotonic)


@dataclass
class Gate:
    """The messages a taken-over partition received while earlier ones were outstanding."""

    outstanding: int  # num_ack_pending when the runner started
    upto: int  # the durable's last delivered stream sequence then
    deadline: float  # monotonic
    started: float = field(default_factory=time.monotonic)
    held: list[Waiting] = field(default_factory=list)
    # The sequences it waits for, when known (an orderly hand-over's record); otherwise
    # every sequence up to `upto` counts.
    expected: frozenset[int] | None = None
    _earlier: set[int] = field(default_factory=set)
    extensions: int = 0  # how many times its deadline was put off (extend)

    @classmethod
    def for_durable(cls, num_ack_pending: int, delivered_seq: int, ack_wait: float) -> Gate | None:
        """A gate if the durable has deliveries outstanding, else None (nothing to wait
        for: the runner pulls as usual)."""
        if num_ack_pending <= 0:
            return None
        now = time.monotonic()
        return cls(num_ack_pending, delivered_seq, now + ack_wait + MARGIN_SECONDS, now)

    @classmethod
    def for_given_back(cls, seqs: Iterable[int], ack_wait: float) -> Gate | None:
        """A gate for an orderly hand-over that gave `seqs` back (None if none): it
        opens once each has arrived (or, as any gate, once nobody else holds one)."""
        expected = frozenset(seqs)
        if not expected:
            return None
        now = time.monotonic()
        return cls(
            len(expected), max(expected), now + ack_wait + MARGIN_SECONDS, now, expected=expected
        )

    def hold(self, msg: Any, seq: int, delivered: int) -> None:
        self.held.append(Waiting(msg, seq, delivered, time.monotonic()))
        expected = self.expected
        if (seq in expected) if expected is not None else seq <= self.upto:
            self._earlier.add(seq)

    @property
    def came_back(self) -> int:
        """How many of the outstanding messages have arrived (distinct sequences)."""
        return len(self._earlier)

    def wanted(self) -> int:
        """How many messages its partition may pull beyond the member's budget: those not
        back yet, as long as it holds at most twice as many as it waits for (newer ones
        arrive first while the earlier owner's run out their ack_wait). A member busy with
        a backlog has its budget full: bound by it, the gate could not pull what it waits
        for, and opened at its deadline without it (the maxDeliver-2 scenario: 8 of 20
        given-back messages in after 3 s, the rest later, behind newer ones). Each time
        its deadline was put off, twice as many more: an expired delivery waiting on the
        redelivery queue counts in the durable's num_ack_pending as one held elsewhere
        does, and a gate that may not pull could not tell them apart by waiting."""
        missing = self.outstanding - self.came_back
        room = (2 + 2 * self.extensions) * self.outstanding - len(self.held)
        return max(0, min(missing, room))

    def missing(self) -> frozenset[int] | None:
        """The expected sequences not arrived yet; None for a gate that counts (one read
        from the durable, which knows no sequences)."""
        if self.expected is None:
            return None
        return self.expected - self._earlier

    def extend(self, ack_wait: float, now: float) -> bool:
        """Put the deadline off by ack_wait (deliveries are still held elsewhere at it);
        False once it was put off MAX_EXTENSIONS times."""
        if self.extensions >= MAX_EXTENSIONS:
            return False
        self.extensions += 1
        self.deadline = now + ack_wait + MARGIN_SECONDS
        return True

    def complete(self) -> bool:
        return self.came_back >= self.outstanding

    def nobody_else_holds(self, num_ack_pending: int, held_when_asked: int) -> bool:
        """From a fresh read of the durable, asked for when we held `held_when_asked`
        messages: every delivery still unsettled then is one we hold here (the earlier
        owner settled the rest, or they are back with us).

        Compared with what we held when we asked, not now: a message delivered to us
        after the server counted (while its answer travelled) is not in its count, and
        counting it here would stand for one still elsewhere, and open the gate before
        that one is back (one inversion in two runs of three of the fault suite's
        etcd-frozen scenario). One delivered before the count but read after the answer
        only makes us ask again."""
        return num_ack_pending <= held_when_asked

    def expired(self, now: float) -> bool:
        return now >= self.deadline

    def due_keeping(self, now: float, period: float) -> list[Waiting]:
        """Held messages whose in-progress ack is due (they wait like any held message,
        and their ack_wait runs meanwhile)."""
        due = [w for w in self.held if now - w.kept >= period]
        for w in due:
            w.kept = now
        return due

    def release(self) -> list[Waiting]:
        """Everything held, in stream order, and the gate emptied."""
        held, self.held = self.held, []
        return sorted(held, key=lambda w: w.seq)


def describe(gate: Gate, how: str, now: float) -> str:
    return (
        f"{gate.came_back} of {gate.outstanding} earlier deliveries back after "
        f"{now - gate.started:.2f} s ({how}); {len(gate.held)} held message(s) released "
        "in stream order"
    )
