"""Virtual-time replay of a trace through the scheduling policy and N simulated engines.

A discrete-event loop: chain arrivals, hops becoming ready after their tool delay,
and engine iterations ending. Hops go through the same `DispatchQueue` + `Policy`
the live scheduler uses; each worker is an `EngineModel`. A multi-step decode plan is
cut short at the next step boundary when a new request reaches its worker, so the
result is what per-iteration simulation would give, only faster.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from inferx.scheduling.policy import Policy
from inferx.scheduling.queue import DispatchQueue, QueuedHop, Rejected, WorkerSlots
from inferx.scheduling.views import TIER_BY_NAME, HopView
from inferx.sim.engine import EngineModel, Plan, SimRequest
from inferx.sim.estimates import RemainingPath
from inferx.sim.kv import Segment
from inferx.sim.profile import EngineProfile
from inferx.sim.records import ChainRecord, ReplayResult
from inferx.sim.trace import Trace, TraceChain

POOL = "sim"
TICK_S = 0.01  # resolution of time-based re-evaluation (affinity patience, aging)


def hop_segments(chain: TraceChain, k: int) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
    """Prompt and output segments of call k; keys name a prefix, so chain-scoped keys in
    a fixed order are enough."""
    prompt = [Segment(chain.shared_prefix, chain.shared_tokens)] if chain.shared_tokens else []
    for j, hop in enumerate(chain.hops[:k]):
        prompt.append(Segment(f"{chain.chain_id}/{j}i", hop.new_tokens))
        prompt.append(Segment(f"{chain.chain_id}/{j}o", hop.output_tokens))
    prompt.append(Segment(f"{chain.chain_id}/{k}i", chain.hops[k].new_tokens))
    output = (Segment(f"{chain.chain_id}/{k}o", chain.hops[k].output_tokens),)
    return tuple(prompt), output


def alone_latency_s(chain: TraceChain, profile: EngineProfile) -> float:
    """The chain alone on an idle engine (the denominator of slowdown)."""
    engine = EngineModel(profile)
    now = 0.0
    for k, hop in enumerate(chain.hops):
        prompt, output = hop_segments(chain, k)
        engine.add(SimRequest(f"{k}", prompt, hop.output_tokens, output_segments=output))
        while (plan := engine.plan()) is not None:
            now += plan.duration_s
            engine.commit(plan, plan.steps, now)
        now += hop.delay_after_s if k < len(chain.hops) - 1 else 0.0
    return now


@dataclass
class _Worker:
    worker_id: str
    engine: EngineModel
    plan: Plan | None = None
    started: float = 0.0
    steps: int = 0
    version: int = 0


@dataclass
class _Chain:
    spec: TraceChain
    record: ChainRecord
    ready_at: float = 0.0
    finished_at: float = 0.0  # when its last call finished
    hop: int = 0


@dataclass
class _InFlight:
    chain: _Chain
    queued: QueuedHop
    dispatched_at: float


@dataclass
class ClusterSim:
    trace: Trace
    policy: Policy
    profile: EngineProfile = field(default_factory=EngineProfile)
    workers: int = 4
    horizon_factor: float = 20.0  # give up on chains this many windows after the start

    def run(self, progress: Callable[[int], None] | None = None) -> ReplayResult:
        profile = self.profile
        queue = DispatchQueue(max_queued_per_pool=1 << 30, policy=self.policy)
        workers = [_Worker(f"w{i}", EngineModel(profile)) for i in range(self.workers)]
        by_id = {w.worker_id: w for w in workers}
        slots = {
            POOL: [
                WorkerSlots(w.worker_id, profile.max_num_seqs, profile.kv_capacity_tokens) for w in workers
            ]
        }
        events: list[tuple[float, int, str, object]] = []
        order = itertools.count()
        flights: dict[str, _InFlight] = {}
        tick_at: float | None = None
        horizon = self.trace.window_s * self.horizon_factor
        chains = []
        for spec in self.trace.chains:
            record = ChainRecord.start(spec, alone_s=alone_latency_s(spec, profile))
            record.preemptions = 0  # the simulator sees every preemption of every request
            chain = _Chain(spec, record)
            chains.append(chain)
            heapq.heappush(events, (spec.arrival_s, next(order), "hop", chain))
        done = 0

        def push(at: float, kind: str, payload: object) -> None:
            heapq.heappush(events, (at, next(order), kind, payload))

        def start_plan(worker: _Worker, now: float) -> None:
            worker.plan = worker.engine.plan()
            if worker.plan is None:
                return
            worker.started, worker.steps = now, worker.plan.steps
            worker.version += 1
            push(now + worker.plan.duration_s, "step", (worker, worker.version))

        def deliver(worker: _Worker, request: SimRequest, now: float) -> None:
            worker.engine.add(request)
            plan = worker.plan
            if plan is None:
                start_plan(worker, now)
            elif worker.steps > 1:
                # Cut the decode stretch at the step in progress; then the newcomer joins.
                steps = min(worker.steps, max(1, math.ceil((now - worker.started) / plan.step_s)))
                if steps < worker.steps:
                    worker.steps = steps
                    worker.version += 1
                    push(worker.started + steps * plan.step_s, "step", (worker, worker.version))

        def dispatch(now: float) -> None:
            nonlocal tick_at
            for queued in queue.assign(slots, now):
                flight = flights[f"{queued.run_id}:{queued.hop_id}"]
                flight.dispatched_at = now
                chain = flight.chain
                prompt, output = hop_segments(chain.spec, chain.hop)
                request = SimRequest(
                    f"{queued.run_id}:{queued.hop_id}",
                    prompt,
                    chain.spec.hops[chain.hop].output_tokens,
                    priority=queued.engine_priority,
                    output_segments=output,
                )
                deliver(by_id[queued.worker_id or ""], request, now)
            wake = queue.next_wake
            if wake is not None and (tick_at is None or wake < tick_at or tick_at <= now):
                tick_at = max(wake, now + TICK_S)
                push(tick_at, "tick", None)

        def finish_chain(chain: _Chain, now: float, status: str) -> None:
            nonlocal done
            chain.record.finish(status, now)
            self.policy.on_chain_end(chain.spec.chain_id, now)
            done += 1
            if progress is not None:
                progress(done)

        learned = RemainingPath()  # what the policy may know of the rest: learned, not read ahead

        def hop_ready(chain: _Chain, now: float) -> None:
            spec, k = chain.spec, chain.hop
            if k > 0:
                learned.gap_observed(spec.kind, k - 1, now - chain.finished_at)
            chain.ready_at = now
            remaining = learned.remaining_s(spec.kind, k, len(spec.hops))
            view = HopView(
                POOL,
                spec.chain_id,
                str(k),
                tier=TIER_BY_NAME[spec.tier],
                prompt_tokens=spec.prompt_tokens(k),
                max_tokens=spec.max_tokens(k),  # the request's cap: output lengths are unknown
                deadline=spec.arrival_s + spec.slo_s,
                hop_index=k,
                remaining_critical_path_s=remaining,
                remaining_hops=len(spec.hops) - 1 - k,
                # What a router reads off the prompt: which shared prefix it starts with.
                prefix_id=spec.shared_prefix if spec.shared_tokens else "",
                prefix_tokens=spec.shared_tokens,
            )
            try:
                queued = queue.submit(POOL, spec.chain_id, str(k), now, view)
            except Rejected:
                finish_chain(chain, now, "shed")
                return
            flights[f"{spec.chain_id}:{k}"] = _InFlight(chain, queued, now)
            dispatch(now)

        def step_done(worker: _Worker, now: float) -> None:
            assert worker.plan is not None
            result = worker.engine.commit(worker.plan, worker.steps, now)
            worker.plan = None
            for request in result.first_tokens:
                flight = flights[request.request_id]
                flight.chain.record.ttft_s.append(now - flight.chain.ready_at)
            for request in result.finished:
                flight = flights.pop(request.request_id)
                chain = flight.chain
                queue.finished(
                    flight.queued,
                    now,
                    context_tokens=request.prompt_tokens + request.generated,
                    service_s=now - flight.dispatched_at,
                )
                chain.record.prompt_tokens += request.prompt_tokens
                chain.record.cached_tokens += request.cached_tokens
                chain.record.preemptions = (chain.record.preemptions or 0) + request.preemptions
                delay = chain.spec.hops[chain.hop].delay_after_s
                learned.call_finished(chain.spec.kind, chain.hop, now - chain.ready_at)
                chain.finished_at = now
                chain.hop += 1
                if chain.hop == len(chain.spec.hops):
                    finish_chain(chain, now, "ok")
                else:
                    push(now + delay, "hop", chain)
            start_plan(worker, now)
            if result.finished:
                dispatch(now)

        now = 0.0
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if now > horizon:
                break
            if kind == "hop":
                hop_ready(payload, now)  # type: ignore[arg-type]
            elif kind == "step":
                worker, version = payload  # type: ignore[misc]
                if version == worker.version:
                    step_done(worker, now)
            else:
                dispatch(now)
        for chain in chains:
            if chain.record.status == "running":
                chain.record.finish("failed", now)
        return ReplayResult(
            policy=self.policy.name,
            source="simulator",
            window_s=self.trace.window_s,
            workers=self.workers,
            chains=[c.record for c in chains],
            preemptions=sum(w.engine.preemptions for w in workers),
            makespan_s=now,
        )
