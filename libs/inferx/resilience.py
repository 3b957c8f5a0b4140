"""Resilience policy, pure (no I/O; time and randomness passed in): retry backoff, the
chain-level retry budget, circuit breakers, and the degradation ladder.

Used by the router for tool calls and model hops; unit tested exhaustively.
"""

from __future__ import annotations

import enum
import random
from collections import deque
from dataclasses import dataclass, field


def backoff_s(
    attempt: int, *, base_s: float = 0.05, cap_s: float = 1.0, rng: random.Random | None = None
) -> float:
    """Exponential backoff with full jitter (AWS architecture blog): attempt 1 waits up
    to base, attempt 2 up to 2*base, ... never more than cap. Jitter spreads retries of
    many chains so they do not hit a recovering tool at the same instant."""
    ceiling = min(cap_s, base_s * (2 ** max(attempt - 1, 0)))
    return (rng or random).uniform(0, ceiling)


@dataclass
class RetryBudget:
    """Retries one chain run may spend across all its nodes (default 3). Once spent,
    failures take the degradation path instead of retrying."""

    total: int = 3
    used: int = 0

    def try_spend(self) -> bool:
        if self.used >= self.total:
            return False
        self.used += 1
        return True

    @property
    def left(self) -> int:
        return self.total - self.used


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass
class CircuitBreaker:
    """Opens after `failure_threshold` consecutive failures, or when the error rate of
    the last `window` calls reaches `error_rate` (with at least `min_calls`). While open,
    calls are refused; after `open_s` one probe is let through (half-open): success
    closes it, failure opens it again."""

    failure_threshold: int = 5
    error_rate: float = 0.5
    window: int = 20
    min_calls: int = 10
    open_s: float = 5.0
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    opened_at: float = 0.0
    probe_in_flight: bool = False
    outcomes: deque[bool] = field(default_factory=deque)

    def allow(self, now: float) -> bool:
        if self.state == BreakerState.CLOSED:
            return True
        if self.state == BreakerState.OPEN and now - self.opened_at >= self.open_s:
            self.state = BreakerState.HALF_OPEN
            self.probe_in_flight = False
        if self.state == BreakerState.HALF_OPEN and not self.probe_in_flight:
            self.probe_in_flight = True
            return True
        return False

    def record(self, ok: bool, now: float) -> None:
        self.outcomes.append(ok)
        while len(self.outcomes) > self.window:
            self.outcomes.popleft()
        if ok:
            self.consecutive_failures = 0
            if self.state == BreakerState.HALF_OPEN:
                self._close()
            return
        self.consecutive_failures += 1
        if self.state == BreakerState.HALF_OPEN:
            self._open(now)
            return
        failures = self.outcomes.count(False)
        too_many = self.consecutive_failures >= self.failure_threshold
        too_often = len(self.outcomes) >= self.min_calls and failures / len(self.outcomes) >= self.error_rate
        if self.state == BreakerState.CLOSED and (too_many or too_often):
            self._open(now)

    def force_open(self, now: float) -> None:
        """Open (again) now, whatever the state: e.g. the target failed health checks."""
        self._open(now)

    def admits(self, now: float) -> bool:
        """Whether calls may go now, without claiming the single probe `allow` hands
        out: closed or half-open yes; open only once `open_s` has passed (it then turns
        half-open, and the next recorded outcome closes or re-opens it)."""
        if self.state == BreakerState.OPEN and now - self.opened_at >= self.open_s:
            self.state = BreakerState.HALF_OPEN
        return self.state != BreakerState.OPEN

    def _open(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self.opened_at = now
        self.probe_in_flight = False

    def _close(self) -> None:
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.probe_in_flight = False
        self.outcomes.clear()


@dataclass
class BreakerBoard:
    """One breaker per target (a tool endpoint, a worker), created on first use."""

    template: CircuitBreaker = field(default_factory=CircuitBreaker)
    breakers: dict[str, CircuitBreaker] = field(default_factory=dict)

    def get(self, target: str) -> CircuitBreaker:
        breaker = self.breakers.get(target)
        if breaker is None:
            t = self.template
            breaker = CircuitBreaker(t.failure_threshold, t.error_rate, t.window, t.min_calls, t.open_s)
            self.breakers[target] = breaker
        return breaker

    def states(self) -> dict[str, BreakerState]:
        return {target: b.state for target, b in sorted(self.breakers.items())}


class Degradation(enum.StrEnum):
    FALLBACK_MODEL = "fallback_model"
    STALE_CACHE = "stale_cache"
    STATIC_FALLBACK = "static_fallback"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class NodeFallbacks:
    """What a node's config allows when it fails."""

    fallback_model: str | None
    has_stale_result: bool
    fallback_output: str | None
    critical: bool


def degradation_ladder(options: NodeFallbacks, *, tried_fallback_model: bool) -> list[Degradation]:
    """The degradations to try, best first: a smaller model still answers the question;
    a stale cached answer or a declared static one is better than nothing; a
    non-critical node can be skipped. A critical node with none of these fails."""
    ladder: list[Degradation] = []
    if options.fallback_model and not tried_fallback_model:
        ladder.append(Degradation.FALLBACK_MODEL)
    if options.has_stale_result:
        ladder.append(Degradation.STALE_CACHE)
    if options.fallback_output is not None:
        ladder.append(Degradation.STATIC_FALLBACK)
    if not options.critical:
        ladder.append(Degradation.SKIPPED)
    return ladder


def overloaded(running: int, queued: int, capacity: int, threshold: float = 0.8) -> bool:
    """Load above the threshold (default 80%) triggers degradation before the SLO is
    missed: work in the engines plus work waiting, over what the pool can run at once."""
    if capacity <= 0:
        return True
    return (running + queued) / capacity > threshold
