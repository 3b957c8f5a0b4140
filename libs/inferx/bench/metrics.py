"""Benchmark results, shared by simulator and live runs: one record per chain, and the
summaries `inferx bench` prints (per policy, overall and per tier).

A chain that was shed or failed counts as a miss everywhere: its latency is infinite
in the percentiles and it earns no goodput. Goodput is chains meeting their SLO per
second of the arrival window (the same window for every policy on a trace).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pydantic import BaseModel

from inferx.sim.trace import TraceChain

TIER_ORDER = ("realtime", "standard", "batch")


@dataclass
class ChainRecord:
    chain_id: str
    kind: str
    tier: str
    arrival_s: float
    slo_s: float
    alone_s: float
    delays_s: float = 0.0  # the chain's tool delays and think time: no scheduler can save those
    status: str = "running"  # ok | shed | failed
    latency_s: float | None = None
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0

    @classmethod
    def start(cls, chain: TraceChain, alone_s: float) -> ChainRecord:
        delays = sum(hop.delay_after_s for hop in chain.hops[:-1])
        return cls(chain.chain_id, chain.kind, chain.tier, chain.arrival_s, chain.slo_s, alone_s, delays)

    def finish(self, status: str, now: float) -> None:
        self.status = status
        self.latency_s = now - self.arrival_s if status == "ok" else None

    @property
    def slo_met(self) -> bool:
        return self.latency_s is not None and self.latency_s <= self.slo_s


@dataclass
class RunRecord:
    policy: str
    source: str  # simulator | live
    window_s: float
    workers: int
    chains: list[ChainRecord]
    preemptions: int = 0
    makespan_s: float = 0.0
    wall_s: float = 0.0


class Stats(BaseModel):
    chains: int
    completed: int
    shed: int
    latency_p50_s: float
    latency_p90_s: float
    latency_p99_s: float
    # Latency minus the chain's tool delays and think time: the part serving controls.
    serving_p50_s: float
    serving_p99_s: float
    slowdown_p50: float
    slowdown_p99: float
    slo_attainment: float
    goodput_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    prefix_hit_rate: float
    preemptions: int


class Summary(BaseModel):
    policy: str
    source: str
    workers: int
    window_s: float
    rate_per_s: float
    makespan_s: float
    wall_s: float
    overall: Stats
    tiers: dict[str, Stats]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (inf entries are misses and sort last); nan if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def stats(chains: list[ChainRecord], window_s: float, preemptions: int) -> Stats:
    latencies = [c.latency_s if c.latency_s is not None else math.inf for c in chains]
    slowdowns = [
        lat / c.alone_s if c.alone_s > 0 else math.inf for lat, c in zip(latencies, chains, strict=True)
    ]
    serving = [lat - c.delays_s for lat, c in zip(latencies, chains, strict=True)]
    ttfts = [t for c in chains for t in c.ttft_s]
    prompt = sum(c.prompt_tokens for c in chains)
    met = sum(1 for c in chains if c.slo_met)
    return Stats(
        chains=len(chains),
        completed=sum(1 for c in chains if c.status == "ok"),
        shed=sum(1 for c in chains if c.status == "shed"),
        latency_p50_s=percentile(latencies, 50),
        latency_p90_s=percentile(latencies, 90),
        latency_p99_s=percentile(latencies, 99),
        serving_p50_s=percentile(serving, 50),
        serving_p99_s=percentile(serving, 99),
        slowdown_p50=percentile(slowdowns, 50),
        slowdown_p99=percentile(slowdowns, 99),
        slo_attainment=met / len(chains) if chains else math.nan,
        goodput_per_s=met / window_s if window_s > 0 else math.nan,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        prefix_hit_rate=sum(c.cached_tokens for c in chains) / prompt if prompt else 0.0,
        preemptions=preemptions,
    )


def summarize(run: RunRecord) -> Summary:
    tiers = {
        tier: stats(
            [c for c in run.chains if c.tier == tier],
            run.window_s,
            sum(c.preemptions for c in run.chains if c.tier == tier),
        )
        for tier in TIER_ORDER
        if any(c.tier == tier for c in run.chains)
    }
    return Summary(
        policy=run.policy,
        source=run.source,
        workers=run.workers,
        window_s=run.window_s,
        rate_per_s=len(run.chains) / run.window_s if run.window_s else 0.0,
        makespan_s=run.makespan_s,
        wall_s=run.wall_s,
        overall=stats(run.chains, run.window_s, run.preemptions),
        tiers=tiers,
    )


class Comparison(BaseModel):
    """chain-aware against baseline on the same trace, with the issue's targets."""

    baseline: str
    candidate: str
    p99_ratio: float  # candidate / baseline, lower is better
    goodput_ratio: float  # candidate / baseline, higher is better
    realtime_attainment: float  # the candidate's
    targets: dict[str, bool]


def compare(base: Summary, cand: Summary) -> Comparison:
    def ratio(a: float, b: float) -> float:
        if b == 0 or math.isinf(b) or math.isnan(b):
            return math.nan if a == b or b == 0 else 0.0
        return a / b

    p99 = ratio(cand.overall.latency_p99_s, base.overall.latency_p99_s)
    goodput = ratio(cand.overall.goodput_per_s, base.overall.goodput_per_s)
    realtime = cand.tiers["realtime"].slo_attainment if "realtime" in cand.tiers else math.nan
    return Comparison(
        baseline=base.policy,
        candidate=cand.policy,
        p99_ratio=p99,
        goodput_ratio=goodput,
        realtime_attainment=realtime,
        targets={
            "p99 ratio <= 0.5": p99 <= 0.5,
            "realtime SLO attainment >= 99%": realtime >= 0.99,
            "goodput >= 1.5x baseline": goodput >= 1.5,
        },
    )
