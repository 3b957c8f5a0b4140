"""Virtual-time replay of a trace through the scheduling policy and N simulated engines.

A discrete-event loop: chain arrivals, hops becoming ready after their tool delay,
and engine iterations ending. A chain whose calls form a DAG (`TraceHop.depends_on`)
has several calls in flight at once: a call is issued when every call it depends on
has finished and each one's delay has passed (`trace.ready_at`), and the chain ends
when all its calls did. Hops go through the same `DispatchQueue` + `Policy`
the live scheduler uses; each worker is an `EngineModel`. A multi-step decode plan is
cut short at the next step boundary when a new request reaches its worker, so the
result is what per-iteration simulation would give, only faster.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from inferx.scheduling.engine_fit import EngineSample, LearnsEngine
from inferx.scheduling.off_peak import OffPeakRule, off_peak_decision
from inferx.scheduling.policy import Policy
from inferx.scheduling.prefix_index import PrefixIndex, WorkerFeed
from inferx.scheduling.queue import DispatchQueue, QueuedHop, Rejected, WorkerSlots
from inferx.scheduling.registry import make_policy
from inferx.scheduling.views import TIER_BY_NAME, HopView
from inferx.sim.engine import EngineModel, Plan, SimRequest
from inferx.sim.estimates import RemainingPath
from inferx.sim.kv import Segment
from inferx.sim.profile import EngineProfile
from inferx.sim.records import ChainRecord, ReplayResult
from inferx.sim.trace import ChainProgress, Trace, TraceChain, TraceHop

POOL = "sim"
TICK_S = 0.01  # resolution of time-based re-evaluation (affinity patience, aging)


def hop_segments(
    chain: TraceChain, k: int, ancestors: Sequence[list[int]] | None = None
) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
    """Prompt and output segments of call k: the shared prefix, then the input and output
    of every call it depends on (transitively, in index order), then its own input.

    A key names a segment *and everything before it*. Call j's segments are keyed
    `{chain}/{j}i` and `{chain}/{j}o` where they follow exactly what they follow in call
    j's own prompt (j's ancestors); elsewhere (in a DAG's join, after a sibling branch)
    the key also names the calls before it, so equal keys always mean equal prefixes.

    `ancestors`: the chain's `ancestor_table()`, for a caller that asks for many calls
    (computing it per call made this the simulator's hot spot at scale)."""
    table = chain.ancestor_table() if ancestors is None else ancestors
    prompt = [Segment(chain.shared_prefix, chain.shared_tokens)] if chain.shared_tokens else []
    before = table[k]
    for position, j in enumerate(before):
        hop = chain.hops[j]
        scope = "" if before[:position] == table[j] else "@" + ",".join(map(str, before[:position]))
        prompt.append(Segment(f"{chain.chain_id}/{j}i{scope}", hop.new_tokens))
        prompt.append(Segment(f"{chain.chain_id}/{j}o{scope}", hop.output_tokens))
    prompt.append(Segment(f"{chain.chain_id}/{k}i", chain.hops[k].new_tokens))
    output = (Segment(f"{chain.chain_id}/{k}o", chain.hops[k].output_tokens),)
    return tuple(prompt), output


def alone_latency_s(chain: TraceChain, profile: EngineProfile) -> float:
    """The chain alone on an idle engine (the denominator of slowdown). A DAG's calls
    that are ready together run together on that one engine (batched)."""
    engine = EngineModel(profile)
    progress = ChainProgress(chain)
    ancestors = chain.ancestor_table()
    ready = [(0.0, k) for k in chain.roots()]  # a heap of (issue time, call)
    now = 0.0
    while not progress.done:
        if ready and engine.idle:
            now = max(now, ready[0][0])
        while ready and ready[0][0] <= now:
            k = heapq.heappop(ready)[1]
            progress.issue(k)
            prompt, output = hop_segments(chain, k, ancestors)
            engine.add(SimRequest(f"{k}", prompt, chain.hops[k].output_tokens, output_segments=output))
        plan = engine.plan()
        if plan is None:
            break  # nothing to run and nothing ready: cannot happen for a valid chain
        steps = plan.steps
        if ready and ready[0][0] < now + plan.duration_s:
            # A call is issued mid-plan: stop at the step in progress, then it joins.
            steps = min(steps, max(1, math.ceil((ready[0][0] - now) / plan.step_s)))
        now += plan.duration_s if steps == plan.steps else steps * plan.step_s
        for request in engine.commit(plan, steps, now).finished:
            for d, at in progress.finish(int(request.request_id), now):
                heapq.heappush(ready, (at, d))
    return now


def alone_latency_cached(chain: TraceChain, profile: EngineProfile) -> float:
    """`alone_latency_s`, remembered by the chain's content: a steady-state probe repeats
    a trace's chains many times (fresh ids, other arrival times), and simulating each
    alone was most of a probe's cost."""
    hops = tuple(
        (h.new_tokens, h.output_tokens, h.delay_after_s, h.max_tokens, h.depends_on and tuple(h.depends_on))
        for h in chain.hops
    )
    return _alone_by_content(profile, chain.shared_prefix, chain.shared_tokens, hops)


_HopKey = tuple[int, int, float, int | None, tuple[int, ...] | None]


@functools.lru_cache(maxsize=1 << 16)
def _alone_by_content(
    profile: EngineProfile, shared_prefix: str, shared_tokens: int, hops: tuple[_HopKey, ...]
) -> float:
    chain = TraceChain(
        chain_id="alone",
        kind="alone",
        tier="standard",
        arrival_s=0.0,
        slo_s=1.0,
        shared_prefix=shared_prefix,
        shared_tokens=shared_tokens,
        hops=[
            TraceHop(
                new_tokens=new,
                output_tokens=out,
                delay_after_s=delay,
                max_tokens=cap,
                depends_on=None if deps is None else list(deps),
            )
            for new, out, delay, cap, deps in hops
        ],
    )
    return alone_latency_s(chain, profile)


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
    progress: ChainProgress
    ready_at: dict[int, float] = field(default_factory=dict)  # when each call was issued
    gaps_seen: set[int] = field(default_factory=set)  # calls whose gap after was learned
    ancestors: list[list[int]] = field(default_factory=list)  # the spec's `ancestor_table()`


@dataclass
class _InFlight:
    chain: _Chain
    k: int  # the call's index in its chain
    queued: QueuedHop
    dispatched_at: float
    segments: tuple[tuple[Segment, ...], tuple[Segment, ...]]  # `hop_segments`: prompt, output


def sim_policy(name: str, profile: EngineProfile, options: dict[str, object] | None = None) -> Policy:
    """Policy `name` for a simulation on `profile`'s engines: told the engine's
    calibration (`EngineProfile.policy_options`) as an operator configures the live
    scheduler with it (`--engine-profile`), and so, as there, not learning it (unless
    `learn_engine=True`); `options` win over both."""
    told: dict[str, Any] = {**profile.policy_options(), "learn_engine": False, **(options or {})}
    return make_policy(name, **told)


def engine_figures(policy: Policy, pools: Iterable[str]) -> dict[str, dict[str, float]] | None:
    """Per pool, what a policy that learns its engines priced them with (None: it learns none)."""
    if not isinstance(policy, LearnsEngine):
        return None
    fits = {pool: policy.engine_fit(pool) for pool in sorted(pools)}
    figures = {pool: fit.figures() for pool, fit in fits.items() if fit is not None}
    return figures or None


@dataclass
class ClusterSim:
    trace: Trace
    policy: Policy
    profile: EngineProfile = field(default_factory=EngineProfile)
    workers: int = 4
    horizon_factor: float = 20.0  # give up on chains this many windows after the start
    # Replay each chain as a dynamic program, as the OpenAI front sees an agent: the
    # scheduler is told neither how many calls remain nor the expected rest of the path,
    # and not when the program ends (the router's idle end sends nothing). Off: a
    # declared chain (the router knows its DAG).
    programs: bool = False
    # Model pools: worker i serves pool i mod pools, and so does chain i of the trace
    # (several models behind one scheduler, each pool placed on its own).
    pools: int = 1
    # The queue the policy decides through; the decision-cost benchmark times its calls.
    queue_factory: Callable[[Policy], DispatchQueue] | None = None
    # A steady-state probe (`inferx.sim.steady`): only these chains count; the run ends
    # once every one of them has ended (the chains arriving after them only load the
    # system while they run). None: every chain counts, the run ends with the last.
    measured: frozenset[str] | None = None
    # With `measured`: stop as soon as more than (all, realtime) measured chains are
    # known to miss their SLO (finished late, shed, or still running at their deadline):
    # the probe cannot meet its targets any more, and an overloaded system's growing
    # queue is the slowest thing to simulate. None: run to the end.
    miss_budget: tuple[int, int] | None = None
    # Stop at this virtual time whatever is still running (a throughput measurement:
    # what finished by then is all it reads). None: no such stop.
    until_s: float | None = None
    # After `run`: time-driven passes (ticks) run, and ticks dropped because an earlier
    # one replaced them (for tests and benchmarks).
    ticks_run: int = field(default=0, init=False)
    ticks_dropped: int = field(default=0, init=False)
    # Off-peak batch (`inferx.scheduling.off_peak`): these chains' hops wait while their
    # pool is busy (or outside the rule's quiet hours, of a day of `day_s` virtual
    # seconds), never later than their deadline (arrival + SLO) allows. After `run`:
    # how many checks made a hop wait.
    off_peak: frozenset[str] = frozenset()
    off_peak_rule: OffPeakRule | None = None
    day_s: float = 86_400.0
    off_peak_waits: int = field(default=0, init=False)

    def pool_names(self) -> list[str]:
        return [POOL] if self.pools == 1 else [f"{POOL}-{p}" for p in range(self.pools)]

    def run(self, progress: Callable[[int], None] | None = None) -> ReplayResult:
        profile = self.profile
        if not 1 <= self.pools <= self.workers:
            raise ValueError(f"{self.pools} pools need at least as many workers (got {self.workers})")
        if self.queue_factory is not None:
            queue = self.queue_factory(self.policy)
        else:
            queue = DispatchQueue(max_queued_per_pool=1 << 30, policy=self.policy)
        workers = [_Worker(f"w{i}", EngineModel(profile)) for i in range(self.workers)]
        by_id = {w.worker_id: w for w in workers}
        # Each engine's KV events (entries stored / evicted) feed the index a scheduler
        # keeps from the workers' event streams; delivered at once (live, they lag by a
        # step and a network hop). Policies use it only when told to (`exact_prefix`).
        index = PrefixIndex()
        for w in workers:
            w.engine.kv.listener = WorkerFeed(index, w.worker_id)
        self.policy.use_prefix_index(index)
        names = self.pool_names()
        # Tuples: the queue takes an unchanged worker set for what it is without comparing.
        slots = {
            pool: tuple(
                WorkerSlots(
                    w.worker_id,
                    profile.max_num_seqs,
                    profile.kv_capacity_tokens,
                    profile.host_kv_capacity_tokens,
                    profile.host_load_tokens_per_s if profile.host_kv_capacity_tokens else 0.0,
                )
                for w in workers[p :: self.pools]
            )
            for p, pool in enumerate(names)
        }
        pool_of: dict[str, str] = {}  # chain id -> its pool
        events: list[tuple[float, int, str, object]] = []
        order = itertools.count()
        flights: dict[str, _InFlight] = {}
        # One pending tick, as the live dispatcher keeps one wake-up timer: a tick is
        # pushed when the queue asks to be woken earlier than the pending one (or none
        # is pending), and only the latest pushed is acted on. The ones it replaced stay
        # in the heap but are dropped when popped: acting on them would add passes the
        # queue never asked for, and each would push a tick of its own, so they would
        # pile up faster than the trace's events. (The comparison is on the tick's own
        # time, after the TICK_S floor: a wake-up earlier than the pending tick can still
        # fall after it, and must not replace it.)
        tick_at: float | None = None
        tick_gen = 0
        self.ticks_run = self.ticks_dropped = 0
        horizon = self.trace.window_s * self.horizon_factor
        chains: list[_Chain] = []
        measured = self.measured
        budget = self.miss_budget if measured is not None else None
        missed: set[str] = set()  # measured chains known to miss (with a budget)
        missed_realtime = 0
        for spec in self.trace.chains:
            record = ChainRecord.start(spec, alone_s=alone_latency_cached(spec, profile), profile=profile)
            record.preemptions = 0  # the simulator sees every preemption of every request
            chain = _Chain(spec, record, ChainProgress(spec), ancestors=spec.ancestor_table())
            pool_of[spec.chain_id] = names[len(chains) % len(names)]
            chains.append(chain)
            for k in spec.roots():
                heapq.heappush(events, (spec.arrival_s, next(order), "hop", (chain, k)))
            if budget is not None and spec.chain_id in measured:  # type: ignore[operator]
                heapq.heappush(events, (spec.arrival_s + spec.slo_s, next(order), "deadline", chain))
        done = 0
        measured_left = len(measured) if measured is not None else -1
        stop_reason: str | None = None

        def miss(chain: _Chain) -> None:
            """A measured chain is known to miss its SLO: past the budget, stop."""
            nonlocal missed_realtime, stop_reason
            if budget is None or chain.spec.chain_id in missed:
                return
            missed.add(chain.spec.chain_id)
            missed_realtime += chain.spec.tier == "realtime"
            if len(missed) > budget[0] or missed_realtime > budget[1]:
                stop_reason = "miss budget spent"

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
            nonlocal tick_at, tick_gen
            for queued in queue.assign(slots, now):
                flight = flights[f"{queued.run_id}:{queued.hop_id}"]
                flight.dispatched_at = now
                chain = flight.chain
                prompt, output = flight.segments
                request = SimRequest(
                    f"{queued.run_id}:{queued.hop_id}",
                    prompt,
                    chain.spec.hops[flight.k].output_tokens,
                    priority=queued.engine_priority,
                    output_segments=output,
                )
                deliver(by_id[queued.worker_id or ""], request, now)
            wake = queue.next_wake
            if wake is None:
                return
            at = max(wake, now + TICK_S)
            if tick_at is None or tick_at <= now or at < tick_at:
                tick_at = at
                tick_gen += 1
                push(at, "tick", tick_gen)

        def finish_chain(chain: _Chain, now: float, status: str) -> None:
            nonlocal done, measured_left, stop_reason
            chain.record.finish(status, now)
            if not self.programs:
                self.policy.on_chain_end(chain.spec.chain_id, now)
            done += 1
            if progress is not None:
                progress(done)
            if measured is not None and chain.spec.chain_id in measured:
                if not chain.record.slo_met:
                    miss(chain)
                measured_left -= 1
                if measured_left == 0 and stop_reason is None:
                    stop_reason = "every measured chain ended"

        learned = RemainingPath()  # what the policy may know of the rest: learned, not read ahead

        def program(spec: TraceChain) -> str:
            # What a live router learns per: a chain config, which has one tier. (Mixing
            # tiers would let the queueing of deferred batch chains inflate what a
            # realtime chain of the same kind expects.)
            return f"{spec.kind}/{spec.tier}"

        def hop_ready(chain: _Chain, k: int, now: float) -> None:
            spec = chain.spec
            if chain.record.status != "running":
                return  # shed while other calls of it were in flight
            for j in spec.deps(k):
                if j not in chain.gaps_seen:  # j's first dependent issued: the gap after j
                    chain.gaps_seen.add(j)
                    learned.gap_observed(program(spec), j, now - chain.progress.finished_at[j])
            chain.ready_at[k] = now
            hop_index, calls_left = chain.progress.issue(k)
            remaining_hops: int | None = calls_left
            structure = None if spec.is_sequence else [spec.deps(j) for j in range(len(spec.hops))]
            remaining = learned.remaining_s(program(spec), k, len(spec.hops), structure)
            if self.programs:
                remaining_hops, remaining = None, 0.0  # what the OpenAI front tells the scheduler
            pool = pool_of[spec.chain_id]
            segments = hop_segments(spec, k, chain.ancestors)
            view = HopView(
                pool,
                spec.chain_id,
                str(k),
                tier=TIER_BY_NAME[spec.tier],
                prompt_tokens=spec.prompt_tokens(k),
                max_tokens=spec.max_tokens(k),  # the request's cap: output lengths are unknown
                deadline=spec.arrival_s + spec.slo_s,
                hop_index=hop_index,  # calls of the chain finished so far
                remaining_critical_path_s=remaining,
                remaining_hops=remaining_hops,  # calls not yet issued after this one
                # What a router reads off the prompt: which shared prefix it starts with.
                prefix_id=spec.shared_prefix if spec.shared_tokens else "",
                prefix_tokens=spec.shared_tokens,
                # The prompt's segments as the engines key them: what hashing the prompt
                # text gives (live, the keys its worker reported for the chain's context).
                prompt_blocks=tuple((s.key, s.tokens) for s in segments[0] if s.key is not None),
            )
            try:
                queued = queue.submit(pool, spec.chain_id, str(k), now, view)
            except Rejected:
                finish_chain(chain, now, "shed")
                return
            flights[f"{spec.chain_id}:{k}"] = _InFlight(chain, k, queued, now, segments)
            dispatch(now)

        def step_done(worker: _Worker, now: float) -> None:
            assert worker.plan is not None
            result = worker.engine.commit(worker.plan, worker.steps, now)
            worker.plan = None
            for request in result.first_tokens:
                flight = flights[request.request_id]
                flight.chain.record.ttft_s.append(now - flight.chain.ready_at[flight.k])
            for request in result.finished:
                flight = flights.pop(request.request_id)
                chain = flight.chain
                first_token_at = request.first_token_at if request.first_token_at is not None else now
                queue.finished(
                    flight.queued,
                    now,
                    context_tokens=request.prompt_tokens + request.generated,
                    service_s=now - flight.dispatched_at,
                    # What a live worker reports on the hop's last chunk (usage, TTFT, engine time).
                    engine=EngineSample(
                        prefill_tokens=max(
                            request.prompt_tokens - request.cached_tokens - request.loaded_tokens, 0
                        ),
                        ttft_s=first_token_at - flight.dispatched_at,
                        output_tokens=request.generated,
                        decode_s=now - first_token_at,
                    ),
                )
                chain.record.prompt_tokens += request.prompt_tokens
                chain.record.cached_tokens += request.cached_tokens
                chain.record.loaded_tokens += request.loaded_tokens
                chain.record.preemptions = (chain.record.preemptions or 0) + request.preemptions
                k = flight.k
                learned.call_finished(program(chain.spec), k, now - chain.ready_at[k])
                for d, at in chain.progress.finish(k, now):
                    push(at, "hop", (chain, d))
                if chain.progress.done and chain.record.status == "running":
                    finish_chain(chain, now, "ok")
            start_plan(worker, now)
            if result.finished:
                dispatch(now)

        rule = self.off_peak_rule
        self.off_peak_waits = 0
        pool_workers = {pool: workers[p :: self.pools] for p, pool in enumerate(names)}

        def pool_load(pool: str) -> float:
            """KV the pool's running hops pin plus what its queued hops need, over its KV:
            what `(running + queued) / capacity` is live, with KV as the capacity."""
            members = pool_workers[pool]
            queued = sum(
                f.queued.view.kv_tokens
                for f in flights.values()
                if f.queued.worker_id is None and pool_of[f.chain.spec.chain_id] == pool
            )
            capacity = sum(w.engine.kv.capacity for w in members) or 1
            return (sum(w.engine.kv.pinned for w in members) + queued) / capacity

        def held(chain: _Chain, k: int, now: float) -> bool:
            """An off-peak chain's hop that must wait: asked again `recheck_s` later."""
            spec = chain.spec
            if rule is None or spec.chain_id not in self.off_peak or chain.record.status != "running":
                return False
            decision = off_peak_decision(
                rule,
                now_s=now,
                hour_of_day=(now % self.day_s) / self.day_s * 24,
                load=pool_load(pool_of[spec.chain_id]),
                deadline_s=spec.arrival_s + spec.slo_s,
                remaining_s=chain.record.alone_s,
            )
            if decision.go:
                return False
            self.off_peak_waits += 1
            push(now + rule.recheck_s, "hop", (chain, k))
            return True

        now = 0.0
        while events and stop_reason is None:
            now, _, kind, payload = heapq.heappop(events)
            if self.until_s is not None and now > self.until_s:
                stop_reason = "reached its end time"
                break
            if now > horizon:
                break
            if kind == "deadline":
                chain = cast(_Chain, payload)
                if chain.record.status == "running":
                    miss(chain)
            elif kind == "hop":
                chain, k = cast(tuple[_Chain, int], payload)
                if not held(chain, k, now):
                    hop_ready(chain, k, now)
            elif kind == "step":
                worker, version = cast(tuple[_Worker, int], payload)
                if version == worker.version:
                    step_done(worker, now)
            elif payload == tick_gen:
                self.ticks_run += 1
                dispatch(now)
            else:
                self.ticks_dropped += 1
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
            engine=engine_figures(self.policy, names),
            stopped=stop_reason,
        )
