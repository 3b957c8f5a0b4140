"""What a scheduling decision costs: CPU time of the queue + policy calls per hop, as the
cluster and the queue grow (`inferx sim --decision-cost`).

Only the scheduler's own work is timed -- `DispatchQueue.submit` (admission),
`assign` (one pass: order, worker choice, bookkeeping) and `finished` -- with the
very policy code the live scheduler runs; the simulated engines, the trace replay
and the event loop are not. Two measurements:

  * `replay`: a whole trace through `ClusterSim` at N workers (P pools). A hop's
    decision cost is its `submit`, its `finished` and its share of the `assign` pass
    that dispatched it; passes that dispatched nothing count in the total (so in
    `decisions_per_s`), not in any one hop's.
  * `steady`: a pool held at a given queue depth. Workers are filled until hops
    queue, then each cycle one running hop finishes, the next hop of its chain (or a
    new chain's first) is submitted and the queue assigns: about one hop in, one out.
    A cycle's cost is one hop's decision cost at that depth.

Times are the deciding thread's CPU time (`time.thread_time_ns`), so other processes
on the machine do not inflate them; compare figures from one machine.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferx.scheduling.policy import Policy
from inferx.scheduling.queue import DispatchQueue, QueuedHop, Rejected, WorkerSlots
from inferx.scheduling.views import TIER_BY_NAME, HopView
from inferx.sim.cluster import ClusterSim, sim_policy
from inferx.sim.profile import EngineProfile
from inferx.sim.trace import Trace, TraceChain


def _clock() -> int:
    # CPU time of this thread: what the decisions cost, whatever else the machine runs
    # (wall time on a shared 2-core box mostly measures the neighbours).
    return time.thread_time_ns()


class TimedQueue(DispatchQueue):
    """A `DispatchQueue` that records the CPU time of each decision call (ns)."""

    def __init__(self, policy: Policy, *, indexed: bool = True) -> None:
        super().__init__(max_queued_per_pool=1 << 30, policy=policy, indexed=indexed)
        self.hop_ns: dict[int, int] = {}  # hop seq -> its submit + finished + share of a pass
        self.pass_ns: list[int] = []
        self.total_ns = 0
        self.depth_sum = 0  # queued hops at each pass, summed (mean depth = / passes)
        self.depth_max = 0
        self.last_ns = 0

    def submit(
        self, pool: str, run_id: str, hop_id: str, now: float, view: HopView | None = None
    ) -> QueuedHop:
        start = _clock()
        try:
            hop = super().submit(pool, run_id, hop_id, now, view)
        finally:
            self.last_ns = _clock() - start
            self.total_ns += self.last_ns
        self.hop_ns[hop.seq] = self.last_ns
        return hop

    def assign(
        self, workers_by_pool: Mapping[str, Sequence[WorkerSlots]], now: float | None = None
    ) -> list[QueuedHop]:
        depth = sum(self.queued(pool) for pool in self.pools())
        start = _clock()
        assigned = super().assign(workers_by_pool, now)
        spent = _clock() - start
        self.total_ns += spent
        self.pass_ns.append(spent)
        self.depth_sum += depth
        self.depth_max = max(self.depth_max, depth)
        for hop in assigned:
            self.hop_ns[hop.seq] = self.hop_ns.get(hop.seq, 0) + spent // len(assigned)
        return assigned

    def finished(self, hop: QueuedHop, now: float | None = None, **outcome: Any) -> None:
        """`DispatchQueue.finished`, timed (whatever the hop's outcome carries)."""
        start = _clock()
        super().finished(hop, now, **outcome)
        spent = _clock() - start
        self.total_ns += spent
        self.hop_ns[hop.seq] = self.hop_ns.get(hop.seq, 0) + spent


@dataclass
class CostFigures:
    """Per-hop decision cost (µs) and what one scheduler partition sustains."""

    label: str
    workers: int
    pools: int
    hops: int
    p50_us: float
    p99_us: float
    mean_us: float
    decisions_per_s: float  # hops decided per second of decision time
    mean_depth: float  # queued hops (all pools) when a pass ran
    max_depth: int
    extra: dict[str, float] = field(default_factory=dict)


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _figures(
    label: str, workers: int, pools: int, per_hop_ns: Sequence[int], queue: TimedQueue
) -> CostFigures:
    hops = len(per_hop_ns)
    us = [ns / 1000 for ns in per_hop_ns]
    passes = len(queue.pass_ns)
    return CostFigures(
        label=label,
        workers=workers,
        pools=pools,
        hops=hops,
        p50_us=_percentile(us, 0.50),
        p99_us=_percentile(us, 0.99),
        mean_us=queue.total_ns / hops / 1000 if hops else 0.0,
        decisions_per_s=hops / (queue.total_ns / 1e9) if queue.total_ns else 0.0,
        mean_depth=queue.depth_sum / passes if passes else 0.0,
        max_depth=queue.depth_max,
    )


def replay(
    trace: Trace,
    workers: int,
    pools: int = 1,
    policy: str = "chain-aware",
    profile: EngineProfile | None = None,
    indexed: bool = True,
) -> CostFigures:
    """Replay `trace` in the simulator and time the scheduler's calls."""
    queues: list[TimedQueue] = []

    def factory(p: Policy) -> DispatchQueue:
        queues.append(TimedQueue(p, indexed=indexed))
        return queues[-1]

    profile = profile or EngineProfile()
    sim = ClusterSim(trace, sim_policy(policy, profile), profile, workers, pools=pools, queue_factory=factory)
    started = time.perf_counter()
    result = sim.run()
    queue = queues[0]
    dispatched = [ns for seq, ns in queue.hop_ns.items()]
    figures = _figures("replay", workers, pools, dispatched, queue)
    figures.extra = {
        "chains": float(len(trace.chains)),
        "completed": float(sum(1 for c in result.chains if c.status == "ok")),
        "sim_wall_s": time.perf_counter() - started,
        "decision_wall_s": queue.total_ns / 1e9,
        "max_chains_under_way": float(_max_under_way(result.chains)),
    }
    return figures


def _max_under_way(chains: Sequence) -> int:
    """Most chains between their arrival and their end at once."""
    edges = []
    for c in chains:
        if c.latency_s is not None:
            edges += [(c.arrival_s, 1), (c.arrival_s + c.latency_s, -1)]
    best = under_way = 0
    for _, step in sorted(edges):
        under_way += step
        best = max(best, under_way)
    return best


def steady(
    chains: Sequence[TraceChain],
    workers: int,
    depth: int,
    cycles: int = 2000,
    policy: str = "chain-aware",
    profile: EngineProfile | None = None,
    seed: int = 1,
    indexed: bool = True,
) -> CostFigures:
    """One pool of `workers` held at about `depth` queued hops; `cycles` finish +
    submit + assign rounds timed (hop shapes and tiers from `chains`)."""
    profile = profile or EngineProfile()
    rng = random.Random(seed)
    queue = TimedQueue(sim_policy(policy, profile), indexed=indexed)
    pool = "steady"
    slots = {
        pool: tuple(
            WorkerSlots(f"w{i}", profile.max_num_seqs, profile.kv_capacity_tokens) for i in range(workers)
        )
    }
    running: list[QueuedHop] = []
    next_hop: dict[str, int] = {}  # chain id -> its next call
    specs = {c.chain_id: c for c in chains}
    fresh = iter(range(1 << 62))
    now = 0.0

    def submit_next(chain: TraceChain, name: str) -> None:
        k = next_hop.get(name, 0)
        if k >= len(chain.hops):
            chain = specs[rng.choice(list(specs))]
            name, k = f"{chain.chain_id}.{next(fresh)}", 0
        next_hop[name] = k + 1
        specs[name] = chain
        view = HopView(
            pool,
            name,
            str(k),
            tier=TIER_BY_NAME[chain.tier],
            prompt_tokens=chain.prompt_tokens(k),
            max_tokens=chain.max_tokens(k),
            deadline=now + chain.slo_s,
            hop_index=k,
            remaining_hops=len(chain.hops) - k - 1,
            prefix_id=chain.shared_prefix if chain.shared_tokens else "",
            prefix_tokens=chain.shared_tokens,
        )
        try:
            queue.submit(pool, name, str(k), now, view)
        except Rejected:
            pass  # shed by admission control: a decision too (timed), nothing queued

    def assign() -> None:
        running.extend(queue.assign(slots, now))

    # Fill: new chains until `depth` hops wait (the workers are full by then).
    pick = list(specs.values())
    while queue.queued(pool) < depth:
        for _ in range(max(1, depth // 20)):  # not a pass per hop: filling is not measured
            chain = rng.choice(pick)
            submit_next(chain, f"{chain.chain_id}.{next(fresh)}")
        now += 0.001
        assign()
    queue.hop_ns.clear()
    queue.pass_ns.clear()
    queue.total_ns = queue.depth_sum = queue.depth_max = 0
    measured: list[int] = []
    for _ in range(cycles):
        if not running:
            break
        now += 0.001
        hop = running.pop(rng.randrange(len(running)))
        before = queue.total_ns
        queue.finished(hop, now, context_tokens=hop.view.prompt_tokens + 200, service_s=1.0)
        chain = specs[hop.run_id]
        submit_next(chain, hop.run_id)
        assign()
        measured.append(queue.total_ns - before)
    figures = _figures(f"steady {depth}", workers, 1, measured, queue)
    figures.decisions_per_s = len(measured) / (queue.total_ns / 1e9) if queue.total_ns else 0.0
    figures.mean_us = queue.total_ns / len(measured) / 1000 if measured else 0.0
    return figures
