"""Per-tenant limits, as pure bookkeeping: runs in progress and a token bucket of model
tokens per minute. The router asks before a run starts and reports tokens after.

Both are per router process (each router enforces the tenant's limits on the runs it
serves); with R routers behind a balancer a tenant gets up to R times the figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from inferx.auth.model import TenantLimits
from inferx.errors import PermissionDenied, ResourceExhausted

TIER_NAMES = {1: "realtime", 2: "standard", 3: "batch"}


class TierNotAllowed(PermissionDenied):
    limit = "max_tier"


class QuotaExceeded(ResourceExhausted):
    def __init__(self, message: str, *, limit: str, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.limit = limit  # which limit refused: concurrent_runs | tokens


@dataclass
class _TenantUsage:
    running: int = 0
    bucket: float = 0.0  # tokens available now; below zero after a run used more than was left
    refilled_at: float = field(default_factory=time.monotonic)


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

    def admit(self, tenant: str, limits: TenantLimits, tier: int) -> None:
        """Count a run in, or refuse it naming the limit (PERMISSION_DENIED for a tier the
        tenant may never use, RESOURCE_EXHAUSTED with a retry hint for a full quota)."""
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
        usage.running += 1

    def finished(self, tenant: str, limits: TenantLimits, tokens: int) -> None:
        """A run admitted by `admit` ended, having used `tokens` model tokens."""
        usage = self._usage_of(tenant, limits)
        usage.running = max(0, usage.running - 1)
        if limits.tokens_per_minute:
            usage.bucket -= tokens

    def running(self, tenant: str) -> int:
        usage = self._usage.get(tenant)
        return usage.running if usage else 0
