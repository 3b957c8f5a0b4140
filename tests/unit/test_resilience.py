"""Pure resilience policy: backoff, retry budget, circuit breaker, degradation ladder."""

import random

from hypothesis import given
from hypothesis import strategies as st

from inferx.resilience import (
    BreakerBoard,
    BreakerState,
    CircuitBreaker,
    Degradation,
    NodeFallbacks,
    RetryBudget,
    backoff_s,
    degradation_ladder,
    overloaded,
)


@given(st.integers(1, 30), st.integers(0, 2**32))
def test_backoff_is_jittered_exponential_and_capped(attempt: int, seed: int) -> None:
    wait = backoff_s(attempt, base_s=0.05, cap_s=1.0, rng=random.Random(seed))
    assert 0 <= wait <= min(1.0, 0.05 * 2 ** (attempt - 1))


def test_backoff_grows_on_average() -> None:
    rng = random.Random(1)
    first = sum(backoff_s(1, rng=rng) for _ in range(500))
    third = sum(backoff_s(3, rng=rng) for _ in range(500))
    assert third > 3 * first


def test_retry_budget_is_spent_once_per_retry() -> None:
    budget = RetryBudget(3)
    assert [budget.try_spend() for _ in range(5)] == [True, True, True, False, False]
    assert budget.used == 3 and budget.left == 0
    assert not RetryBudget(0).try_spend()


def test_breaker_opens_after_consecutive_failures_then_probes() -> None:
    breaker = CircuitBreaker(failure_threshold=3, open_s=5)
    for t in range(3):
        assert breaker.allow(t)
        breaker.record(False, t)
    assert breaker.state == BreakerState.OPEN
    assert not breaker.allow(4)
    assert breaker.allow(8)  # half-open: one probe
    assert breaker.state == BreakerState.HALF_OPEN
    assert not breaker.allow(8)  # only one probe at a time
    breaker.record(True, 8.1)
    assert breaker.state == BreakerState.CLOSED and breaker.allow(8.2)


def test_failed_probe_opens_again() -> None:
    breaker = CircuitBreaker(failure_threshold=1, open_s=1)
    breaker.record(False, 0)
    assert breaker.allow(1.5)
    breaker.record(False, 1.5)
    assert breaker.state == BreakerState.OPEN and not breaker.allow(2.0)


def test_breaker_opens_on_error_rate_without_a_long_streak() -> None:
    breaker = CircuitBreaker(failure_threshold=100, error_rate=0.5, window=10, min_calls=10)
    for i in range(10):
        breaker.record(i % 2 == 0, i)  # alternate: never 2 failures in a row
    assert breaker.state == BreakerState.OPEN


def test_success_resets_the_streak() -> None:
    breaker = CircuitBreaker(failure_threshold=3, min_calls=100)
    for t, ok in enumerate([False, False, True, False, False]):
        breaker.record(ok, t)
    assert breaker.state == BreakerState.CLOSED


def test_board_has_one_breaker_per_target() -> None:
    board = BreakerBoard(CircuitBreaker(failure_threshold=1))
    board.get("a").record(False, 0)
    assert board.states() == {"a": BreakerState.OPEN}
    assert board.get("b").state == BreakerState.CLOSED


def test_degradation_ladder_order() -> None:
    everything = NodeFallbacks("small", True, "sorry", critical=False)
    assert degradation_ladder(everything, tried_fallback_model=False) == [
        Degradation.FALLBACK_MODEL,
        Degradation.STALE_CACHE,
        Degradation.STATIC_FALLBACK,
        Degradation.SKIPPED,
    ]
    assert Degradation.FALLBACK_MODEL not in degradation_ladder(everything, tried_fallback_model=True)
    nothing = NodeFallbacks(None, False, None, critical=True)
    assert degradation_ladder(nothing, tried_fallback_model=False) == []


def test_overload_threshold() -> None:
    assert not overloaded(running=6, queued=2, capacity=10, threshold=0.8)
    assert overloaded(running=8, queued=1, capacity=10, threshold=0.8)
    assert overloaded(running=0, queued=0, capacity=0)


def test_admits_without_claiming_the_probe_and_force_open_refreshes() -> None:
    breaker = CircuitBreaker(open_s=5)
    assert breaker.admits(0)
    breaker.force_open(1)
    assert not breaker.admits(3)
    breaker.force_open(4)  # still failing: the open period starts again
    assert not breaker.admits(8)
    assert breaker.admits(9.5) and breaker.state == BreakerState.HALF_OPEN
    assert breaker.admits(9.6)  # half-open admits traffic; the next outcome decides
    breaker.record(False, 9.7)
    assert breaker.state == BreakerState.OPEN
