"""Per-tenant limits, as pure bookkeeping: runs in progress, a token bucket of model
tokens per minute and a cost budget per hour (a sliding window of what finished runs and
calls cost, inferx.pricing). The router asks before a run starts (with the run's
estimated cost) and reports tokens and cost after.

Both are per router process (each router enforces the tenant's limits on the runs it
serves); with R routers behind a balancer a tenant gets up to R times the figures.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from inferx.auth.model import TenantLimits
from inferx.errors import PermissionDenied, ResourceExhausted
from inferx.pricing import format_cost

TIER_NAMES = {1: "realtime", 2: "standard", 3: "batch"}


class TierNotAllowed(PermissionDenied):
    limit = "max_tier"


class QuotaExceeded(ResourceExhausted):
    def __init__(self, message: str, *, limit: str, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.limit = limit  # which limit refused: concurrent_runs | tokens | cost_budget


@dataclass
class _TenantUsage:
    running: int = 0
    bucket: float = 0.0  # tokens available now; below zero after a run used more than was left
    refilled_at: float = field(default_factory=time.monotonic)
    spent: deque[tuple[float, float]] = field(default_factory=deque)  # (when, cost) in the last hour


COST_WINDOW_S = 3600.0


class TenantQuotas:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._usage: dict[str, _TenantUsage] = {}

    def _usage_of(self, tenant: str, limits: TenantLimits) -> _TenantUsage:
        usage = self._usage.get(tenant)
        now = self._clock()
        if usage is None:
            usage = self._usage[tenant] = _TenantUsage(
                bucket=float(limits.tokens_per_minute), refilled_at=now
            )
        elif limits.tokens_per_minute:
            rate = limits.tokens_per_minute / 60.0
            usage.bucket = min(
                float(limits.tokens_per_minute), usage.bucket + (now - usage.refilled_at) * rate
            )
            usage.refilled_at = now
        return usage

    def admit(self, tenant: str, limits: TenantLimits, tier: int, estimated_cost: float = 0.0) -> None:
        """Count a run in, or refuse it naming the limit (PERMISSION_DENIED for a tier the
        tenant may never use, RESOURCE_EXHAUSTED with a retry hint for a full quota, or
        for a run whose `estimated_cost` does not fit what is left of the hour's budget)."""
        if limits.max_tier and tier and tier < limits.max_tier:
            raise TierNotAllowed(
                f"tier {TIER_NAMES.get(tier, tier)}: tenant '{tenant}' may use "
                f"{TIER_NAMES.get(limits.max_tier, limits.max_tier)} or lower (its max_tier limit)"
            )
        usage = self._usage_of(tenant, limits)
        if limits.max_concurrent_runs and usage.running >= limits.max_concurrent_runs:
            raise QuotaExceeded(
                f"tenant '{tenant}' has {usage.running} runs in progress "
                f"(its max_concurrent_runs limit); retry when one ends",
                limit="concurrent_runs",
                retry_after_s=1.0,
            )
        if limits.tokens_per_minute and usage.bucket <= 0:
            wait_s = (1 - usage.bucket) * 60.0 / limits.tokens_per_minute
            raise QuotaExceeded(
                f"tenant '{tenant}' used its {limits.tokens_per_minute} tokens per minute "
                f"(its tokens_per_minute limit); retry in {wait_s:.1f}s",
                limit="tokens",
                retry_after_s=round(wait_s, 1),
            )
        if limits.cost_per_hour:
            self._check_budget(tenant, limits.cost_per_hour, usage, estimated_cost)
        usage.running += 1

    def _check_budget(self, tenant: str, budget: float, usage: _TenantUsage, estimate: float) -> None:
        now = self._clock()
        while usage.spent and usage.spent[0][0] <= now - COST_WINDOW_S:
            usage.spent.popleft()
        spent = sum(cost for _, cost in usage.spent)
        if spent + estimate <= budget and spent < budget:
            return
        if estimate > budget:
            raise QuotaExceeded(
                f"tenant '{tenant}': this run is estimated at {format_cost(estimate)}, over its whole "
                f"cost budget of {format_cost(budget)} per hour (its cost_per_hour limit)",
                limit="cost_budget",
                retry_after_s=COST_WINDOW_S,
            )
        # When enough of the hour's spending has aged out for this run to fit.
        wait_s, left = COST_WINDOW_S, spent
        for when, cost in usage.spent:
            left -= cost
            if left + estimate <= budget and left < budget:
                wait_s = when + COST_WINDOW_S - now
                break
        raise QuotaExceeded(
            f"tenant '{tenant}' spent {format_cost(spent)} of its cost budget of {format_cost(budget)} per "
            f"hour (its cost_per_hour limit); this run is estimated at {format_cost(estimate)}; "
            f"retry in {wait_s:.0f}s",
            limit="cost_budget",
            retry_after_s=round(max(wait_s, 1.0), 1),
        )

    def finished(self, tenant: str, limits: TenantLimits, tokens: int, cost: float = 0.0) -> None:
        """A run admitted by `admit` ended, having used `tokens` model tokens and cost `cost`."""
        usage = self._usage_of(tenant, limits)
        usage.running = max(0, usage.running - 1)
        if limits.tokens_per_minute:
            usage.bucket -= tokens
        if limits.cost_per_hour and cost > 0:
            usage.spent.append((self._clock(), cost))

    def spent_last_hour(self, tenant: str) -> float:
        usage = self._usage.get(tenant)
        if usage is None:
            return 0.0
        now = self._clock()
        return sum(cost for when, cost in usage.spent if when > now - COST_WINDOW_S)

    def running(self, tenant: str) -> int:
        usage = self._usage.get(tenant)
        return usage.running if usage else 0
