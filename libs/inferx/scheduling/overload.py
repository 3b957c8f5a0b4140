"""Tiers protected under overload: how many chains of the less urgent tiers may be under
way at once, adapted to whether the urgent tier's chains are still on track.

Past capacity, every chain admitted slows every other: a continuous-batching engine
runs all admitted sequences in each step. Holding back new chains of lower tiers
(they wait to start; past a bound they are shed with RESOURCE_EXHAUSTED) keeps the
engines fast enough for the chains that matter most. How many chains may run is not
known in advance (it depends on the models, the contexts, the tools), so it is
learned the way TCP learns a congestion window -- additive increase, multiplicative
decrease (AIMD) -- from a signal the live system has and that only scheduling moves:
the protected tier's hops finishing *stretched* (their median queueing + service
over what they would take alone on the engine more than a threshold, see
`RecentStretch`, or one hop far past it) say its tier is at risk. (Slack to the deadline is a poorer signal:
tool and think times vary far more than the engine does, so it cries wolf on
workloads with chatty users.) An at-risk hop shrinks the window (at most once per
`cooldown_s`, the time a change needs to show); a hop on track grows it by about one
chain per window's worth of hops.

Pure: no clock, no I/O; the policy passes the time in.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass


@dataclass
class ChainWindow:
    """The number of chains of one tier that may be under way at once."""

    min_limit: float = 2.0
    decrease: float = 0.5
    cooldown_s: float = 5.0
    limit: float = math.inf  # no limit until the protected tier is first at risk
    _last_decrease: float = -math.inf

    def at_risk(self, active: int, now: float) -> None:
        if now - self._last_decrease < self.cooldown_s:
            return
        self._last_decrease = now
        start = min(self.limit, float(max(active, 1)))
        self.limit = max(self.min_limit, start * self.decrease)

    def on_track(self, active: int) -> None:
        if math.isinf(self.limit):
            return
        self.limit += 1.0 / self.limit
        if self.limit > 2 * max(active, self.min_limit) + 8:
            self.limit = math.inf  # far above what runs: the overload is over

    @property
    def limited(self) -> bool:
        return not math.isinf(self.limit)

    def admits(self, active: int) -> bool:
        return active < self.limit


@dataclass
class GuardScale:
    """How much of the realtime guard's static KV cap other tiers may use next to
    realtime hops, adapted to whether realtime hops still run fast enough there. What
    the cap's KV costs a realtime token is read time; what a realtime hop can afford
    depends on what else slows it (prefill chunks, the batch's size, queueing), which
    grows with the load. A stretched realtime hop shrinks the scale (at most once per
    `cooldown_s`, the time a change needs to show); it grows back with time on track,
    from `min_scale` to `max_scale` in `recover_s` (by the clock, not per hop: the
    busier the pool, the more hops finish, and a per-hop growth would undo every
    decrease at high load)."""

    min_scale: float = 0.25
    max_scale: float = 1.0
    decrease: float = 0.7
    cooldown_s: float = 5.0
    recover_s: float = 60.0
    scale: float = 1.0
    _last_decrease: float = -math.inf
    _last_update: float | None = None

    def at_risk(self, now: float) -> None:
        self._last_update = now
        if now - self._last_decrease < self.cooldown_s:
            return
        self._last_decrease = now
        self.scale = max(self.min_scale, self.scale * self.decrease)

    def on_track(self, now: float) -> None:
        if self.recover_s <= 0:
            self.scale = self.max_scale
        elif self._last_update is not None and now > self._last_update:
            step = (self.max_scale - self.min_scale) * (now - self._last_update) / self.recover_s
            self.scale = min(self.max_scale, self.scale + step)
        self._last_update = now


class RecentStretch:
    """Where a tier's hops run now: the median stretch (queueing + service over the
    hop's time alone on the engine) of its latest `window` hops. One hop says little
    (a long prefill batched beside it, a burst of arrivals); the median of a few dozen
    moves with the load: on mix (Llama-3-8B, 4 workers) realtime's median stretch was
    1.26 at half the capacity, ~1.9 at it and 2.5-3.8 at 1.2-1.8x it."""

    def __init__(self, window: int, min_hops: int = 8) -> None:
        self._recent: deque[float] = deque(maxlen=window)
        self.min_hops = min(min_hops, window)

    def observe(self, stretch: float) -> float | None:
        """Record a finished hop's stretch; the median of the recent ones, or None while
        fewer than `min_hops` were seen."""
        self._recent.append(stretch)
        if len(self._recent) < self.min_hops:
            return None
        return statistics.median(self._recent)
