"""`inferx bench --overhead` (pure part): what one hop through the router and the
scheduler adds to a direct call of the worker, from raw samples.

Three paths run the same one-token model call on one SIMULATED sim worker whose engine
time is ~0 (a very high --sim-speed), so what is measured is the serving path:

  * `direct`: a client calls the worker's Generate (the gRPC floor of one hop);
  * `1-hop`:  the same call as a one-node chain through the router (RunChain), i.e.
              router -> scheduler -> (memory-pool) -> worker and back;
  * `N-hop`:  a chain of N such nodes, each depending on the one before;
  * `N-hop batched`: the same chain with every event, the ones ready together sent in
              one message (`RunChainRequest.batch_events`, what `InferxClient.
              run_chain` asks for): 5 messages instead of 9 for 4 hops;
  * `N-hop final`: the same chain asking for its result alone (`RunChainRequest.
              final_only`: one event per run instead of two per node), as a caller
              that waits for the answer (`inferx run`, most agent code) would.

Each path is measured twice: sequential latency (one call at a time, after a warm-up)
and closed-loop throughput (C callers, each starting its next call when the last one
ended). The figures derived here:

  * per hop p50/p99: the path's percentile divided by its hops;
  * added per hop vs direct: per hop p50/p99 minus the direct call's p50/p99, i.e.
    what the router and scheduler add to each hop on top of the worker call;
  * marginal hop: (p50 of N-hop - p50 of 1-hop) / (N - 1), the cost of one more hop
    in a chain; fixed chain cost: p50 of 1-hop minus one marginal hop (what a run
    costs once: RunChain, resolving the version, the run record).

No I/O here: `inferx.bench.overhead_run` measures, `inferx.cli.bench` prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from inferx.stats import percentile

MODEL = "overhead-sim"  # model name and pool of the one sim worker
PROMPT = "ping"  # one sim-engine token (4 characters)
DIRECT = "direct"


def path_name(hops: int, final_only: bool = False, batched: bool = False) -> str:
    if final_only:
        return f"{hops}-hop final"
    return f"{hops}-hop batched" if batched else f"{hops}-hop"


def chain_name(hops: int) -> str:
    return f"overhead_{hops}_hop"


def chain_yaml(hops: int, model: str = MODEL, node_timeout_ms: int = 10_000) -> str:
    """A chain of `hops` one-token model nodes, each depending on the one before (the
    prompt is constant, so every hop does the direct call's work)."""
    if hops < 1:
        raise ValueError("a chain needs at least one hop")
    slo_ms = node_timeout_ms * hops + 1_000
    lines = [
        "agent_chain:",
        f"  name: {chain_name(hops)}",
        f"  description: {hops} one-token model hops in sequence (inferx bench --overhead)",
        "  tier: standard",
        f"  slo: {{end_to_end_latency_p99: {slo_ms}ms}}",
        "  nodes:",
    ]
    for k in range(hops):
        lines += [
            f"    - id: hop{k}",
            "      type: model_inference",
            f"      model: {model}",
            f"      timeout: {node_timeout_ms}ms",
            "      max_tokens: 1",
            f"      prompt: {PROMPT}",
        ]
        if k:
            lines.append(f"      depends_on: [hop{k - 1}]")
    return "\n".join(lines) + "\n"


@dataclass
class PathSamples:
    """What was measured on one path (raw; saved before anything is derived)."""

    name: str
    hops: int
    latencies_ms: list[float] = field(default_factory=list)  # sequential, after the warm-up
    final_only: bool = False  # a chain path whose caller asked for the result event alone
    batched: bool = False  # a chain path whose caller asked for its events batched
    errors: int = 0  # sequential calls that failed (warm-up included)
    load_calls: int = 0  # closed-loop calls that succeeded
    load_errors: int = 0
    load_wall_s: float = 0.0
    concurrency: int = 0
    first_error: str = ""
    #: who called: "" the bench's own calls, "outside" a plain client in its own process
    #: (`inferx.bench.outside`), compared with its own direct call
    client: str = ""


@dataclass(frozen=True)
class PathSummary:
    name: str
    hops: int
    samples: int
    p50_ms: float
    p99_ms: float
    per_hop_p50_ms: float
    per_hop_p99_ms: float
    added_per_hop_p50_ms: float  # NaN for the direct path itself
    added_per_hop_p99_ms: float
    calls_per_s: float
    hops_per_s: float
    concurrency: int
    errors: int  # sequential + closed-loop
    final_only: bool = False
    batched: bool = False
    client: str = ""


@dataclass(frozen=True)
class OverheadSummary:
    paths: list[PathSummary]
    marginal_hop_p50_ms: float  # NaN without a 1-hop and an N-hop (N > 1) path
    fixed_chain_p50_ms: float
    errors: int


def _rate(calls: int, wall_s: float) -> float:
    return calls / wall_s if wall_s > 0 else math.nan


def summarize_path(samples: PathSamples, direct: PathSummary | None = None) -> PathSummary:
    """Percentiles (nearest rank) and rates of one path; `direct` gives the added cost."""
    if samples.hops < 1:
        raise ValueError(f"{samples.name}: hops must be at least 1")
    p50 = percentile(samples.latencies_ms, 50, method="nearest-rank")
    p99 = percentile(samples.latencies_ms, 99, method="nearest-rank")
    per_p50, per_p99 = p50 / samples.hops, p99 / samples.hops
    calls_per_s = _rate(samples.load_calls, samples.load_wall_s)
    return PathSummary(
        name=samples.name,
        hops=samples.hops,
        samples=len(samples.latencies_ms),
        p50_ms=p50,
        p99_ms=p99,
        per_hop_p50_ms=per_p50,
        per_hop_p99_ms=per_p99,
        added_per_hop_p50_ms=per_p50 - direct.p50_ms if direct else math.nan,
        added_per_hop_p99_ms=per_p99 - direct.p99_ms if direct else math.nan,
        calls_per_s=calls_per_s,
        hops_per_s=calls_per_s * samples.hops,
        concurrency=samples.concurrency,
        errors=samples.errors + samples.load_errors,
        final_only=samples.final_only,
        batched=samples.batched,
        client=samples.client,
    )


def summarize(paths: list[PathSamples]) -> OverheadSummary:
    """Every path against the `direct` one of its client (the bench's own `direct` must
    be there; an outside client's paths are compared with its own direct call when it
    made one), and the marginal and fixed costs from the bench's 1-hop and longest chain
    (both with every event, one message each: a final-only or batched path is the same
    chain with fewer messages, not another length)."""
    direct_samples = next((p for p in paths if p.name == DIRECT and not p.client), None)
    if direct_samples is None:
        raise ValueError("the direct path is the reference: it must be measured")
    references = {p.client: p for p in paths if p.name == DIRECT}
    directs = {client: summarize_path(p) for client, p in references.items()}
    summaries = [
        directs[p.client] if p.name == DIRECT else summarize_path(p, directs.get(p.client, directs[""]))
        for p in paths
    ]
    chains = [s for s in summaries if s.name != DIRECT and not (s.final_only or s.batched or s.client)]
    one = next((s for s in chains if s.hops == 1), None)
    longest = max(chains, key=lambda s: s.hops, default=None)
    marginal = fixed = math.nan
    if one is not None and longest is not None and longest.hops > 1:
        marginal = (longest.p50_ms - one.p50_ms) / (longest.hops - 1)
        fixed = one.p50_ms - marginal
    return OverheadSummary(
        paths=summaries,
        marginal_hop_p50_ms=marginal,
        fixed_chain_p50_ms=fixed,
        errors=sum(s.errors for s in summaries),
    )
