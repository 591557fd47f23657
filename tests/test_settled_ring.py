"""shoal.consumer.settled.SettledRing: exact answers, a fixed size, failing safe."""

from __future__ import annotations

import pytest

from shoal.consumer.settled import DEFAULT_SLOTS, SettledRing


def test_it_knows_exactly_the_sequences_added() -> None:
    ring = SettledRing(16)
    for seq in (1, 2, 5, 17):
        ring.add(seq)
    assert [s for s in range(1, 40) if s in ring] == [2, 5, 17]  # 17 took 1's slot


def test_a_sequence_a_whole_ring_later_overwrites_its_slot_and_the_check_fails_safe() -> None:
    ring = SettledRing(8)
    ring.add(3)
    ring.add(3 + 8)
    # 3 is no longer known: its redelivery would be handled again (at-least-once), never
    # taken for settled when it was not.
    assert 3 not in ring
    assert 11 in ring
    assert 19 not in ring


def test_nothing_is_settled_at_first_and_zero_is_no_sequence() -> None:
    ring = SettledRing(4)
    assert all(seq not in ring for seq in range(1, 100))


def test_the_default_covers_the_measured_lags() -> None:
    # 13 s of a 40,000 msg/s stream: beyond the 5 s default ack_wait.
    assert DEFAULT_SLOTS / 40_000 > 13


@pytest.mark.parametrize("slots", [0, -4, 6, 1000])
def test_slots_must_be_a_power_of_two(slots: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        SettledRing(slots)
