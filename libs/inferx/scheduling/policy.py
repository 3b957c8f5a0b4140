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

from collections.abc import Sequence

from inferx.scheduling.peers.base import FcfsPeer
from inferx.scheduling.protocol import Policy
from inferx.scheduling.registry import make_policy, policy_names, register_policy
from inferx.scheduling.views import QueuedHop, WorkerView

__all__ = ["BaselinePolicy", "Policy", "RoundRobinPolicy", "make_policy", "policy_names"]


class RoundRobinPolicy(FcfsPeer):
    """FCFS + round-robin: classic serving behind a plain load balancer. Everything but
    the worker choice is the plain FCFS default (no admission control, no look-ahead,
    one engine priority)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}  # pool -> round-robin position

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


BaselinePolicy = RoundRobinPolicy  # the name this policy had first


@register_policy(
    "round-robin",
    aliases=("baseline",),
    summary="FCFS queue, round-robin over workers with a free slot; no affinity or tiers",
    imitates="a plain L4/L7 load balancer in front of vLLM replicas",
)
def _round_robin(time_scale: float = 1.0) -> RoundRobinPolicy:
    return RoundRobinPolicy()
