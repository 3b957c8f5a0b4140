"""Capacity at SLO: the highest arrival rate at which a policy still meets its SLOs.

A rate *meets the SLO* when at least `realtime` (99%) of the realtime chains and at
least `overall` (95%) of all chains finish within their SLO; a chain shed, failed or
unfinished at the simulator's horizon is a miss. Every probe is a steady-state run
(`inferx.sim.steady`): the trace's chains arriving at the probed rate for the same
long window whatever the rate, only the chains of the measured window counted (a
burst of a fixed number of chains is available, labelled as one, never a capacity).
Rates are explored first
doubling or halving from the trace's own rate to bracket the capacity, then bisecting
geometrically until the bracket is within `tolerance` (3%). Meeting the SLO is not
quite monotone in the rate near the capacity (a few chains decide a 99% target), so the
result must also meet the SLO one and two tolerance steps below it; where it does not,
the search continues below the failing rate. Every probe is kept in `probes`.

`find_capacity` is the pure search over any evaluator (unit-tested with a fake one);
`simulated_evaluator` runs the virtual-time cluster.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from pydantic import BaseModel

from inferx.sim.cluster import ClusterSim, sim_policy
from inferx.sim.profile import EngineProfile
from inferx.sim.records import ChainRecord
from inferx.sim.steady import SteadyWindow, burst_trace, steady_trace
from inferx.sim.trace import Trace
from inferx.stats import percentile

REALTIME_TARGET = 0.99
OVERALL_TARGET = 0.95
TOLERANCE = 0.03
MAX_FACTOR = 64.0  # give up bracketing this far from the starting rate
CONFIRM_ROUNDS = 4  # times the search may move below a capacity that did not hold just under it


class ChainOutcome(Protocol):
    """What the criterion needs of a chain's record (the simulator's ChainRecord)."""

    tier: str

    @property
    def slo_met(self) -> bool: ...


class Attainment(BaseModel):
    chains: int
    realtime_chains: int
    overall: float  # share of all chains that met their SLO
    realtime: float | None  # share of realtime chains; None when the trace has none
    # P99 of chain latency (nearest rank; a chain that did not finish counts as
    # infinitely late), None when the outcomes carry no latency.
    p99_latency_s: float | None = None
    # A steady-state probe: every chain the simulator ran (warm-up and drain included;
    # `chains` are those measured), and why it stopped early (None: it did not).
    simulated_chains: int | None = None
    stopped: str | None = None


class CapacityProbe(BaseModel):
    rate_per_s: float
    attainment: Attainment
    meets: bool


class Capacity(BaseModel):
    policy: str
    rate_per_s: float  # the highest rate found to meet the SLO (0 if none did)
    failing_rate_per_s: float | None  # the lowest rate found not to (None: never failed)
    realtime_target: float
    overall_target: float
    tolerance: float
    probes: list[CapacityProbe]

    @property
    def at_capacity(self) -> CapacityProbe | None:
        return next((p for p in self.probes if p.rate_per_s == self.rate_per_s and p.meets), None)


def attainment(chains: Iterable[ChainOutcome]) -> Attainment:
    chains = list(chains)
    realtime = [c for c in chains if c.tier == "realtime"]
    met = sum(1 for c in chains if c.slo_met)
    p99 = None
    if chains and all(hasattr(c, "latency_s") for c in chains):
        latencies = [math.inf if c.latency_s is None else c.latency_s for c in chains]  # type: ignore[attr-defined]
        p99 = percentile(latencies, 99, method="nearest-rank")
    return Attainment(
        chains=len(chains),
        realtime_chains=len(realtime),
        overall=met / len(chains) if chains else 0.0,
        realtime=sum(1 for c in realtime if c.slo_met) / len(realtime) if realtime else None,
        p99_latency_s=p99,
    )


def meets_slo(
    result: Attainment, realtime_target: float = REALTIME_TARGET, overall_target: float = OVERALL_TARGET
) -> bool:
    if result.chains == 0:
        return False
    realtime_ok = result.realtime is None or result.realtime >= realtime_target
    return realtime_ok and result.overall >= overall_target


def find_capacity(
    policy: str,
    evaluate: Callable[[float], Attainment],
    start_rate: float,
    *,
    realtime_target: float = REALTIME_TARGET,
    overall_target: float = OVERALL_TARGET,
    tolerance: float = TOLERANCE,
    max_factor: float = MAX_FACTOR,
    on_probe: Callable[[CapacityProbe], None] | None = None,
) -> Capacity:
    """Bracket then bisect the rate at which `evaluate(rate)` stops meeting the SLO."""
    if start_rate <= 0 or tolerance <= 0:
        raise ValueError("start_rate and tolerance must be positive")
    probes: list[CapacityProbe] = []

    def meets(rate: float) -> bool:
        result = evaluate(rate)
        probe = CapacityProbe(
            rate_per_s=rate, attainment=result, meets=meets_slo(result, realtime_target, overall_target)
        )
        probes.append(probe)
        if on_probe is not None:
            on_probe(probe)
        return probe.meets

    lo: float | None
    hi: float | None
    if meets(start_rate):
        lo, hi = start_rate, start_rate * 2
        while meets(hi):
            lo, hi = hi, hi * 2
            if hi > start_rate * max_factor:
                hi = None  # meets the SLO at every rate tried: report the highest
                break
    else:
        lo, hi = start_rate / 2, start_rate
        while not meets(lo):
            lo, hi = lo / 2, lo
            if lo < start_rate / max_factor:
                lo = None  # misses the SLO even at a trickle
                break
    if lo is not None and hi is not None:
        lo, hi = _bisect(meets, lo, hi, tolerance)
        # Near its capacity a policy's attainment is noisy (a handful of chains decide
        # the 99%), so a lucky rate can meet the SLO above one that fails. The capacity
        # must also hold a step and two steps below it; if not, search again below the
        # failing rate. Bounded: each round only moves down.
        for _ in range(CONFIRM_ROUNDS):
            failed = next(
                (rate for rate in (lo * (1 - tolerance), lo * (1 - tolerance) ** 2) if not meets(rate)), None
            )
            if failed is None:
                break
            hi = failed
            lo = hi / 2
            while not meets(lo):
                hi, lo = lo, lo / 2
                if lo < start_rate / max_factor:
                    lo = None
                    break
            if lo is None:
                break
            lo, hi = _bisect(meets, lo, hi, tolerance)
    return Capacity(
        policy=policy,
        rate_per_s=lo or 0.0,
        failing_rate_per_s=hi,
        realtime_target=realtime_target,
        overall_target=overall_target,
        tolerance=tolerance,
        probes=probes,
    )


def _bisect(meets: Callable[[float], bool], lo: float, hi: float, tolerance: float) -> tuple[float, float]:
    while hi / lo > 1 + tolerance:
        mid = math.sqrt(lo * hi)  # geometric: the tolerance is relative
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def allowed_misses(chains: int, target: float) -> int:
    """The most of `chains` that may miss while the rest still meet `target` (as
    `meets_slo` compares)."""
    misses = max(0, int(math.floor(chains * (1 - target) + 1e-9)))
    while misses > 0 and (chains - misses) / chains < target:
        misses -= 1
    return misses


def simulated_evaluator(
    trace: Trace,
    policy: str,
    profile: EngineProfile,
    workers: int,
    progress: Callable[[float, int], AbstractContextManager[Callable[[int], None]]] | None = None,
    options: dict[str, Any] | None = None,
    programs: bool = False,
    *,
    window: SteadyWindow | None = None,
    burst: int | None = None,
    realtime_target: float = REALTIME_TARGET,
    overall_target: float = OVERALL_TARGET,
) -> Callable[[float], Attainment]:
    """evaluate(rate): `trace`'s chains at `rate` through a fresh policy in the simulator,
    for `window` (a steady-state probe) or as a burst of `burst` chains (exactly one of
    the two). `progress(rate, chains)`, if given, is entered around each run and yields
    its per-chain callback (the CLI's progress bar). `programs`: replay chains as
    dynamic programs (`ClusterSim.programs`).

    A steady probe stops as soon as more measured chains missed than the targets allow
    (the verdict is known; its attainment, unfinished chains counted as misses, is then a
    lower bound, and `stopped` says so)."""
    if (window is None) == (burst is None):
        raise ValueError("give a steady-state window or a burst size, not both or neither")

    def evaluate(rate: float) -> Attainment:
        if window is not None:
            probe, measured = steady_trace(trace, rate, window)
        else:
            probe, measured = burst_trace(trace, rate, burst or 0)
        counted = [c for c in probe.chains if c.chain_id in measured]
        realtime = sum(1 for c in counted if c.tier == "realtime")
        budget = (allowed_misses(len(counted), overall_target), allowed_misses(realtime, realtime_target))
        sim = ClusterSim(
            probe,
            sim_policy(policy, profile, options),
            profile,
            workers,
            programs=programs,
            measured=measured,
            miss_budget=budget if window is not None else None,
        )
        if progress is None:
            result = sim.run()
        else:
            with progress(rate, len(probe.chains)) as advance:
                result = sim.run(advance)
        outcome = attainment(c for c in result.chains if c.chain_id in measured)
        stopped = result.stopped if result.stopped == "miss budget spent" else None
        return outcome.model_copy(update={"simulated_chains": len(probe.chains), "stopped": stopped})

    return evaluate


class Throughput(BaseModel):
    """What a policy completes per second with more offered than it can serve: the
    engines' bound on a workload, by the steady-state method (every worker busy).

    Counted in chains *of the trace's mix*: overloaded, a policy that finishes cheap
    chains and starves costly ones finishes more chains per second without serving more,
    so each finished chain weighs its serving time alone (its time alone on an idle
    engine less its tool and think time) over the mean of the chains that arrived. Rates
    are in the trace's nominal units, as capacities are (a trace's Poisson sample holds a
    few percent more or fewer chains than its nominal rate says)."""

    policy: str
    offered_rate_per_s: float  # nominal, as a capacity
    arrived_per_s: float  # chains arriving in the measured window, per second of it
    completed_per_s: float  # chains finished during the window (within SLO or not), per second
    completed_within_slo_per_s: float
    # The served share of the arrived work (serving time alone), times the offered rate:
    # comparable with capacities. The bound.
    completed_rate_per_s: float
    # completed_per_s in nominal units, every chain counted as one (what a starving
    # policy inflates): shown, not the bound.
    completed_chains_rate_per_s: float
    # Less of the arrived work served than arrived (by more than 5%): the workers could
    # not keep up, so `completed_rate_per_s` is what they get through. False: they kept
    # up, and the bound is at least the offered rate.
    saturated: bool


def serving_work_s(chain: ChainRecord) -> float:
    """A chain's serving time alone: what the engines must spend on it (its weight in
    the trace's mix), as opposed to the tool and think time no scheduler serves."""
    return max(chain.alone_s - chain.delays_s, 0.0)


def saturated_throughput(
    trace: Trace,
    policy: str,
    profile: EngineProfile,
    workers: int,
    window: SteadyWindow,
    offered_rate_per_s: float,
    options: dict[str, Any] | None = None,
    programs: bool = False,
) -> Throughput:
    """`trace` offered at `offered_rate_per_s` (above what the policy sustains) over the
    steady window: the work of the chains that finish during the measured window, per
    second of it, over the work that arrived (see `Throughput`). With the queue never
    empty, that is what the workers, all busy, serve under this policy (its batching and
    cache reuse included)."""
    probe, measured = steady_trace(trace, offered_rate_per_s, window)
    end = window.warmup_s + window.window_s
    sim = ClusterSim(
        probe, sim_policy(policy, profile, options), profile, workers, programs=programs, until_s=end
    )
    result = sim.run()
    return throughput_of(
        policy,
        offered_rate_per_s,
        [c for c in result.chains if c.chain_id in measured],
        finished_in_window(result.chains, window),
        window,
    )


def finished_in_window(chains: list[ChainRecord], window: SteadyWindow) -> list[ChainRecord]:
    """The chains (of any arrival time) that finished during the measured window: what
    the engines served in it."""
    end = window.warmup_s + window.window_s
    return [
        c for c in chains if c.latency_s is not None and window.warmup_s <= c.arrival_s + c.latency_s < end
    ]


def engine_bound(served: dict[str, float], capacities: dict[str, float]) -> tuple[float, str]:
    """The engines' bound on one seed, and what set it: the most any policy served
    overloaded (`served`, per policy), or the best sustained capacity where that is higher
    -- a capacity is served work too, and where overload makes throughput collapse (long
    contexts thrashing the KV cache) every overloaded run serves less."""
    by_served = max(served, key=lambda n: served[n])
    by_capacity = max(capacities, key=lambda n: capacities[n])
    if served[by_served] >= capacities[by_capacity]:
        return served[by_served], by_served
    return capacities[by_capacity], f"{by_capacity} (its capacity: overloaded, every run served less)"


def throughput_of(
    policy: str,
    offered_rate_per_s: float,
    arrived: list[ChainRecord],
    finished: list[ChainRecord],
    window: SteadyWindow,
) -> Throughput:
    """The figures of one saturated run (pure: `saturated_throughput` does the replay)."""
    arrived_work = sum(serving_work_s(c) for c in arrived)
    finished_work = sum(serving_work_s(c) for c in finished)
    served = finished_work / arrived_work if arrived_work > 0 else 0.0
    completed = len(finished) / window.window_s
    arrived_per_s = len(arrived) / window.window_s
    return Throughput(
        policy=policy,
        offered_rate_per_s=offered_rate_per_s,
        arrived_per_s=arrived_per_s,
        completed_per_s=completed,
        completed_within_slo_per_s=sum(1 for c in finished if c.slo_met) / window.window_s,
        completed_rate_per_s=served * offered_rate_per_s,
        completed_chains_rate_per_s=completed * offered_rate_per_s / arrived_per_s if arrived_per_s else 0.0,
        saturated=served < 0.95,
    )
