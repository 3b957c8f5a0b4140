"""Per-pool hop queues and worker slots: which queued hop goes to which worker next.

Pure: no I/O and no clock of its own. The scheduler service calls `submit`, then
`assign` whenever something changes (a hop arrived, a hop finished, the worker set
changed), and `finished` when a hop leaves a worker.

Policy here is the foundation's: first come first served inside a pool, each hop to
the least-loaded worker (in-flight / max concurrency) that has a free slot.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field


class QueueFull(Exception):
    """The pool's queue is at its bound; the caller should retry later."""


@dataclass(frozen=True)
class WorkerSlots:
    worker_id: str
    max_concurrency: int


@dataclass(eq=False)
class QueuedHop:
    pool: str
    run_id: str
    hop_id: str
    enqueued_at: float
    seq: int = 0
    worker_id: str | None = None  # set once assigned


@dataclass
class PoolState:
    queue: deque[QueuedHop] = field(default_factory=deque)
    running: int = 0


class DispatchQueue:
    policy_name = "fcfs-least-loaded"

    def __init__(self, max_queued_per_pool: int = 1024) -> None:
        self.max_queued_per_pool = max_queued_per_pool
        self._pools: dict[str, PoolState] = {}
        self._in_flight: dict[str, int] = {}
        self._dispatched: dict[str, int] = {}
        self._seq = itertools.count()

    def submit(self, pool: str, run_id: str, hop_id: str, now: float) -> QueuedHop:
        state = self._pools.setdefault(pool, PoolState())
        if len(state.queue) >= self.max_queued_per_pool:
            raise QueueFull(f"pool '{pool}' has {len(state.queue)} hops queued (the bound)")
        hop = QueuedHop(pool, run_id, hop_id, now, next(self._seq))
        state.queue.append(hop)
        return hop

    def cancel(self, hop: QueuedHop) -> bool:
        """Drop a hop that is still queued (its caller went away)."""
        state = self._pools.get(hop.pool)
        if state is None or hop.worker_id is not None:
            return False
        try:
            state.queue.remove(hop)
            return True
        except ValueError:
            return False

    def assign(self, workers_by_pool: dict[str, list[WorkerSlots]]) -> list[QueuedHop]:
        """Move queued hops onto free worker slots; returns the hops just assigned."""
        assigned: list[QueuedHop] = []
        for pool, state in self._pools.items():
            workers = workers_by_pool.get(pool, [])
            while state.queue:
                worker = self._least_loaded_with_room(workers)
                if worker is None:
                    break
                hop = state.queue.popleft()
                hop.worker_id = worker.worker_id
                self._in_flight[worker.worker_id] = self._in_flight.get(worker.worker_id, 0) + 1
                self._dispatched[worker.worker_id] = self._dispatched.get(worker.worker_id, 0) + 1
                state.running += 1
                assigned.append(hop)
        return assigned

    def finished(self, hop: QueuedHop) -> None:
        if hop.worker_id is None:
            return
        count = self._in_flight.get(hop.worker_id, 0)
        self._in_flight[hop.worker_id] = max(0, count - 1)
        state = self._pools.get(hop.pool)
        if state is not None:
            state.running = max(0, state.running - 1)

    def drain_pool(self, pool: str) -> list[QueuedHop]:
        """Remove and return every queued hop of a pool (e.g. its last worker left)."""
        state = self._pools.get(pool)
        if state is None:
            return []
        hops = list(state.queue)
        state.queue.clear()
        return hops

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

    def _least_loaded_with_room(self, workers: list[WorkerSlots]) -> WorkerSlots | None:
        best: WorkerSlots | None = None
        best_load = 0.0
        for worker in workers:
            in_flight = self._in_flight.get(worker.worker_id, 0)
            capacity = max(worker.max_concurrency, 1)
            if in_flight >= capacity:
                continue
            load = in_flight / capacity
            # Ties go to the worker that has served fewer hops, spreading cold starts.
            if (
                best is None
                or load < best_load
                or (
                    load == best_load
                    and self._dispatched.get(worker.worker_id, 0) < self._dispatched.get(best.worker_id, 0)
                )
            ):
                best, best_load = worker, load
        return best
