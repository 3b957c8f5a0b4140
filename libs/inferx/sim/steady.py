"""Steady-state probes: a trace's chains arriving at a rate for a fixed, long window.

A capacity is a rate the system *sustains*, not a burst it absorbs. Squeezing a fixed
set of chains into a shorter and shorter span (`Trace.at_rate`) measures the latter:
580 chains at 40 chains/s all arrive within 15 s, half of one chain's SLO, and a policy
that clears that backlog afterwards "meets" a rate it could never hold. So every probe
here has the same arrival window whatever its rate:

  warm-up | measured window | drain
  --------+-----------------+------
  chains arrive at `rate` throughout; only those arriving in the measured window count.

The chains are the base trace's, repeated in order with fresh ids (`c00012~3` is chain
`c00012` of the third repetition) and their arrival times scaled to the rate, so every
probe of a search sees the same sequence of chains (common random numbers: only the
rate differs between probes) and any trace, generated or not, can be probed at any rate.

* Warm-up: chains arriving before the system reached its steady queue are left out.
* Drain: arrivals go on after the window for as long as the longest SLO, so the last
  measured chains run under the same load as the first; chains arriving then are left
  out too.
* The window defaults to at least 20 x the median chain SLO and at least 30 minutes.

`burst_trace` is the old scenario, kept and labelled as one: the first N chains at the
rate, all measured; a policy's burst capacity says how well it absorbs one burst.
"""

from __future__ import annotations

import math
import statistics

from pydantic import BaseModel, ConfigDict, Field

from inferx.errors import InvalidArgument
from inferx.sim.trace import Trace, TraceChain

MIN_WINDOW_S = 1800.0  # at least 30 minutes of arrivals are measured
WINDOW_SLOS = 20.0  # ... and at least 20 median chain SLOs
WARMUP_SLOS = 3.0  # warm-up: at least 3 median SLOs ...
WARMUP_SHARE = 0.1  # ... and at least a tenth of the window


class SteadyWindow(BaseModel):
    """The arrival span of every probe (seconds of virtual time)."""

    model_config = ConfigDict(frozen=True)

    warmup_s: float = Field(ge=0)
    window_s: float = Field(gt=0)
    drain_s: float = Field(ge=0)
    median_slo_s: float = Field(gt=0)  # of the base trace: what the defaults are sized on

    @property
    def span_s(self) -> float:
        return self.warmup_s + self.window_s + self.drain_s

    @property
    def window_slos(self) -> float:
        """The measured window in median chain SLOs (>= 20: steady state by our rule)."""
        return self.window_s / self.median_slo_s

    @property
    def steady(self) -> bool:
        return self.window_s >= WINDOW_SLOS * self.median_slo_s

    def measured(self, arrival_s: float) -> bool:
        return self.warmup_s <= arrival_s < self.warmup_s + self.window_s


def steady_window(base: Trace, window_s: float | None = None) -> SteadyWindow:
    """The default window for `base`'s chains (or the given one): warm-up and drain
    sized on the trace's SLOs."""
    if not base.chains:
        raise InvalidArgument("the trace has no chains")
    slos = [c.slo_s for c in base.chains]
    median = statistics.median(slos)
    if window_s is None:
        window_s = max(MIN_WINDOW_S, WINDOW_SLOS * median)
    elif not (window_s > 0 and math.isfinite(window_s)):
        raise InvalidArgument(f"--window-s must be a positive number of seconds, got {window_s}")
    warmup = max(WARMUP_SLOS * median, WARMUP_SHARE * window_s)
    return SteadyWindow(warmup_s=warmup, window_s=window_s, drain_s=max(slos), median_slo_s=median)


def _repeated(base: Trace, rate_per_s: float, until_s: float, limit: int | None = None) -> list[TraceChain]:
    """`base`'s chains at `rate_per_s`, repeated with fresh ids, arriving before `until_s`
    (and at most `limit` of them)."""
    if rate_per_s <= 0 or not math.isfinite(rate_per_s):
        raise InvalidArgument(f"the arrival rate must be a positive number, got {rate_per_s}")
    if not base.chains:
        raise InvalidArgument("the trace has no chains")
    ordered = sorted(base.chains, key=lambda c: c.arrival_s)
    factor = base.meta.config.rate_per_s / rate_per_s
    # One repetition lasts the base trace's span at the new rate; a trace whose last
    # arrival is past its nominal duration (a foreign one) repeats after that arrival,
    # plus one mean gap so the repetitions do not collide.
    gap = 1.0 / base.meta.config.rate_per_s
    period = max(base.meta.config.duration_s, ordered[-1].arrival_s + gap) * factor
    chains: list[TraceChain] = []
    repeat = 0
    while repeat * period < until_s and (limit is None or len(chains) < limit):
        offset = repeat * period
        for chain in ordered:
            at = offset + chain.arrival_s * factor
            if at >= until_s or (limit is not None and len(chains) >= limit):
                break
            chain_id = chain.chain_id if repeat == 0 else f"{chain.chain_id}~{repeat}"
            chains.append(chain.model_copy(update={"chain_id": chain_id, "arrival_s": round(at, 6)}))
        repeat += 1
    return chains


def _with_chains(base: Trace, chains: list[TraceChain], rate_per_s: float, duration_s: float) -> Trace:
    config = base.meta.config.model_copy(update={"rate_per_s": rate_per_s, "duration_s": duration_s})
    meta = base.meta.model_copy(update={"config": config, "chains": len(chains)})
    return Trace(meta=meta, chains=chains)


def steady_trace(base: Trace, rate_per_s: float, window: SteadyWindow) -> tuple[Trace, frozenset[str]]:
    """`base`'s chains arriving at `rate_per_s` over the whole span of `window`, and the
    ids of the chains that count (those arriving in the measured window)."""
    chains = _repeated(base, rate_per_s, window.span_s)
    measured = frozenset(c.chain_id for c in chains if window.measured(c.arrival_s))
    return _with_chains(base, chains, rate_per_s, window.span_s), measured


def burst_trace(base: Trace, rate_per_s: float, chains: int) -> tuple[Trace, frozenset[str]]:
    """A burst: the first `chains` chains (repeating the trace if it is shorter) at
    `rate_per_s`, every one of them counted. Not a capacity: see the module's text."""
    if chains < 1:
        raise InvalidArgument(f"--burst needs at least one chain, got {chains}")
    kept = _repeated(base, rate_per_s, math.inf, limit=chains)
    duration = kept[-1].arrival_s + 1.0 / rate_per_s
    return _with_chains(base, kept, rate_per_s, duration), frozenset(c.chain_id for c in kept)
