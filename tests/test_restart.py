"""restart.restart_sequence: where a recreated durable starts."""

from __future__ import annotations

from shoal.consumer.restart import restart_sequence


def test_the_ack_floor_decides_when_it_was_read() -> None:
    # Everything at or below the floor was acked; held and delivered ones are above it.
    assert restart_sequence(41, [57, 44], 60) == 42
    assert restart_sequence(0, [], 0) == 1  # read, nothing acked yet: the first message


def test_without_a_floor_the_first_held_message() -> None:
    assert restart_sequence(None, [57, 44, 50], 60) == 44


def test_without_a_floor_or_held_messages_the_one_after_the_last_delivered() -> None:
    assert restart_sequence(None, [], 60) == 61


def test_knowing_nothing_gives_none() -> None:
    assert restart_sequence(None, [], 0) is None
