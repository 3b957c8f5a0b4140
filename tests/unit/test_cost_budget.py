"""A tenant's cost budget per hour (inferx.auth.limits.TenantQuotas)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferx.auth.limits import COST_WINDOW_S, QuotaExceeded, TenantQuotas
from inferx.auth.model import TenantLimits


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_runs_are_refused_once_the_hour_is_spent_and_admitted_as_it_ages_out() -> None:
    clock = Clock()
    quotas = TenantQuotas(clock)
    limits = TenantLimits(cost_per_hour=1.0)
    quotas.admit("acme", limits, 0, 0.4)
    quotas.finished("acme", limits, 10, 0.6)
    clock.now += 600
    quotas.admit("acme", limits, 0, 0.3)
    quotas.finished("acme", limits, 10, 0.3)
    assert quotas.spent_last_hour("acme") == pytest.approx(0.9)
    with pytest.raises(
        QuotaExceeded, match=r"spent 0\.9 of its cost budget of 1 per hour.*retry in 3000s"
    ) as caught:
        quotas.admit("acme", limits, 0, 0.2)
    assert caught.value.limit == "cost_budget" and caught.value.retry_after_s == 3000
    clock.now += COST_WINDOW_S - 600  # the first run's 0.6 aged out
    quotas.admit("acme", limits, 0, 0.2)
    assert quotas.spent_last_hour("acme") == pytest.approx(0.3)


def test_a_run_over_the_whole_budget_is_named_so() -> None:
    quotas = TenantQuotas(Clock())
    with pytest.raises(QuotaExceeded, match=r"estimated at 5, over its whole cost budget of 1 per hour"):
        quotas.admit("acme", TenantLimits(cost_per_hour=1.0), 0, 5.0)


def test_no_budget_no_bookkeeping() -> None:
    quotas = TenantQuotas(Clock())
    limits = TenantLimits()
    quotas.admit("acme", limits, 0, 1e9)
    quotas.finished("acme", limits, 10, 1e9)
    assert quotas.spent_last_hour("acme") == 0


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 0.5)), max_size=30), st.floats(0.1, 5))
def test_admitted_spending_never_exceeds_the_budget_in_an_hour(
    steps: list[tuple[float, float]], budget: float
) -> None:
    clock = Clock()
    quotas = TenantQuotas(clock)
    limits = TenantLimits(cost_per_hour=budget)
    for wait_s, cost in steps:
        clock.now += wait_s
        try:
            quotas.admit("acme", limits, 0, cost)
        except QuotaExceeded as exc:
            assert exc.retry_after_s is not None and 0 < exc.retry_after_s <= COST_WINDOW_S
            continue
        quotas.finished("acme", limits, 0, cost)  # costs as estimated
        assert quotas.spent_last_hour("acme") <= budget + 1e-9
