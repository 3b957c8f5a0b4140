"""Scheduling policies: which queued hop goes next, to which worker, and whether a hop
is admitted at all. Pure: no I/O, time is passed in, so the live scheduler and the
virtual-time simulator run the very same decisions.

`round-robin` (alias `baseline`) is what classic serving does: first come first served,
round-robin across the workers that have a free slot, no affinity, no admission
control, every request at the same engine priority (so the engine is FCFS too).
`chain-aware` (chain_aware.py) is the default. Policies are found by name through
`registry.py`; `make_policy` and `POLICY_NAMES` stay importable from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from inferx.scheduling.protocol import Policy
from inferx.scheduling.registry import make_policy, policy_names, register_policy
from inferx.scheduling.views import ACCEPT, Admission, HopView, QueuedHop, WorkerView

__all__ = ["BaselinePolicy", "Policy", "RoundRobinPolicy", "make_policy", "policy_names"]


class RoundRobinPolicy:
    """FCFS + round-robin: classic serving behind a plain load balancer."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}  # pool -> round-robin position

    def admit(
        self,
        hop: HopView,
        workers: Sequence[WorkerView],
        queued: Sequence[QueuedHop],
        now: float,
    ) -> Admission:
        return ACCEPT

    def order(
        self, queued: Sequence[QueuedHop], workers: Sequence[WorkerView], now: float
    ) -> Iterable[QueuedHop]:
        return queued  # the queue is kept in arrival order

    def wake_at(self, queued: QueuedHop, now: float) -> float | None:
        return None

    def choose_worker(self, queued: QueuedHop, workers: Sequence[WorkerView], now: float) -> str | None:
        if not workers:
            return None
        ordered = sorted(workers, key=lambda w: w.worker_id)
        start = self._next.get(queued.pool, 0)
        for offset in range(len(ordered)):
            index = (start + offset) % len(ordered)
            if ordered[index].has_slot:
                self._next[queued.pool] = index + 1
                return ordered[index].worker_id
        return None

    def engine_priority(self, queued: QueuedHop, now: float) -> int:
        return 0

    def on_dispatch(self, queued: QueuedHop, worker_id: str, now: float) -> None:
        return None

    def on_finish(self, queued: QueuedHop, now: float, context_tokens: int, service_s: float) -> None:
        return None

    def plan_ahead(self, hop: HopView, workers: Sequence[WorkerView], until: float, now: float) -> str | None:
        return None  # classic serving does not look ahead

    def drop_ahead(self, hop: HopView) -> None:
        return None

    def on_chain_end(self, chain_key: str, now: float) -> None:
        return None


BaselinePolicy = RoundRobinPolicy  # the name this policy had first


@register_policy(
    "round-robin",
    aliases=("baseline",),
    summary="FCFS queue, round-robin over workers with a free slot; no affinity or tiers",
    imitates="a plain L4/L7 load balancer in front of vLLM replicas",
)
def _round_robin(time_scale: float = 1.0) -> RoundRobinPolicy:
    return RoundRobinPolicy()
