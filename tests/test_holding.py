"""The hold budget (holding.HoldBudget): a second of the measured settle rate, bounded."""

from __future__ import annotations

from shoal.consumer.holding import HoldBudget


def _settle(budget: HoldBudget, count: int) -> None:
    for _ in range(count):
        budget.settled()


def test_starts_at_the_floor() -> None:
    assert HoldBudget(8192).limit(576, 0.0) == 576


def test_follows_the_rate_up_to_the_ceiling() -> None:
    budget = HoldBudget(8192, hold_seconds=1.0, interval=0.25)
    budget.limit(100, 0.0)
    _settle(budget, 500)  # 2,000 msg/s
    assert budget.limit(100, 0.25) == 2000
    _settle(budget, 5000)  # 20,000 msg/s: half the weight on the newest window
    assert budget.limit(100, 0.5) == 8192  # (2,000 + 20,000) / 2, capped


def test_a_slow_member_holds_little() -> None:
    # 32 slots x a 20 ms handler: 1,600 msg/s, so about 1,600 held, not the ceiling.
    budget = HoldBudget(8192)
    budget.limit(64, 0.0)
    for window in range(1, 9):
        _settle(budget, 400)
        limit = budget.limit(64, window * 0.25)
    assert limit == 1600


def test_decays_when_idle_but_never_below_the_floor() -> None:
    budget = HoldBudget(8192)
    budget.limit(64, 0.0)
    _settle(budget, 1000)
    assert budget.limit(64, 0.25) == 4000
    assert budget.limit(64, 0.5) == 2000  # a quiet window halves it
    for window in range(3, 30):
        limit = budget.limit(64, window * 0.25)
    assert limit == 64


def test_no_update_within_an_interval_while_the_budget_lasts() -> None:
    budget = HoldBudget(8192)
    assert budget.limit(1000, 0.0) == 1000
    _settle(budget, 999)  # less than the budget: the window runs its full interval
    assert budget.limit(1000, 0.1) == 1000
    assert budget.limit(1000, 0.25) == 3996


def test_a_budget_used_up_early_ends_the_window_early() -> None:
    # A member starting on a backlog: 576 settled in 20 ms is 28,800 msg/s. Waiting out
    # the interval would keep it at the floor for a quarter of a second.
    budget = HoldBudget(8192)
    assert budget.limit(576, 0.0) == 576
    _settle(budget, 576)
    assert budget.limit(576, 0.01) == 576  # not before min_window
    assert budget.limit(576, 0.02) == 8192
    # The next window is a full one again unless the new budget is used up as fast.
    _settle(budget, 1000)
    assert budget.limit(576, 0.1) == 8192
    assert budget.limit(576, 0.27) == 8192
    assert budget.rate == (28800 + 1000 / 0.25) / 2
