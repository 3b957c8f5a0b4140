"""Per-pool hop queues and worker slots: which queued hop goes to which worker next.

Pure: no I/O and no clock of its own. The scheduler service (and the simulator)
calls `submit`, then `assign` whenever something changes (a hop arrived, a hop
finished, the worker set changed), and `finished` when a hop leaves a worker. The
decisions (admission, order, worker choice, engine priority) belong to a `Policy`;
this class keeps the books: queues, in-flight hops and KV estimates per worker.
The default policy is `baseline` (FCFS, round-robin), the service's is chain-aware.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast, runtime_checkable

from inferx.scheduling.engine_fit import EngineSample
from inferx.scheduling.policy import BaselinePolicy, Policy
from inferx.scheduling.views import TIER_NAMES, HopView, PoolWorkers, QueuedHop, WorkerSlots, WorkerView

__all__ = ["DispatchQueue", "QueueFull", "Rejected", "QueuedHop", "WorkerSlots"]


class QueueFull(Exception):
    """The pool's queue is at its bound; the caller should retry later."""


class Rejected(Exception):
    """The policy's admission control refused the hop (load shedding)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@runtime_checkable
class ReportsChanges(Protocol):
    """What a policy tells the queue so that it may skip a pool's pass (see
    `DispatchQueue`); `ChainAwarePolicy` implements it."""

    def pass_stamp(self, pool: str) -> Hashable | None:
        """Changes whenever anything its answers for the pool's hops depend on, other
        than the time, may have changed; None: it cannot tell (never skip)."""
        ...

    def advance(self, now: float) -> None:
        """What `order` does with the time alone, for a pass that is skipped. Called at
        most once per `assign` (after a pass or another `advance` at the same time a
        second call must change nothing)."""
        ...

    def recheck_at(self, queued: QueuedHop, now: float) -> float | None:
        """The earliest time after `now` its answer for the hop may change with time
        alone (None: never); early is safe, late is a wrong decision."""
        ...

    def wake_times(self, queued: QueuedHop) -> list[float]:
        """`wake_at(queued, now)` is the least of these and `shared_wake()` after `now`."""
        ...

    def shared_wake(self) -> float | None: ...


@dataclass
class QuietPass:
    """A pool's last pass assigned nothing; until one of these changes, neither would
    the next one."""

    version: int  # the queue's version of the pool (its hops, its workers' load and set)
    stamp: Hashable  # the policy's `pass_stamp`
    recheck_at: float  # the earliest time some hop's answer may change with time alone
    wake_times: list[float]  # sorted: the hops' own times in `wake_at`


@dataclass
class PoolState:
    queue: deque[QueuedHop] = field(default_factory=deque)
    running: int = 0
    version: int = 0  # bumped when its queue or its workers' load or set change
    quiet: QuietPass | None = None


class DispatchQueue:
    """`indexed=False` hands the policy a fresh list of worker views at every call
    instead of the queue's `PoolWorkers`: the same decisions, found by scanning the
    pool (the reference the indexed path is tested against).

    `skip_idle_pools`: an `assign` call skips the pass over a pool whose last pass
    assigned nothing when nothing it depends on changed since -- no hop submitted or
    cancelled there, no load or worker change on its workers, the same policy stamp
    (its chains' state, its workers' held room), and no hop's answer due to change
    with time alone (`recheck_at`) -- because that pass would assign nothing again.
    It still does what the skipped pass would have done with the time (`advance`) and
    reports the same `next_wake`. Only with a policy that reports its changes
    (`ReportsChanges`) and indexed views; `False` passes over every pool every time
    (the reference the skipping is tested against)."""

    def __init__(
        self,
        max_queued_per_pool: int = 1024,
        policy: Policy | None = None,
        *,
        indexed: bool = True,
        skip_idle_pools: bool = True,
    ) -> None:
        self.max_queued_per_pool = max_queued_per_pool
        self.policy: Policy = policy or BaselinePolicy()
        self.indexed = indexed
        self.skip_idle_pools = skip_idle_pools and indexed and isinstance(self.policy, ReportsChanges)
        self.passes_skipped = 0  # pool passes skipped so far (for benchmarks)
        self._advanced = False  # this `assign` call has let the policy see the time
        self._pools: dict[str, PoolState] = {}
        self._workers: dict[str, Sequence[WorkerSlots]] = {}  # last known, for admission
        # Per pool, the views of its workers, kept up to date as hops start and finish
        # (rebuilt only when the worker set changes), and which pools a worker is in.
        self._views: dict[str, PoolWorkers] = {}
        self._member_of: dict[str, list[str]] = {}
        self._in_flight: dict[str, int] = {}
        self._kv_in_flight: dict[str, int] = {}
        self._dispatched: dict[str, int] = {}
        self._seq = itertools.count()
        self._now = 0.0
        # After `assign`: the earliest time a still-queued hop may go without any other
        # event (affinity patience, starvation bounds); the caller should assign again.
        self.next_wake: float | None = None

    @property
    def policy_name(self) -> str:
        return self.policy.name

    def submit(
        self, pool: str, run_id: str, hop_id: str, now: float, view: HopView | None = None
    ) -> QueuedHop:
        self._now = max(self._now, now)
        state = self._pools.setdefault(pool, PoolState())
        if len(state.queue) >= self.max_queued_per_pool:
            raise QueueFull(f"pool '{pool}' has {len(state.queue)} hops queued (the bound)")
        view = view or HopView(pool, run_id, hop_id)
        admission = self.policy.admit(view, self._policy_views(pool), state.queue, now)
        if not admission.accept:
            raise Rejected(admission.reason, admission.retry_after_s)
        hop = QueuedHop(view, now, next(self._seq))
        state.queue.append(hop)
        state.version += 1
        return hop

    def cancel(self, hop: QueuedHop) -> bool:
        """Drop a hop that is still queued (its caller went away)."""
        state = self._pools.get(hop.pool)
        if state is None or hop.worker_id is not None:
            return False
        try:
            state.queue.remove(hop)
        except ValueError:
            return False
        state.version += 1
        return True

    def worker_views(self, pool: str) -> list[WorkerView]:
        return list(self.pool_workers(pool))

    def pool_workers(self, pool: str) -> PoolWorkers:
        """The pool's workers as last registered, with their current load."""
        views = self._views.get(pool)
        if views is None:
            views = self._views[pool] = PoolWorkers(pool)
        return views

    def _policy_views(self, pool: str) -> PoolWorkers | list[WorkerView]:
        views = self.pool_workers(pool)
        return views if self.indexed else list(views)

    def _set_workers(self, workers_by_pool: Mapping[str, Sequence[WorkerSlots]]) -> None:
        """Rebuild the views of the pools whose worker set (or slots) changed."""
        changed = False
        for pool, workers in workers_by_pool.items():
            known = self._workers.get(pool)
            # A tuple passed again is unchanged (the simulator's); a list may have been
            # edited in place since, so it is compared.
            if known is not None and ((workers is known and isinstance(workers, tuple)) or workers == known):
                continue
            changed = True
            self._workers[pool] = workers if isinstance(workers, tuple) else list(workers)
            self._changed(pool)
            self._views[pool] = PoolWorkers(
                pool,
                [
                    WorkerView(
                        w.worker_id,
                        w.max_concurrency,
                        self._in_flight.get(w.worker_id, 0),
                        w.kv_capacity_tokens,
                        self._kv_in_flight.get(w.worker_id, 0),
                        w.host_kv_capacity_tokens,
                        w.host_kv_load_tokens_per_s,
                    )
                    for w in workers
                ],
            )
        for pool in [p for p in self._workers if p not in workers_by_pool]:
            changed = True
            self._changed(pool)
            del self._workers[pool]
            self._views.pop(pool, None)
        if changed:
            self._member_of = {}
            for pool, views in self._views.items():
                for view in views:
                    self._member_of.setdefault(view.worker_id, []).append(pool)

    def _changed(self, pool: str) -> None:
        state = self._pools.get(pool)
        if state is not None:
            state.version += 1

    def _load_changed(self, worker_id: str) -> None:
        in_flight = self._in_flight.get(worker_id, 0)
        kv = self._kv_in_flight.get(worker_id, 0)
        for pool in self._member_of.get(worker_id, ()):
            self._changed(pool)
            views = self._views[pool]
            old = views.get(worker_id)
            if old is not None:
                views.replace(old.with_load(in_flight, kv))

    def plan_ahead(self, view: HopView, until: float, now: float) -> str | None:
        """Hold room in `view.pool` for a chain's coming hop (the policy decides where)."""
        self._now = max(self._now, now)
        return self.policy.plan_ahead(view, self._policy_views(view.pool), until, self._now)

    def drop_ahead(self, view: HopView) -> None:
        self.policy.drop_ahead(view)

    def assign(
        self, workers_by_pool: Mapping[str, Sequence[WorkerSlots]], now: float | None = None
    ) -> list[QueuedHop]:
        """Move queued hops onto workers as the policy decides; returns the hops assigned."""
        now = self._now if now is None else max(self._now, now)
        self._now = now
        self._set_workers(workers_by_pool)
        assigned: list[QueuedHop] = []
        self.next_wake = None
        self._advanced = False
        for pool, state in self._pools.items():
            if not state.queue:
                continue
            views = self.pool_workers(pool)
            if not views.any_slot:
                continue
            if self._skip(pool, state, now):
                continue
            before = len(assigned)
            self._advanced = True  # `order` does it
            for hop in list(self.policy.order(state.queue, self._policy_views(pool), now)):
                worker_id = self.policy.choose_worker(hop, self._policy_views(pool), now)
                if worker_id is None or views.get(worker_id) is None:
                    continue
                hop.engine_priority = self.policy.engine_priority(hop, now)
                self._start(state, hop, worker_id, now)
                assigned.append(hop)
                if not views.any_slot:
                    break
            else:
                # Every worker kept a slot free: some hops wait on time, not on a slot.
                for hop in state.queue:
                    wake = self.policy.wake_at(hop, now)
                    if wake is not None and (self.next_wake is None or wake < self.next_wake):
                        self.next_wake = wake
                if self.skip_idle_pools and len(assigned) == before:
                    self._note_quiet(pool, state, now)
        return assigned

    def _skip(self, pool: str, state: PoolState, now: float) -> bool:
        """Whether the pool's pass may be skipped (see the class docstring); if so, what
        it would have done with the time is done and its `wake_at` times counted."""
        quiet = state.quiet
        if quiet is None:
            return False
        policy = cast(ReportsChanges, self.policy)  # checked once, in __init__ (a costly check)
        if not self._advanced:
            # As `order` would have: held room that came free is let go. Once per call:
            # again at the same time it changes nothing (see `ReportsChanges.advance`).
            policy.advance(now)
            self._advanced = True
        changed = quiet.version != state.version or policy.pass_stamp(pool) != quiet.stamp
        if changed or now >= quiet.recheck_at:
            state.quiet = None
            return False
        self.passes_skipped += 1
        # `next_wake` as the pass would have found it: the hops' own times still ahead,
        # and the policy's shared one.
        times = quiet.wake_times
        i = bisect.bisect_right(times, now)
        wake = times[i] if i < len(times) else None
        shared = policy.shared_wake()
        if shared is not None and shared > now and (wake is None or shared < wake):
            wake = shared
        if wake is not None and (self.next_wake is None or wake < self.next_wake):
            self.next_wake = wake
        return True

    def _note_quiet(self, pool: str, state: PoolState, now: float) -> None:
        """The pool's pass assigned nothing: note what would have to change for the
        next one to assign anything."""
        policy = cast(ReportsChanges, self.policy)
        stamp = policy.pass_stamp(pool)
        if stamp is None:
            return
        recheck = float("inf")
        for hop in state.queue:
            at = policy.recheck_at(hop, now)
            if at is not None and at < recheck:
                recheck = at
        times = sorted(t for hop in state.queue for t in policy.wake_times(hop))
        state.quiet = QuietPass(state.version, stamp, recheck, times)

    def _start(self, state: PoolState, hop: QueuedHop, worker_id: str, now: float) -> None:
        if state.queue and state.queue[0] is hop:
            state.queue.popleft()  # the common case, FCFS: O(1)
        else:
            state.queue.remove(hop)
        hop.worker_id = worker_id
        self._in_flight[worker_id] = self._in_flight.get(worker_id, 0) + 1
        self._kv_in_flight[worker_id] = self._kv_in_flight.get(worker_id, 0) + hop.view.kv_tokens
        hop.kv_at_dispatch = self._kv_in_flight[worker_id]
        self._dispatched[worker_id] = self._dispatched.get(worker_id, 0) + 1
        self._load_changed(worker_id)
        state.running += 1
        self.policy.on_dispatch(hop, worker_id, now)

    def finished(
        self,
        hop: QueuedHop,
        now: float | None = None,
        *,
        context_tokens: int = 0,
        service_s: float = 0.0,
        engine: EngineSample | None = None,
    ) -> None:
        """The hop left its worker (done, failed or cancelled); free its slot.
        `engine`: what the worker reported of its engine's speed, if anything; the
        policy gets it with the KV that ran beside the hop (`QueuedHop.engine_sample`)."""
        if hop.worker_id is None:
            return
        now = self._now if now is None else max(self._now, now)
        self._now = now
        count = self._in_flight.get(hop.worker_id, 0)
        self._in_flight[hop.worker_id] = max(0, count - 1)
        kv = self._kv_in_flight.get(hop.worker_id, 0)
        if engine is not None:  # the KV beside it, as it started and as it ends
            hop.engine_sample = EngineSample(  # built directly: `replace` costs ~5 us per hop
                engine.prefill_tokens,
                engine.ttft_s,
                engine.output_tokens,
                engine.decode_s,
                kv_in_flight=(hop.kv_at_dispatch + kv) // 2,
            )
        self._kv_in_flight[hop.worker_id] = max(0, kv - hop.view.kv_tokens)
        self._load_changed(hop.worker_id)
        state = self._pools.get(hop.pool)
        if state is not None:
            state.running = max(0, state.running - 1)
        self.policy.on_finish(hop, now, context_tokens, service_s)

    def drain_pool(self, pool: str) -> list[QueuedHop]:
        """Remove and return every queued hop of a pool (e.g. its last worker left)."""
        state = self._pools.get(pool)
        if state is None:
            return []
        hops = list(state.queue)
        state.queue.clear()
        state.version += 1
        return hops

    def queued_by_tier(self, pool: str) -> dict[str, int]:
        """Queued hops of `pool` per tier name (realtime, standard, batch)."""
        counts: dict[str, int] = {}
        state = self._pools.get(pool)
        for hop in state.queue if state else ():
            name = TIER_NAMES[hop.view.tier_rank]
            counts[name] = counts.get(name, 0) + 1
        return counts

    def queued(self, pool: str) -> int:
        state = self._pools.get(pool)
        return len(state.queue) if state else 0

    def running(self, pool: str) -> int:
        state = self._pools.get(pool)
        return state.running if state else 0

    def pools(self) -> list[str]:
        return sorted(self._pools)

    def in_flight(self, worker_id: str) -> int:
        return self._in_flight.get(worker_id, 0)

    def dispatched(self, worker_id: str) -> int:
        return self._dispatched.get(worker_id, 0)
