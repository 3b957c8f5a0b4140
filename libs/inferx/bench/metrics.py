"""Benchmark summaries, shared by simulator and live runs: what `inferx bench` prints
(per policy, overall and per tier) from each replay's `ReplayResult`
(`inferx.sim.records`), and the comparison with the reference policy.

A chain that was shed or failed counts as a miss everywhere: its latency is infinite
in the percentiles and it earns no goodput. Goodput is chains meeting their SLO per
second of the arrival window (the same window for every policy on a trace).
"""

from __future__ import annotations

import math

from pydantic import BaseModel

from inferx.sim.records import ChainRecord, ReplayResult
from inferx.stats import percentile

TIER_ORDER = ("realtime", "standard", "batch")


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
    preemptions: int | None  # None: not measured by this kind of replay


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
    engine: dict[str, dict[str, float]] | None = None  # ReplayResult.engine


def _pct(values: list[float], pct: float) -> float:
    # Nearest-rank: a miss (inf) is never blended with a finished chain, so a P99 is
    # infinite exactly when more than 1% of the chains missed (see inferx.stats).
    return percentile(values, pct, method="nearest-rank")


def stats(chains: list[ChainRecord], window_s: float, preemptions: int | None) -> Stats:
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
        latency_p50_s=_pct(latencies, 50),
        latency_p90_s=_pct(latencies, 90),
        latency_p99_s=_pct(latencies, 99),
        serving_p50_s=_pct(serving, 50),
        serving_p99_s=_pct(serving, 99),
        slowdown_p50=_pct(slowdowns, 50),
        slowdown_p99=_pct(slowdowns, 99),
        slo_attainment=met / len(chains) if chains else math.nan,
        goodput_per_s=met / window_s if window_s > 0 else math.nan,
        ttft_p50_s=_pct(ttfts, 50),
        ttft_p99_s=_pct(ttfts, 99),
        prefix_hit_rate=sum(c.cached_tokens for c in chains) / prompt if prompt else 0.0,
        preemptions=preemptions,
    )


def _tier_preemptions(chains: list[ChainRecord]) -> int | None:
    """The tier's preemptions, if every chain's count was measured (else None: a sum of
    some measured counts and some unknown ones would be a made-up figure)."""
    counts = [c.preemptions for c in chains]
    if any(n is None for n in counts):
        return None
    return sum(n for n in counts if n is not None)


def summarize(run: ReplayResult) -> Summary:
    tiers = {}
    for tier in TIER_ORDER:
        members = [c for c in run.chains if c.tier == tier]
        if members:
            tiers[tier] = stats(members, run.window_s, _tier_preemptions(members))
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
        engine=run.engine,
    )


def ratio_or_none(value: float, reference: float) -> float | None:
    """value / reference, or None when the reference is not a finite positive number
    (an infinite reference P99 would give 0, a zero one infinity: neither means
    anything) or the value is NaN."""
    if math.isnan(value) or not math.isfinite(reference) or reference <= 0:
        return None
    return value / reference


def undefined_p99(name: str, s: Stats) -> str | None:
    """Why `name`'s P99 cannot be a reference, or None if it can."""
    if s.chains == 0:
        return f"{name} ran no chains; P99 undefined"
    if math.isinf(s.latency_p99_s):
        failed = s.chains - s.completed - s.shed
        what = f"shed {s.shed} chains" + (f" and {failed} failed" if failed else "")
        if not s.shed:
            what = f"failed {failed} chains"
        return f"{name} {what} (of {s.chains}); P99 undefined"
    if s.latency_p99_s <= 0:
        return f"{name}'s P99 is {s.latency_p99_s:g} s; no ratio against it"
    return None


class Comparison(BaseModel):
    """A candidate policy against the reference (round-robin) on the same trace, with
    the issue's targets. A ratio is None when it is undefined (`notes` say why), and a
    target that depends on it is None ("undefined"), never met or not met."""

    baseline: str
    candidate: str
    p99_ratio: float | None  # candidate / baseline, lower is better
    goodput_ratio: float | None  # candidate / baseline, higher is better
    realtime_attainment: float | None  # the candidate's; None: no realtime chains
    baseline_shed: int
    baseline_failed: int
    notes: list[str]
    targets: dict[str, bool | None]


def compare(base: Summary, cand: Summary) -> Comparison:
    b, c = base.overall, cand.overall
    notes: list[str] = []
    p99 = ratio_or_none(c.latency_p99_s, b.latency_p99_s)
    if p99 is None:
        notes.append(undefined_p99(base.policy, b) or f"{cand.policy}'s P99 is undefined")
    elif math.isinf(p99):
        notes.append(f"{cand.policy}'s P99 is a miss: more than 1% of its chains were shed or failed")
    goodput = ratio_or_none(c.goodput_per_s, b.goodput_per_s)
    if goodput is None:
        notes.append(f"{base.policy} met no SLO (goodput {b.goodput_per_s:g}/s); goodput ratio undefined")
    realtime = cand.tiers["realtime"].slo_attainment if "realtime" in cand.tiers else None
    if realtime is None:
        notes.append("the trace has no realtime chains; realtime SLO attainment undefined")
    return Comparison(
        baseline=base.policy,
        candidate=cand.policy,
        p99_ratio=p99,
        goodput_ratio=goodput,
        realtime_attainment=realtime,
        baseline_shed=b.shed,
        baseline_failed=b.chains - b.completed - b.shed,
        notes=notes,
        targets={
            "p99 ratio <= 0.5": None if p99 is None else p99 <= 0.5,
            "realtime SLO attainment >= 99%": None if realtime is None else realtime >= 0.99,
            f"goodput >= 1.5x {base.policy}": None if goodput is None else goodput >= 1.5,
        },
    )
