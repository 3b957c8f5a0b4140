"""What one replay of a trace produces: a record per chain and the replay's result.

These live in the simulator package because the simulator produces them; the
benchmark layer (`inferx.bench`) summarizes them and also fills them from live
replays. The dependency runs one way only: `inferx.sim` never imports `inferx.bench`.

`ReplayResult` is one replay's raw results (one policy, one trace). It is not the
router's `RunRecord` (`inferx_router.records`), which is one stored chain run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inferx.sim.profile import EngineProfile
from inferx.sim.trace import TraceChain


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
    loaded_tokens: int = 0  # prompt tokens loaded back from a KV offload tier (simulator)
    # None: this replay cannot see the chain's preemptions (a live replay only learns a
    # worker's total). Reports must not print a count nobody measured as 0.
    preemptions: int | None = None

    @classmethod
    def start(cls, chain: TraceChain, alone_s: float, profile: EngineProfile | None = None) -> ChainRecord:
        """`profile` picks a DAG's critical path (whose delays no scheduler can save)."""
        delays = chain.delays_s(profile)
        return cls(chain.chain_id, chain.kind, chain.tier, chain.arrival_s, chain.slo_s, alone_s, delays)

    def finish(self, status: str, now: float) -> None:
        self.status = status
        self.latency_s = now - self.arrival_s if status == "ok" else None

    @property
    def slo_met(self) -> bool:
        return self.latency_s is not None and self.latency_s <= self.slo_s


@dataclass
class ReplayResult:
    """One replay of a trace with one policy: every chain's record and the run's totals."""

    policy: str
    source: str  # simulator | live ... | running stack ...
    window_s: float
    workers: int
    chains: list[ChainRecord]
    preemptions: int | None = None  # None: not measured (e.g. a stack we did not start)
    makespan_s: float = 0.0
    wall_s: float = 0.0
    # Per pool, the engine figures the policy priced time with at the end, as it learned
    # them (`inferx.scheduling.engine_fit`: prefill_tokens_per_s, kv_read_s_per_token);
    # None: a policy that learns none (or, live, a scheduler that exported none).
    engine: dict[str, dict[str, float]] | None = None
    # Why a simulated run ended before its last event (a steady-state probe: every
    # measured chain ended, or more of them missed than the targets allow); None: it ran out.
    stopped: str | None = None
