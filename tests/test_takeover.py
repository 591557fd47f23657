"""The takeover gate's decisions (takeover.py), as pure logic.

The gate of a partition taken over without an orderly hand-over holds what arrives until
the earlier owner's deliveries are back; tests/test_takeover_order.py and the fault
suite prove it on real servers. Here: when it may open, and when it must not.
"""

from __future__ import annotations

import time

from shoal.consumer.takeover import MARGIN_SECONDS, Gate


def test_no_gate_when_nothing_is_outstanding() -> None:
    assert Gate.for_durable(0, 120, ack_wait=5.0) is None


def test_the_gate_waits_at_most_ack_wait_and_the_margin() -> None:
    gate = Gate.for_durable(3, 120, ack_wait=5.0)
    assert gate is not None
    assert not gate.expired(gate.started + 5.0)
    assert gate.expired(gate.started + 5.0 + MARGIN_SECONDS)


def test_it_is_complete_once_as_many_earlier_sequences_came_back_as_were_outstanding() -> None:
    gate = Gate.for_durable(2, 120, ack_wait=5.0)
    assert gate is not None
    gate.hold("new", 121, 1)  # newer than the durable's last delivery: not one of them
    gate.hold("old", 100, 2)
    assert not gate.complete()
    gate.hold("old again", 100, 3)  # the same sequence twice counts once
    assert not gate.complete()
    gate.hold("other", 110, 2)
    assert gate.complete()
    assert [w.seq for w in gate.release()] == [100, 100, 110, 121]


def test_nobody_else_holds_compares_the_count_with_what_we_held_when_we_asked() -> None:
    """One earlier delivery (X) is still with the dead owner; we hold two new messages
    and ask the durable, which counts three unsettled. A third new message arrives while
    the answer travels. The answer says 3; we hold 3 now, but one of the three it counted
    is X: the gate must stay shut (before the fix it opened, and X came back after a newer
    message of its project had run)."""
    gate = Gate.for_durable(1, 100, ack_wait=5.0)
    assert gate is not None
    gate.hold("a", 101, 1)
    gate.hold("b", 102, 1)
    held_when_asked = len(gate.held)
    gate.hold("c", 103, 1)  # delivered after the server counted
    assert not gate.nobody_else_holds(3, held_when_asked)
    # X acked by its owner (or back with us): the next answer counts only ours.
    assert gate.nobody_else_holds(3, len(gate.held))
    assert gate.nobody_else_holds(2, held_when_asked)


def test_keeping_held_messages_alive_is_due_once_per_period() -> None:
    gate = Gate.for_durable(1, 10, ack_wait=4.0)
    assert gate is not None
    gate.hold("a", 11, 1)
    now = time.monotonic()
    assert gate.due_keeping(now, 1.0) == []
    due = gate.due_keeping(now + 1.0, 1.0)
    assert [w.seq for w in due] == [11]
    assert gate.due_keeping(now + 1.5, 1.0) == []
