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
from typing import Protocol

from inferx.scheduling.registry import make_policy, policy_names, register_policy
from inferx.scheduling.views import ACCEPT, Admission, HopView, QueuedHop, WorkerView

__all__ = ["BaselinePolicy", "Policy", "RoundRobinPolicy", "make_policy", "policy_names"]


class Policy(Protocol):
    name: str

    def admit(
        self,
        hop: HopView,
        workers: Sequence[WorkerView],
        queued: Sequence[QueuedHop],
        now: float,
    ) -> Admission:
        """Called once when the hop arrives; a refusal means RESOURCE_EXHAUSTED."""
        ...

    def order(
        self, queued: Sequence[QueuedHop], workers: Sequence[WorkerView], now: float
    ) -> Iterable[QueuedHop]:
        """The pool's queued hops, most urgent first (one assignment pass)."""
        ...

    def wake_at(self, queued: QueuedHop, now: float) -> float | None:
        """When a hop left queued may be dispatched just because time passed (None:
        only an arrival, a finish or a worker change can dispatch it)."""
        ...

    def choose_worker(self, queued: QueuedHop, workers: Sequence[WorkerView], now: float) -> str | None:
        """The worker to run the hop now, or None to keep it queued for now."""
        ...

    def engine_priority(self, queued: QueuedHop, now: float) -> int:
        """The priority the engine orders by (lower first), set when dispatched."""
        ...

    def on_dispatch(self, queued: QueuedHop, worker_id: str, now: float) -> None: ...

    def on_finish(self, queued: QueuedHop, now: float, context_tokens: int, service_s: float) -> None:
        """The hop left its worker; `context_tokens` (prompt + output) now sit in that
        worker's prefix cache. Both are 0 when unknown (e.g. the hop failed)."""
        ...

    def plan_ahead(self, hop: HopView, workers: Sequence[WorkerView], until: float, now: float) -> str | None:
        """Hold room for a chain's coming hop (described by `hop`) until `until`; the
        worker chosen, or None (no room, or the policy does not look ahead)."""
        ...

    def drop_ahead(self, hop: HopView) -> None:
        """Let go of what `plan_ahead` held for the hop."""
        ...

    def on_chain_end(self, chain_key: str, now: float) -> None:
        """The chain will send no more hops (when the caller knows it)."""
        ...


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
