"""Off-peak batch: when a hop of a chain run with `schedule: off_peak` may go (pure).

Such a run says how late it may finish (its deadline, e.g. within 8 hours) and not how
soon; its hops wait while the pool is busy, so that realtime and standard work at the
peak keeps the engines, and go when there is room:

* a hop goes at once when waiting longer would put the run's deadline at risk: from
  its latest start, ``deadline - margin x (expected rest of the run) - recheck``, on;
* else, with quiet hours configured, it waits outside them (the hour of the day is the
  caller's: UTC live, the simulator's own day in a replay);
* else it waits while the pool's load, (running + queued) / capacity, is above
  ``load_threshold``; an unknown load counts as room (nothing says it is busy);
* else it goes.

The caller asks again every ``recheck_s`` while a hop waits. The decision carries a
reason (`inferx status` shows it for every waiting hop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from inferx.chain.durations import parse_quiet_hours

__all__ = [
    "OffPeakDecision",
    "OffPeakRule",
    "in_quiet_hours",
    "latest_start_s",
    "off_peak_decision",
    "parse_quiet_hours",
]

DEFAULT_WITHIN_S = 8 * 3600.0  # `schedule: off_peak` without `off_peak_within`


@dataclass(frozen=True)
class OffPeakRule:
    load_threshold: float = 0.6  # (running + queued) / capacity above which off-peak hops wait
    # [start, end) hours of the day (0-24, end may be below start: 22-6 spans midnight)
    # when off-peak hops may run; () = any hour.
    quiet_hours: tuple[tuple[float, float], ...] = ()
    margin: float = 2.0  # the expected rest of the run is given this many times over
    recheck_s: float = 5.0  # how often a waiting hop asks again

    def __post_init__(self) -> None:
        if not (math.isfinite(self.load_threshold) and self.load_threshold >= 0):
            raise ValueError(f"load_threshold: must be a number >= 0, got {self.load_threshold!r}")
        if not (math.isfinite(self.margin) and self.margin >= 1):
            raise ValueError(f"margin: must be at least 1, got {self.margin!r}")
        if not (math.isfinite(self.recheck_s) and self.recheck_s > 0):
            raise ValueError(f"recheck_s: must be above 0, got {self.recheck_s!r}")
        for start, end in self.quiet_hours:
            if not (0 <= start <= 24 and 0 <= end <= 24) or start == end:
                raise ValueError(f"quiet_hours: {start:g}-{end:g} is not a span of hours within 0-24")


@dataclass(frozen=True)
class OffPeakDecision:
    go: bool
    reason: str  # why it goes or waits, for `inferx status`


def in_quiet_hours(hour: float, spans: tuple[tuple[float, float], ...]) -> bool:
    """Whether `hour` (0-24) falls in one of the spans (a span may wrap midnight)."""
    for start, end in spans:
        if (start <= hour < end) if start < end else (hour >= start or hour < end):
            return True
    return False


def _hours(spans: tuple[tuple[float, float], ...]) -> str:
    return ", ".join(f"{start:02g}:00-{end:02g}:00" for start, end in spans)


def latest_start_s(rule: OffPeakRule, deadline_s: float, remaining_s: float) -> float:
    """The last moment a waiting hop may still go and the run finish by its deadline."""
    return deadline_s - rule.margin * max(remaining_s, 0.0) - rule.recheck_s


def off_peak_decision(
    rule: OffPeakRule,
    *,
    now_s: float,
    hour_of_day: float,
    load: float | None,
    deadline_s: float,
    remaining_s: float,
) -> OffPeakDecision:
    """Whether an off-peak hop goes now. `now_s` and `deadline_s` on one clock;
    `remaining_s`: the expected rest of the run from this hop on; `load`: its pool's
    (running + queued) / capacity, None when unknown."""
    if now_s >= latest_start_s(rule, deadline_s, remaining_s):
        return OffPeakDecision(True, "deadline near: runs now")
    if rule.quiet_hours and not in_quiet_hours(hour_of_day, rule.quiet_hours):
        return OffPeakDecision(False, f"outside quiet hours ({_hours(rule.quiet_hours)})")
    if load is not None and load > rule.load_threshold:
        return OffPeakDecision(False, f"pool load {load:.0%} above {rule.load_threshold:.0%}")
    return OffPeakDecision(True, "room")
