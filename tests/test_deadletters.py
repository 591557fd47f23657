"""The pure half of shoal.group.deadletters (and what dead-lettering and handlers do with
message ids): selections, summaries, per-project order, a redriven message's subject and
headers, the progress line, `--since`. No servers: tests/test_dlq.py runs the commands."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from nats.aio.client import _HEADER_KEY_RE as NATS_HEADER_NAME

from shoal.consumer.deadletter import (
    FIT_MARGIN,
    MAX_HEADER_BYTES,
    dead_letter_headers,
    dead_letter_message,
    header_bytes,
)
from shoal.consumer.handlers import message_id_of
from shoal.contracts.names import (
    DEAD_LETTER_CUT_HEADER,
    DEAD_LETTER_REASON_HEADER,
    MEMBER_HEADER,
    MSG_ID_HEADER,
    ORIGINAL_HEADERS_HEADER,
    ORIGINAL_MSG_ID_HEADER,
    ORIGINAL_SUBJECT_HEADER,
    PROJECT_HEADER,
    REDRIVEN_FROM_HEADER,
    SEQ_HEADER,
    parse_since,
    subject_partition,
)
from shoal.group.deadletters import (
    NO_REASON,
    DeadLetter,
    Progress,
    Selection,
    by_project,
    ranked,
    reason_kind,
    redrive_headers,
    redrive_msg_id,
    redrive_subject,
    summarize,
)

PREFIX = "shoal.prod.orders"
DLQ = "shoal_prod_orders_dlq"


def letter(
    seq: int,
    project: str | None = "p-1",
    *,
    reason: str = "permanent error: bad order",
    partition: int = 5,
    time: float = 1000.0,
    data: bytes = b"{}",
    extra: dict[str, str] | None = None,
) -> DeadLetter:
    """A dead letter as a member writes it (dead_letter_headers)."""
    original = {SEQ_HEADER: str(seq), MSG_ID_HEADER: f"id-{seq}", **(extra or {})}
    if project is not None:
        original[PROJECT_HEADER] = project
    headers = dead_letter_headers(original, f"{PREFIX}.{partition}", reason, "c-0")
    return DeadLetter(
        seq=seq,
        subject=f"{PREFIX}.dlq.{partition}",
        time=time,
        headers=headers,
        data=data,
        size=len(data),
    )


# -- what dead-lettering keeps ---------------------------------------------------------------


def test_a_dead_letter_keeps_the_original_id_and_says_why_from_where_and_by_whom() -> None:
    headers = dead_letter_headers(
        {PROJECT_HEADER: "p", MSG_ID_HEADER: "m-1", SEQ_HEADER: "3"}, f"{PREFIX}.2", "x", "c-1"
    )
    assert headers == {
        PROJECT_HEADER: "p",
        SEQ_HEADER: "3",
        ORIGINAL_MSG_ID_HEADER: "m-1",
        DEAD_LETTER_REASON_HEADER: "x",
        ORIGINAL_SUBJECT_HEADER: f"{PREFIX}.2",
        MEMBER_HEADER: "c-1",
    }
    # No Nats-Msg-Id: the dead-letter stream keeps every copy.
    assert MSG_ID_HEADER not in headers
    assert dead_letter_headers(None, "s", "r" * 600, "m")[DEAD_LETTER_REASON_HEADER] == "r" * 500
    assert ORIGINAL_MSG_ID_HEADER not in dead_letter_headers({}, "s", "r", "m")


def test_headers_a_dead_letter_cannot_carry_are_kept_aside_not_fatal() -> None:
    """A client writing its own protocol can publish a header named `X@Y`, which nats-py
    refuses to publish (BadHeaderError); JetStream's publish controls (Nats-Expected-
    Stream, set by `js.publish(stream=...)` and nats.go's ExpectStream) would be checked
    again by the dead-letter stream, which refuses the copy. As they were, the dead
    letter could never be written and the project waited for good (tests/
    test_poison_messages.py shows it on real servers)."""
    original = {
        "X@Y": "1",
        "X Y": "2",
        "Ok-Name": "kept",
        PROJECT_HEADER: "p",
        MSG_ID_HEADER: "id-1",
        "Nats-Expected-Stream": "ORDERS",
        "nats-expected-last-sequence": "7",
        "Nats-TTL": "1h",
    }
    headers = dead_letter_headers(original, f"{PREFIX}.2", "r", "c-0")
    assert json.loads(headers[ORIGINAL_HEADERS_HEADER]) == {
        "X@Y": "1",
        "X Y": "2",
        "Nats-Expected-Stream": "ORDERS",
        "nats-expected-last-sequence": "7",
        "Nats-TTL": "1h",
    }
    assert headers["Ok-Name"] == "kept" and headers[ORIGINAL_MSG_ID_HEADER] == "id-1"
    assert not any(name.lower().startswith("nats-") for name in headers)
    assert all(NATS_HEADER_NAME.fullmatch(name.strip()) for name in headers)
    assert ORIGINAL_HEADERS_HEADER not in dead_letter_headers({"A": "1"}, "s", "r", "m")
    # Dead-lettered again after a redrive: what was set aside before stays.
    again = dead_letter_headers({**headers, "Nats-Rollup": "sub"}, "s", "r2", "c-1")
    assert json.loads(again[ORIGINAL_HEADERS_HEADER]) == {
        **json.loads(headers[ORIGINAL_HEADERS_HEADER]),
        "Nats-Rollup": "sub",
    }


MAX = 1024 * 1024


def test_a_dead_letter_that_fits_is_not_cut() -> None:
    headers, data, cut = dead_letter_message(
        {PROJECT_HEADER: "p"}, b"x" * 1000, "s.1", "r", "m", MAX
    )
    assert (data, cut) == (b"x" * 1000, "") and DEAD_LETTER_CUT_HEADER not in headers


def test_a_dead_letter_past_max_payload_is_cut_to_fit_and_says_so() -> None:
    """Published as it was, the server closes the connection (nats-py checks only the
    data against max_payload): the member restarted and met the message again."""
    original = {PROJECT_HEADER: "p", "Nats-Expected-Stream": "S" * 500, "X-Trace": "t" * 900}
    body = b"x" * (MAX - 300)
    headers, data, cut = dead_letter_message(original, body, "s.1", "permanent: no", "m", MAX)
    assert header_bytes(headers) + len(data) <= MAX - FIT_MARGIN
    assert ORIGINAL_HEADERS_HEADER not in headers and headers["X-Trace"] == "t" * 200
    assert body.startswith(data) and len(data) < len(body)
    assert "Shoal-Original-Headers" in cut and "'X-Trace'" in cut and "the data" in cut
    assert headers[DEAD_LETTER_CUT_HEADER].startswith("cut to fit the server's limits: ")
    assert headers[PROJECT_HEADER] == "p" and headers[DEAD_LETTER_REASON_HEADER] == "permanent: no"


def test_a_dead_letter_past_the_header_limit_is_cut_to_fit() -> None:
    """JetStream refuses more than 64 KiB of headers (err_code 10097)."""
    original = {PROJECT_HEADER: "p", "X-Big": "b" * 65_400}
    headers, data, cut = dead_letter_message(original, b"data", "s.1", "r", "m", MAX)
    assert header_bytes(headers) <= MAX_HEADER_BYTES - FIT_MARGIN
    assert data == b"data" and "'X-Big'" in cut and "the data" not in cut


def test_cutting_a_dead_letter_never_cuts_whose_or_which_message_it_is() -> None:
    """A project id or message id cut to 200 characters made a redrive publish the
    message as another project's (refused as another partition's, or run as one)."""
    long_project, long_id = "p" * 300, "i" * 250
    original = {PROJECT_HEADER: long_project, MSG_ID_HEADER: long_id, SEQ_HEADER: "9" * 250}
    body = b"x" * (MAX - 400)
    headers, data, cut = dead_letter_message(original, body, "s.1", "r", "m", MAX)
    assert headers[PROJECT_HEADER] == long_project
    assert headers[ORIGINAL_MSG_ID_HEADER] == long_id and headers[SEQ_HEADER] == "9" * 250
    assert "the data" in cut and len(data) < len(body)
    assert header_bytes(headers) + len(data) <= MAX - FIT_MARGIN


def test_a_cut_dead_letter_is_not_redriven_and_what_was_set_aside_stays_behind() -> None:
    """Redriven, a cut dead letter would reach the handler as if it were the message; the
    JSON of headers set aside (up to 64 KiB) went out as a header HTTP services refuse."""
    whole3 = letter(3, extra={"Nats-Expected-Stream": "S"})
    note = "cut to fit the server's limits: the data (9 bytes)"
    cut = dataclasses.replace(whole3, headers={**whole3.headers, DEAD_LETTER_CUT_HEADER: note})
    with pytest.raises(ValueError, match="not the whole message"):
        redrive_subject(cut, PREFIX)
    whole = letter(4, extra={"Nats-Expected-Stream": "S"})
    assert ORIGINAL_HEADERS_HEADER in whole.headers
    redriven = redrive_headers(whole, DLQ)
    assert ORIGINAL_HEADERS_HEADER not in redriven and DEAD_LETTER_CUT_HEADER not in redriven
    assert redriven[PROJECT_HEADER] == "p-1"


def test_a_redriven_message_dead_lettered_again_keeps_the_first_id() -> None:
    redriven = redrive_headers(letter(7), DLQ)
    again = dead_letter_headers(redriven, f"{PREFIX}.5", "permanent error: still bad", "c-2")
    assert again[ORIGINAL_MSG_ID_HEADER] == "id-7"
    assert again[REDRIVEN_FROM_HEADER] == "7"  # where it was redriven from, last time
    assert MSG_ID_HEADER not in again


def test_the_handler_sees_the_original_id_of_a_redriven_message() -> None:
    assert message_id_of({MSG_ID_HEADER: "m-1"}, 9) == "m-1"
    assert message_id_of(redrive_headers(letter(7), DLQ), 9) == "id-7"
    assert message_id_of({}, 9) == message_id_of(None, 9) == "seq-9"
    # A dead letter of a message published without an id: the redrive's id, stable.
    plain = DeadLetter(4, f"{PREFIX}.dlq.1", 0.0, {PROJECT_HEADER: "p"})
    assert message_id_of(redrive_headers(plain, DLQ), 9) == f"redrive-{DLQ}-4"


# -- names --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("subject", "prefix", "partition"),
    [
        (f"{PREFIX}.0", PREFIX, 0),
        (f"{PREFIX}.127", PREFIX, 127),
        (f"{PREFIX}.dlq.3", f"{PREFIX}.dlq", 3),
        (f"{PREFIX}.dlq.3", PREFIX, None),
        (f"{PREFIX}.x", PREFIX, None),
        (f"{PREFIX}.-1", PREFIX, None),
        (f"{PREFIX}.", PREFIX, None),
        (f"{PREFIX}.\u0663", PREFIX, None),  # an Arabic-Indic three is a digit, not ASCII
        ("other.1", PREFIX, None),
        ("", PREFIX, None),
    ],
)
def test_subject_partition(subject: str, prefix: str, partition: int | None) -> None:
    assert subject_partition(subject, prefix) == partition


# -- selection ----------------------------------------------------------------------------------


def test_everything_is_selected_by_default() -> None:
    assert Selection().everything
    assert Selection(reason="").everything
    assert Selection().matches(letter(1, None, reason=""))
    assert Selection().describe() == ""
    assert not Selection(project="p").everything
    assert not Selection(since=0.0).everything


def test_project_reason_and_since_select_and_all_must_hold() -> None:
    a = letter(1, "p-1", reason="permanent error: no customer", time=100.0)
    b = letter(2, "p-2", reason="failed 5 times, last: TimeoutError()", time=200.0)
    c = letter(3, None, reason="missing Shoal-Project-Id header", time=300.0)
    everything = [a, b, c]

    def taken(selection: Selection) -> list[int]:
        return [dl.seq for dl in everything if selection.matches(dl)]

    assert taken(Selection(project="p-1")) == [1]
    assert taken(Selection(project="P-1")) == []  # project ids are exact
    assert taken(Selection(project="")) == []  # "" is no project id a message can have
    assert taken(Selection(reason="TIMEOUT")) == [2]  # reasons: a substring, any case
    assert taken(Selection(reason="error")) == [1, 2]
    assert taken(Selection(since=200.0)) == [2, 3]  # at or after
    assert taken(Selection(since=200.1)) == [3]
    assert taken(Selection(project="p-2", reason="permanent")) == []
    assert taken(Selection(project="p-2", reason="failed", since=150.0)) == [2]


def test_a_selection_describes_itself() -> None:
    text = Selection(project="p", reason="x", since=0.0).describe()
    assert text == " of project 'p', whose reason contains 'x', since 1970-01-01T00:00:00Z"


# -- summary ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("permanent error: order 42 has no customer", "permanent error"),
        ("permanent error: POST http://x answered 400 Bad Request: nope", "permanent error"),
        ("failed 5 times, last: RuntimeError('x: y')", "failed 5 times, last: RuntimeError"),
        (
            "failed 2 times, last: asyncio.TimeoutError()",
            "failed 2 times, last: asyncio.TimeoutError",
        ),
        ("failed 5 times, last: ", "failed 5 times, last"),
        (
            "not acknowledged after 3 deliveries (max_deliver 3); JetStream stopped delivering it",
            "not acknowledged after 3 deliveries (max_deliver 3); JetStream stopped delivering it",
        ),
        ("missing Shoal-Project-Id header", "missing Shoal-Project-Id header"),
        ("", NO_REASON),
        ("   : detail", NO_REASON),
        ("x" * 100, "x" * 100),
        ("x" * 101, "x" * 99 + "…"),
    ],
)
def test_reason_kinds(reason: str, kind: str) -> None:
    assert reason_kind(reason) == kind


def test_the_summary_counts_by_reason_and_project_with_the_oldest_and_newest() -> None:
    letters = [
        letter(3, "p-1", time=30.0, data=b"abc"),
        letter(4, "p-2", reason="failed 2 times, last: E()", time=40.0),
        letter(5, "p-1", reason="permanent error: other", time=50.0),
        letter(6, None, reason="missing Shoal-Project-Id header", time=60.0, data=b""),
    ]
    summary = summarize(letters)
    assert summary.count == 4
    assert summary.bytes == 3 + 2 + 2 + 0
    assert summary.by_reason == Counter(
        {"permanent error": 2, "failed 2 times, last: E": 1, "missing Shoal-Project-Id header": 1}
    )
    assert summary.by_project == Counter({"p-1": 2, "p-2": 1, None: 1})
    assert summary.oldest is letters[0] and summary.newest is letters[3]
    assert summary.as_dict() == {
        "count": 4,
        "bytes": 7,
        "by_reason": [
            {"reason": "permanent error", "count": 2},
            {"reason": "failed 2 times, last: E", "count": 1},
            {"reason": "missing Shoal-Project-Id header", "count": 1},
        ],
        "by_project": [
            {"project": "p-1", "count": 2},
            {"project": "p-2", "count": 1},
            {"project": None, "count": 1},
        ],
        "oldest": {"seq": 3, "time": "1970-01-01T00:00:30Z", "project": "p-1"},
        "newest": {"seq": 6, "time": "1970-01-01T00:01:00Z", "project": None},
    }


def test_oldest_and_newest_by_time_then_sequence_in_any_order() -> None:
    letters = [letter(9, time=5.0), letter(2, time=5.0), letter(7, time=1.0), letter(8, time=9.0)]
    summary = summarize(letters)
    assert summary.oldest is not None and summary.oldest.seq == 7
    assert summary.newest is not None and summary.newest.seq == 8
    tie = summarize([letter(9, time=5.0), letter(2, time=5.0)])
    assert tie.oldest is not None and tie.newest is not None
    assert (tie.oldest.seq, tie.newest.seq) == (2, 9)


def test_an_empty_summary() -> None:
    summary = summarize([])
    assert summary.as_dict() == {
        "count": 0,
        "bytes": 0,
        "by_reason": [],
        "by_project": [],
        "oldest": None,
        "newest": None,
    }


def test_ranked_is_most_first_then_by_name_with_no_project_last() -> None:
    counts: Counter[str | None] = Counter({"b": 2, "a": 2, None: 2, "c": 5, "": 1})
    assert ranked(counts) == [("c", 5), ("a", 2), ("b", 2), (None, 2), ("", 1)]


# -- order ---------------------------------------------------------------------------------------


def test_each_projects_dead_letters_in_stream_order_projects_by_their_first() -> None:
    letters = [
        letter(5, "b"),
        letter(2, "a"),
        letter(9, "a"),
        letter(3, None),
        letter(4, "b"),
        letter(1, "c"),
    ]
    grouped = by_project(letters)
    assert list(grouped) == ["c", "a", None, "b"]
    assert {p: [dl.seq for dl in dls] for p, dls in grouped.items()} == {
        "c": [1],
        "a": [2, 9],
        None: [3],
        "b": [4, 5],
    }
    assert by_project([]) == {}


# -- what a redrive publishes ----------------------------------------------------------------------


def test_a_dead_letter_goes_back_to_the_partition_it_came_from() -> None:
    assert redrive_subject(letter(1, partition=5), PREFIX) == f"{PREFIX}.5"


def test_without_a_usable_original_subject_the_dead_letter_subject_says_where() -> None:
    for original in ("", "elsewhere.5", f"{PREFIX}.dlq.5", f"{PREFIX}.x"):
        dl = DeadLetter(1, f"{PREFIX}.dlq.7", 0.0, {ORIGINAL_SUBJECT_HEADER: original})
        assert redrive_subject(dl, PREFIX) == f"{PREFIX}.7", original
    no_header = DeadLetter(1, f"{PREFIX}.dlq.7", 0.0, {})
    assert redrive_subject(no_header, PREFIX) == f"{PREFIX}.7"


def test_a_dead_letter_that_names_no_partition_cannot_be_redriven() -> None:
    dl = DeadLetter(12, "elsewhere.dlq.7", 0.0, {ORIGINAL_SUBJECT_HEADER: "elsewhere.7"})
    with pytest.raises(ValueError, match=r"dead letter 12 on elsewhere\.dlq\.7 names no partition"):
        redrive_subject(dl, PREFIX)


def test_a_redriven_message_has_its_original_headers_the_source_and_a_stable_id() -> None:
    dl = letter(7, "p-9", extra={"X-Trace": "t-1"})
    assert redrive_headers(dl, DLQ) == {
        PROJECT_HEADER: "p-9",
        SEQ_HEADER: "7",
        "X-Trace": "t-1",
        ORIGINAL_MSG_ID_HEADER: "id-7",
        REDRIVEN_FROM_HEADER: "7",
        MSG_ID_HEADER: f"redrive-{DLQ}-7",
    }
    assert redrive_headers(dl, DLQ) == redrive_headers(dl, DLQ)  # every run alike
    assert redrive_msg_id(DLQ, 7) == f"redrive-{DLQ}-7"
    assert dl.headers[DEAD_LETTER_REASON_HEADER]  # the dead letter itself is unchanged


def test_a_headers_only_size_header_is_not_carried_on() -> None:
    dl = DeadLetter(1, f"{PREFIX}.dlq.1", 0.0, {PROJECT_HEADER: "p", "Nats-Msg-Size": "3"})
    assert "Nats-Msg-Size" not in redrive_headers(dl, DLQ)


def test_partition_and_json_of_a_dead_letter() -> None:
    dl = letter(3, "p", partition=4, time=60.0, data=b"caf\xc3\xa9")
    assert dl.partition(PREFIX) == 4
    assert dl.partition("other") is None
    out = dl.as_dict(PREFIX)
    assert out["data"] == "café" and "data_base64" not in out
    assert (out["seq"], out["time"], out["partition"], out["project"]) == (
        3,
        "1970-01-01T00:01:00Z",
        4,
        "p",
    )
    assert out["reason"] == "permanent error: bad order"
    assert out["headers"][ORIGINAL_MSG_ID_HEADER] == "id-3"
    binary = letter(3, data=b"\xff\x00").as_dict(PREFIX)
    assert binary["data_base64"] == "/wA=" and "data" not in binary


# -- progress -------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_written_at_most_every_half_second_and_at_the_end() -> None:
    clock = Clock()
    lines: list[tuple[str, bool]] = []
    progress = Progress("moved", 1000, lambda line, final: lines.append((line, final)), clock=clock)
    for done in range(1, 9):  # 0.25 s apart: 2 s in all
        clock.now += 0.25
        progress.update(done * 100)
    assert lines == [
        ("moved 200 of 1,000 (20%) in 0.5 s, 400/s", False),
        ("moved 400 of 1,000 (40%) in 1.0 s, 400/s", False),
        ("moved 600 of 1,000 (60%) in 1.5 s, 400/s", False),
        ("moved 800 of 1,000 (80%) in 2.0 s, 400/s", False),
    ]
    progress.update(800, final=True)  # the end is always written, however soon
    assert lines[-1] == ("moved 800 of 1,000 (80%) in 2.0 s, 400/s", True)


def test_a_quick_run_writes_no_progress_until_its_end() -> None:
    clock = Clock()
    lines: list[str] = []
    progress = Progress("moved", 3, lambda line, final: lines.append(line), clock=clock)
    progress.update(1)
    progress.update(2)
    assert lines == []
    progress.update(3, final=True)
    assert lines == ["moved 3 of 3 (100%) in 0.0 s"]
    assert Progress("moved", 0, lambda *_: None).line(0, 0.0) == "moved 0 of 0 in 0.0 s"


# -- --since --------------------------------------------------------------------------------------


def test_since_takes_times_dates_and_durations() -> None:
    now = datetime(2026, 11, 21, 12, tzinfo=UTC)
    assert parse_since("90s", now) == now - timedelta(seconds=90)
    assert parse_since("1.5h", now) == now - timedelta(minutes=90)
    assert parse_since(" 2w ", now) == now - timedelta(weeks=2)
    assert parse_since("2026-11-20", now) == datetime(2026, 11, 20, tzinfo=UTC)
    assert parse_since("2026-11-20T10:00:00z", now) == datetime(2026, 11, 20, 10, tzinfo=UTC)
    assert parse_since("2026-11-20T10:00:00+02:00", now) == datetime(2026, 11, 20, 8, tzinfo=UTC)


@pytest.mark.parametrize("text", ["yesterday", "10", "5y", "-1h", "", "2026-13-01"])
def test_since_refuses_anything_else_saying_what_it_takes(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected an RFC 3339 time .* or a duration"):
        parse_since(text)
