"""The saturation load of a policy on a trace, found in the simulator.

A rate is *sustainable* when the backlog does not grow over the run: the median
slowdown of chains arriving in the last quarter of the window is at most
`GROWTH_BOUND` x that of the second quarter (the first quarter is warm-up), and no
chain was shed or failed. Saturation is the highest sustainable rate, found by
doubling then bisecting the trace's arrival rate (same chains, time squeezed).
`inferx bench --load 0.8` runs at 80% of round-robin's saturation (the reference policy).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from pydantic import BaseModel

from inferx.sim.cluster import ClusterSim, sim_policy
from inferx.sim.profile import EngineProfile
from inferx.sim.records import ReplayResult
from inferx.sim.trace import Trace

GROWTH_BOUND = 1.25


class Probe(BaseModel):
    rate_per_s: float
    early_slowdown: float
    late_slowdown: float
    sustainable: bool


class Saturation(BaseModel):
    policy: str
    rate_per_s: float
    probes: list[Probe]


def probe(run: ReplayResult, rate: float) -> Probe:
    window = run.window_s

    def median_slowdown(lo: float, hi: float) -> float:
        values = [
            c.latency_s / c.alone_s
            for c in run.chains
            if lo * window <= c.arrival_s < hi * window and c.latency_s is not None
        ]
        return statistics.median(values) if values else float("inf")

    early, late = median_slowdown(0.25, 0.5), median_slowdown(0.75, 1.0)
    clean = all(c.status == "ok" for c in run.chains)
    return Probe(
        rate_per_s=rate,
        early_slowdown=early,
        late_slowdown=late,
        sustainable=clean and late <= GROWTH_BOUND * early,
    )


def find_saturation(
    trace: Trace,
    profile: EngineProfile,
    workers: int,
    policy: str = "round-robin",
    bisections: int = 5,
    on_probe: Callable[[Probe], None] | None = None,
) -> Saturation:
    probes: list[Probe] = []

    def sustainable(rate: float) -> bool:
        run = ClusterSim(trace.at_rate(rate), sim_policy(policy, profile), profile, workers).run()
        result = probe(run, rate)
        probes.append(result)
        if on_probe is not None:
            on_probe(result)
        return result.sustainable

    rate = trace.meta.config.rate_per_s
    if sustainable(rate):
        lo, hi = rate, rate * 2
        while sustainable(hi):
            lo, hi = hi, hi * 2
            if hi > rate * 64:
                break
    else:
        lo, hi = rate / 2, rate
        while not sustainable(lo):
            lo, hi = lo / 2, lo
            if lo < rate / 64:
                break
    for _ in range(bisections):
        mid = (lo + hi) / 2
        if sustainable(mid):
            lo = mid
        else:
            hi = mid
    return Saturation(policy=policy, rate_per_s=lo, probes=probes)
