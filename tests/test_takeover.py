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


def test_an_orderly_hand_over_waits_for_exactly_what_it_gave_back() -> None:
    """The redelivery queue serves naks in the order they arrived, so what was given back
    may come in any order, and other earlier sequences may come between."""
    assert Gate.for_given_back([], ack_wait=5.0) is None
    gate = Gate.for_given_back([40, 12, 25], ack_wait=5.0)
    assert gate is not None
    gate.hold("a", 40, 2)
    gate.hold("b", 30, 2)  # earlier, not given back in this hand-over: does not count
    gate.hold("c", 25, 2)
    assert not gate.complete()
    gate.hold("d", 12, 3)
    assert gate.complete()
    assert [w.seq for w in gate.release()] == [12, 25, 30, 40]


def test_a_closed_gate_may_pull_what_it_waits_for_but_not_without_bound() -> None:
    """What it still waits for may be pulled beyond the member's budget (a member busy
    with a backlog has none left), while the gate holds at most twice that many."""
    gate = Gate.for_given_back(range(100, 120), ack_wait=5.0)
    assert gate is not None
    assert gate.wanted() == 20
    for seq in range(100, 108):
        gate.hold(seq, seq, 2)
    assert gate.wanted() == 12
    unclean = Gate.for_durable(10, 500, ack_wait=5.0)
    assert unclean is not None
    assert unclean.wanted() == 10
    for seq in range(501, 516):  # newer messages arrive while the earlier run out ack_wait
        unclean.hold(seq, seq, 1)
    assert unclean.wanted() == 5
    for seq in range(516, 521):
        unclean.hold(seq, seq, 1)
    assert unclean.wanted() == 0  # 20 held: no more beyond the budget
    # Its deadline put off (deliveries still counted elsewhere): the earlier ones may be
    # expired and waiting on the redelivery queue, which only a pull tells: it may pull.
    assert unclean.extend(5.0, time.monotonic())
    assert unclean.wanted() == 10
    for seq in range(521, 541):
        unclean.hold(seq, seq, 1)
    assert unclean.wanted() == 0  # 40 held
    assert unclean.extend(5.0, time.monotonic()) and unclean.extend(5.0, time.monotonic())
    assert not unclean.extend(5.0, time.monotonic())  # at most MAX_EXTENSIONS times
