"""One log line per hand-over (shoal.consumer.handover_log), not one per partition."""

from __future__ import annotations

import logging

import pytest

from shoal.consumer.handover_log import HandOverLog, ranges


@pytest.mark.parametrize(
    ("partitions", "text"),
    [([], ""), ([5], "5"), ([0, 1, 2, 3, 7, 9, 10], "0-3,7,9-10"), ([3, 1, 2], "1-3")],
)
def test_ranges(partitions: list[int], text: str) -> None:
    assert ranges(partitions) == text


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]


def test_a_release_of_many_partitions_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    log = HandOverLog()
    log.new_pass()
    log.releasing({p: "c-3" for p in range(32)})
    for p in range(31):
        log.released(p)
    assert lines(caplog) == []  # not until the last one is done
    log.released(31)
    (line,) = lines(caplog)
    assert line.startswith("Released 32 partitions (0-31) to c-3 in ")


def test_takes_of_one_pass_are_one_batch_and_abandoned_ones_are_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    log = HandOverLog()
    log.new_pass()
    for p in (96, 97, 98, 99):
        log.taking([p])
    log.new_pass()
    log.taking([97])  # already under way: stays in its batch
    log.took(96)
    log.abandoned(97)  # the target moved on
    log.took(98)
    log.took(99)
    assert lines(caplog) == [lines(caplog)[0]]
    assert lines(caplog)[0].startswith("Took 3 partitions (96,98-99) in ")


def test_several_new_owners_are_named_with_counts(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    log = HandOverLog()
    log.new_pass()
    log.releasing({0: "c-1", 1: "c-2", 2: "c-2"})
    for p in range(3):
        log.released(p)
    assert lines(caplog)[0].startswith("Released 3 partitions (0-2) to c-1 (1), c-2 (2) in ")


def test_a_fenced_batch_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    log = HandOverLog()
    log.new_pass()
    log.releasing({0: "c-1", 1: "c-1"})
    log.abandoned(0)
    log.abandoned(1)
    assert lines(caplog) == []
