"""`program-las`: program-level least attained service, Autellix's PLAS.

Imitates Autellix (Luo et al., "Autellix: An Efficient Serving Engine for LLM Agents as
General Programs", 2025) for single-threaded programs, which agent chains are:
  * Priority: the engine time the *program* (chain key: session, else run) has received
    so far, over all its finished calls plus the calls of it now running. Not
    clairvoyant: nothing about future calls or output lengths is used.
  * Discretized into multi-level queues (as Autellix does, to keep order stable and
    avoid thrashing): level i holds programs with attained service below
    quantum_s x growth^i; the last level holds the rest. FCFS within a level. The level
    is also the engine priority, so the engine (vLLM-style priority scheduling:
    admission in priority order, lowest priority preempted first under memory
    pressure) applies it too, as Autellix's engine-side scheduler does.
  * Anti-starvation: when a program's total waiting time (its calls' time queued here)
    reaches `starvation_ratio` x its attained service, its call moves to the top level
    (Autellix's W/T >= beta rule).
  * Data-locality-aware load balancing: a call whose prompt exceeds `locality_tokens`
    (2,048, Autellix's cut) goes to the worker that ran the program's previous call,
    where its context is cached, while that worker has a free slot; shorter calls (and
    programs without a worker yet) go to the least-loaded worker.
Differences: Autellix re-prioritizes running requests every engine iteration; here a
call's engine priority is fixed when it is dispatched, and waiting is counted only in
this scheduler's queue (the engine's own queue is not visible to a policy). The
quantum, growth and ratio are not published as defaults; ours are 1 s, x4, 5 levels
and 2.0. No shedding; engines keep prefix caching on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from inferx.scheduling.peers.base import FcfsPeer, least_loaded
from inferx.scheduling.registry import register_policy
from inferx.scheduling.views import QueuedHop, WorkerView


@dataclass
class Program:
    last_seen: float
    attained_s: float = 0.0  # engine time of its finished calls
    waited_s: float = 0.0  # time its calls spent queued here (dispatched ones)
    running: dict[int, float] = field(default_factory=dict)  # queued seq -> dispatched at
    workers: dict[str, str] = field(default_factory=dict)  # pool -> worker of its last call


class ProgramLasPolicy(FcfsPeer):
    name = "program-las"

    def __init__(
        self,
        quantum_s: float = 1.0,
        growth: float = 4.0,
        levels: int = 5,
        starvation_ratio: float = 2.0,
        locality_tokens: int = 2048,
        program_ttl_s: float = 600.0,
    ) -> None:
        if quantum_s <= 0 or growth <= 1 or levels < 1:
            raise ValueError("need quantum_s > 0, growth > 1, levels >= 1")
        self.bounds = [quantum_s * growth**i for i in range(levels - 1)]
        self.starvation_ratio = starvation_ratio
        self.locality_tokens = locality_tokens
        self.program_ttl_s = program_ttl_s
        self._programs: OrderedDict[str, Program] = OrderedDict()  # least recently seen first

    # ----- program state ----------------------------------------------------------------

    def program(self, key: str) -> Program | None:
        return self._programs.get(key)

    def _touch(self, key: str, now: float) -> Program:
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = Program(last_seen=now)
        program.last_seen = now
        self._programs.move_to_end(key)
        # Programs that never say they ended (live sessions) are forgotten when idle.
        while self._programs:
            old_key, old = next(iter(self._programs.items()))
            if now - old.last_seen <= self.program_ttl_s or old.running:
                break
            del self._programs[old_key]
        return program

    def attained(self, key: str, now: float) -> float:
        """Engine time received: finished calls plus the running ones so far."""
        program = self._programs.get(key)
        if program is None:
            return 0.0
        return program.attained_s + sum(now - t for t in program.running.values())

    def level(self, queued: QueuedHop, now: float) -> int:
        if self.starved(queued, now):
            return 0
        attained = self.attained(queued.view.chain_key, now)
        return next((i for i, bound in enumerate(self.bounds) if attained < bound), len(self.bounds))

    def starved(self, queued: QueuedHop, now: float) -> bool:
        key = queued.view.chain_key
        program = self._programs.get(key)
        past = program.waited_s if program is not None else 0.0
        waited = past + max(0.0, now - queued.enqueued_at)
        attained = self.attained(key, now)
        return attained > 0 and waited >= self.starvation_ratio * attained

    # ----- policy -----------------------------------------------------------------------

    def order(
        self, queued: Sequence[QueuedHop], workers: Sequence[WorkerView], now: float
    ) -> Iterable[QueuedHop]:
        return sorted(queued, key=lambda q: (self.level(q, now), q.enqueued_at, q.seq))

    def engine_priority(self, queued: QueuedHop, now: float) -> int:
        return self.level(queued, now)

    def wake_at(self, queued: QueuedHop, now: float) -> float | None:
        """When the hop's program crosses the starvation ratio by waiting alone."""
        key = queued.view.chain_key
        program = self._programs.get(key)
        if program is None or program.running:
            return None  # its attained service grows too: the other events re-evaluate
        attained = program.attained_s
        if attained <= 0:
            return None  # already in the top level
        at = queued.enqueued_at + self.starvation_ratio * attained - program.waited_s
        return at if at > now else None

    def choose_worker(self, queued: QueuedHop, workers: Sequence[WorkerView], now: float) -> str | None:
        hop = queued.view
        program = self._programs.get(hop.chain_key)
        home_id = program.workers.get(hop.pool) if program is not None else None
        if home_id is not None and hop.prompt_tokens > self.locality_tokens:
            home = next((w for w in workers if w.worker_id == home_id), None)
            if home is not None and home.has_slot:
                return home_id
        worker = least_loaded(workers)
        return worker.worker_id if worker is not None else None

    def on_dispatch(self, queued: QueuedHop, worker_id: str, now: float) -> None:
        program = self._touch(queued.view.chain_key, now)
        program.waited_s += max(0.0, now - queued.enqueued_at)
        program.running[queued.seq] = now
        program.workers[queued.pool] = worker_id

    def on_finish(self, queued: QueuedHop, now: float, context_tokens: int, service_s: float) -> None:
        program = self._programs.get(queued.view.chain_key)
        if program is None:
            return
        started = program.running.pop(queued.seq, None)
        if started is None:
            return
        # The caller's measure of engine time when it has one, else the time it ran.
        program.attained_s += service_s if service_s > 0 else max(0.0, now - started)
        program.last_seen = now
        self._programs.move_to_end(queued.view.chain_key)

    def on_chain_end(self, chain_key: str, now: float) -> None:
        self._programs.pop(chain_key, None)


@register_policy(
    "program-las",
    summary="program-level least attained service in multi-level queues (starvation ratio), "
    "locality for long prompts, else least-loaded",
    imitates="Autellix PLAS + its data-locality-aware load balancer",
    options=("quantum_s", "growth", "levels", "starvation_ratio", "locality_tokens", "program_ttl_s"),
)
def _program_las(time_scale: float = 1.0, **options: object) -> ProgramLasPolicy:
    # Service and waiting are measured on the workload's clock: a replay `time_scale`
    # times faster shrinks them all, so the quantum and the TTL shrink with them.
    quantum = float(options.pop("quantum_s", 1.0)) / time_scale  # type: ignore[arg-type]
    ttl = float(options.pop("program_ttl_s", 600.0)) / time_scale  # type: ignore[arg-type]
    return ProgramLasPolicy(quantum_s=quantum, program_ttl_s=ttl, **options)  # type: ignore[arg-type]
