"""`session-affinity`: consistent hashing of the chain key (session id, else run id) onto
the pool's workers, with bounded loads.

Imitates vllm-project/router's `consistent_hash` policy (a session key hashed onto a
ring of 160 virtual nodes per worker) and llm-d's session-affinity scorer, with the
bounded-load fallback of "Consistent Hashing with Bounded Loads" (Mirrokni, Thorup,
Zadimoghaddam, SODA 2018) as HAProxy's `hash-balance-factor` and SGLang's
`prefix_hash_load_factor` (1.25) deploy it: a worker is full when placing the hop would
take its in-flight count past ceil(load_factor x (in-flight across the pool + 1) /
workers), and the hop walks the ring clockwise to the next worker that is not.
Differences from those systems: the key is the chain key the scheduler already has
(not a header or a hashed body), and load is the scheduler's exact in-flight count.
The queue is FCFS, nothing is shed, engines keep prefix caching on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from inferx.hashring import HashRing
from inferx.scheduling.peers.base import FcfsPeer, least_loaded
from inferx.scheduling.registry import register_policy
from inferx.scheduling.views import QueuedHop, WorkerView


class SessionAffinityPolicy(FcfsPeer):
    name = "session-affinity"

    def __init__(self, load_factor: float = 1.25, vnodes: int = 160) -> None:
        if load_factor < 1:
            raise ValueError("load_factor must be at least 1 (1 = perfectly balanced)")
        self.load_factor = load_factor
        self.vnodes = vnodes
        self._rings: dict[str, HashRing] = {}  # per pool: its workers change independently

    def bound(self, workers: Sequence[WorkerView]) -> int:
        """The most in-flight hops a worker may have after taking this one."""
        total = sum(w.in_flight for w in workers) + 1  # the hop being placed counts
        return math.ceil(self.load_factor * total / max(len(workers), 1))

    def ring_name(self, queued: QueuedHop) -> str:
        """Which ring the hop is placed on: one per pool (its workers change on their own)."""
        return queued.pool

    def choose_worker(self, queued: QueuedHop, workers: Sequence[WorkerView], now: float) -> str | None:
        if not workers:
            return None
        ring = self._rings.setdefault(self.ring_name(queued), HashRing(vnodes=self.vnodes))
        ring.set_members(w.worker_id for w in workers)  # no-op while membership is unchanged
        by_id = {w.worker_id: w for w in workers}
        bound = self.bound(workers)
        for worker_id in ring.walk(queued.view.chain_key):
            worker = by_id[worker_id]
            if worker.has_slot and worker.in_flight < bound:
                return worker_id
        # Only when every worker under the bound lacks a slot: any free slot will do.
        fallback = least_loaded(workers)
        return fallback.worker_id if fallback is not None else None


@register_policy(
    "session-affinity",
    summary="FCFS queue, consistent hashing of the chain key onto workers, bounded-load fallback",
    imitates="vllm-router consistent_hash / llm-d session affinity, with bounded loads (x1.25)",
    options=("load_factor", "vnodes"),
)
def _session_affinity(
    time_scale: float = 1.0, load_factor: float = 1.25, vnodes: int = 160
) -> SessionAffinityPolicy:
    return SessionAffinityPolicy(load_factor, vnodes)
