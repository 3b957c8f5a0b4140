"""Off-peak runs on the router (`schedule: off_peak`, or `RunChainRequest.schedule`):
each model hop waits here for room (`inferx.scheduling.off_peak`: the pool's load from
the LoadMonitor, quiet hours in UTC), never later than the run's deadline allows;
`WAITING` is what `inferx status` lists, with why."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from inferx.chain.durations import format_duration_ms, parse_quiet_hours
from inferx.chain.schema import MAX_DURATION_MS, ChainConfig
from inferx.errors import InvalidArgument
from inferx.scheduling.off_peak import DEFAULT_WITHIN_S, OffPeakRule, latest_start_s, off_peak_decision
from inferx.v1 import router_pb2

RECHECK_S = 1.0  # a waiting hop asks again this often


@dataclass(frozen=True)
class OffPeakPlan:
    rule: OffPeakRule
    within_s: float  # the run's deadline, from its start


@dataclass(frozen=True)
class Waiting:
    run_id: str
    tenant: str
    chain: str
    node_id: str
    model: str
    since: float  # monotonic
    reason: str
    latest_start_unix_ms: int


WAITING: dict[tuple[str, str], Waiting] = {}  # (run id, node id) -> the hop waiting


def plan_of(config: ChainConfig, schedule: str, within_ms: int) -> OffPeakPlan | None:
    """The run's off-peak plan: the request's schedule, else the chain's; None = now."""
    if schedule not in ("", "now", "off_peak"):
        raise InvalidArgument(f"schedule: unknown value {schedule!r}; valid: now, off_peak")
    chosen = schedule or config.schedule
    if chosen == "now":
        if within_ms:
            raise InvalidArgument("off_peak_within_ms: only with schedule off_peak")
        return None
    spec = config.off_peak
    if within_ms > MAX_DURATION_MS:
        raise InvalidArgument(f"off_peak_within_ms: at most 30 days, got {format_duration_ms(within_ms)}")
    within_s = within_ms / 1000 if within_ms else (spec.within_ms / 1000 if spec else DEFAULT_WITHIN_S)
    rule = OffPeakRule(
        load_threshold=spec.max_load if spec else OffPeakRule.load_threshold,
        quiet_hours=parse_quiet_hours(spec.quiet_hours) if spec else (),
        recheck_s=RECHECK_S,
    )
    return OffPeakPlan(rule, within_s)


async def wait_for_room(
    plan: OffPeakPlan,
    waiting: Waiting,
    *,
    deadline: float,
    remaining_s: float,
    load: Callable[[], float | None],
) -> None:
    """Return when the hop may go: there is room, or its latest start has come.
    `deadline`: the run's, on the monotonic clock."""
    key = (waiting.run_id, waiting.node_id)
    try:
        while True:
            now = time.monotonic()
            decision = off_peak_decision(
                plan.rule,
                now_s=now,
                hour_of_day=(time.time() % 86_400) / 3_600,
                load=load(),
                deadline_s=deadline,
                remaining_s=remaining_s,
            )
            if decision.go:
                return
            latest = latest_start_s(plan.rule, deadline, remaining_s)
            WAITING[key] = Waiting(
                waiting.run_id,
                waiting.tenant,
                waiting.chain,
                waiting.node_id,
                waiting.model,
                waiting.since,
                decision.reason,
                int((time.time() + latest - now) * 1000),
            )
            await asyncio.sleep(min(plan.rule.recheck_s, max(latest - now, 0.01)))
    finally:
        WAITING.pop(key, None)


def waiting_messages(tenant: str | None) -> list[router_pb2.OffPeakWait]:
    """The waiting hops, of `tenant` only (None: every tenant's)."""
    now = time.monotonic()
    return [
        router_pb2.OffPeakWait(
            run_id=w.run_id,
            chain=w.chain,
            node_id=w.node_id,
            model=w.model,
            waiting_s=now - w.since,
            reason=w.reason,
            latest_start_unix_ms=w.latest_start_unix_ms,
        )
        for w in WAITING.values()
        if tenant is None or w.tenant == tenant
    ]
