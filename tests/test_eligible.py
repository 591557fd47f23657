"""Which members the leader gives partitions to (Election._eligible): not one cut from
NATS, nor one whose HTTP handler accepts no connection, each only while some member has
been free of that cut steadily (pure: a fake view; time passes by ageing the clocks)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

import shoal.consumer.election as election
from shoal.contracts.values import MemberStats

NATS_CUT = MemberStats(nats_ok=False)
HANDLER_AWAY = MemberStats(handler_ok=False)
ABLE = MemberStats(handler_ok=True)
PYTHON = MemberStats()  # a member with a Python handler writes no handler_ok


def leader(stats: dict[str, MemberStats]) -> SimpleNamespace:
    fake = SimpleNamespace(
        view=SimpleNamespace(members=lambda: stats),
        config=SimpleNamespace(keepalive_interval=1.0),
        _nats_since={},
        _able_since={},
    )
    fake._steadily_free = functools.partial(election.Election._steadily_free, fake)  # type: ignore[arg-type]
    return fake


def eligible(fake: SimpleNamespace, *, after: float = 0.0) -> set[str]:
    """_eligible once, then again `after` seconds later (the clocks aged by that much)."""
    election.Election._eligible(fake)  # type: ignore[arg-type]
    for clocks in (fake._nats_since, fake._able_since):
        for member, since in clocks.items():
            if since is not None:
                clocks[member] = since - after
    return set(election.Election._eligible(fake))  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def every_key_has_a_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(election, "leaseless_member", lambda view, member: False)


@pytest.mark.parametrize(
    ("stats", "wanted"),
    [
        # Cuts apply once another member has been free of them steadily.
        ({"a": NATS_CUT, "b": ABLE}, {"b"}),
        ({"a": HANDLER_AWAY, "b": ABLE}, {"b"}),
        ({"a": HANDLER_AWAY, "b": PYTHON}, {"b"}),
        # Nobody free of it: everyone stays (moving would only add churn).
        ({"a": NATS_CUT, "b": NATS_CUT}, {"a", "b"}),
        ({"a": HANDLER_AWAY, "b": HANDLER_AWAY}, {"a", "b"}),
        ({"a": HANDLER_AWAY}, {"a"}),
        # A shared handler outage does not let a member cut from NATS back in.
        ({"a": NATS_CUT, "b": HANDLER_AWAY, "c": HANDLER_AWAY}, {"b", "c"}),
        # Able means NATS and the handler both: one with NATS only does not cut the others.
        ({"a": HANDLER_AWAY, "b": MemberStats(nats_ok=False, handler_ok=True)}, {"a"}),
    ],
)
def test_cuts_apply_while_another_member_is_steadily_free_of_them(
    stats: dict[str, MemberStats], wanted: set[str]
) -> None:
    assert eligible(leader(stats), after=60.0) == wanted


def test_a_member_just_back_does_not_cut_the_others_at_once() -> None:
    fake = leader({"a": HANDLER_AWAY, "b": ABLE})
    assert eligible(fake, after=1.0) == {"a", "b"}  # b able for 1 s only
    assert eligible(fake, after=5.0) == {"b"}
