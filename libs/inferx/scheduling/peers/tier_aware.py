"""Tier-aware peers: what a vLLM user who knows their chains' tiers deploys without InferX.

* `tier-priority`: session affinity (vllm-router `consistent_hash`, as
  `session-affinity`) in front of engines started with `--scheduling-policy priority`,
  each request sent with its tier as the priority (realtime 0, standard 1, batch 2). The
  engine admits waiting requests in priority order and preempts the lowest priority
  first under memory pressure; this scheduler's queue stands in for the engines' waiting
  queues, so it is ordered the same way (tier, then arrival).
* `tier-pools`: realtime traffic on dedicated workers, the other tiers on the rest (two
  deployments behind one gateway, routed by a tier header). `realtime_share` of the
  pool's workers (at least one, and at least one left for the others) serve realtime
  chains only; within each side, session affinity. FCFS, no shedding, prefix caching
  on, as every peer.

Neither knows more than the live system would: a hop's tier and chain key.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from inferx.scheduling.peers.session_affinity import SessionAffinityPolicy
from inferx.scheduling.registry import register_policy
from inferx.scheduling.views import QueuedHop, Tier, WorkerView

# vLLM's priority: lower runs first.
ENGINE_PRIORITY = {Tier.REALTIME: 0, Tier.STANDARD: 1, Tier.BATCH: 2}


class TierPriorityPolicy(SessionAffinityPolicy):
    name = "tier-priority"

    def order(
        self, queued: Sequence[QueuedHop], workers: Sequence[WorkerView], now: float
    ) -> Iterable[QueuedHop]:
        return sorted(queued, key=lambda q: (q.view.tier_rank, q.enqueued_at, q.seq))

    def engine_priority(self, queued: QueuedHop, now: float) -> int:
        return ENGINE_PRIORITY[queued.view.tier_rank]


class TierPoolsPolicy(SessionAffinityPolicy):
    name = "tier-pools"

    def __init__(self, realtime_share: float = 0.25, load_factor: float = 1.25, vnodes: int = 160) -> None:
        if not 0 < realtime_share < 1:
            raise ValueError("realtime_share must be between 0 and 1 (the share of workers for realtime)")
        super().__init__(load_factor, vnodes)
        self.realtime_share = realtime_share

    def split(self, workers: Sequence[WorkerView]) -> tuple[list[WorkerView], list[WorkerView]]:
        """(realtime workers, the others): the first share of the pool by worker id. A
        pool of one worker serves every tier on it."""
        ordered = sorted(workers, key=lambda w: w.worker_id)
        if len(ordered) < 2:
            return ordered, ordered
        dedicated = min(len(ordered) - 1, max(1, math.ceil(self.realtime_share * len(ordered))))
        return ordered[:dedicated], ordered[dedicated:]

    def ring_name(self, queued: QueuedHop) -> str:
        side = "realtime" if queued.view.tier_rank == Tier.REALTIME else "others"
        return f"{queued.pool}/{side}"  # each side's workers on a ring of their own

    def choose_worker(self, queued: QueuedHop, workers: Sequence[WorkerView], now: float) -> str | None:
        realtime, others = self.split(workers)
        side = realtime if queued.view.tier_rank == Tier.REALTIME else others
        return super().choose_worker(queued, side, now)


@register_policy(
    "tier-priority",
    summary="session affinity (consistent hashing, bounded loads) + the engine's priority by tier",
    imitates="vllm-router consistent_hash in front of vLLM --scheduling-policy priority (tier as priority)",
    options=("load_factor", "vnodes"),
)
def _tier_priority(
    time_scale: float = 1.0, load_factor: float = 1.25, vnodes: int = 160
) -> TierPriorityPolicy:
    return TierPriorityPolicy(load_factor, vnodes)


@register_policy(
    "tier-pools",
    summary="realtime chains on dedicated workers (realtime_share of the pool), the other tiers on "
    "the rest; session affinity within each",
    imitates="two vLLM deployments behind a gateway routing by tier, vllm-router consistent_hash in each",
    options=("realtime_share", "load_factor", "vnodes"),
)
def _tier_pools(
    time_scale: float = 1.0, realtime_share: float = 0.25, load_factor: float = 1.25, vnodes: int = 160
) -> TierPoolsPolicy:
    return TierPoolsPolicy(realtime_share, load_factor, vnodes)
