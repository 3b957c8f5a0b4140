"""What the peer policies share: an FCFS queue with no admission control, no look-ahead
and one engine priority (the engine is FCFS too), plus the least-loaded choice most of
them fall back to. Peers override only what defines them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from inferx.scheduling.prefix_index import PrefixIndex
from inferx.scheduling.views import ACCEPT, Admission, HopView, QueuedHop, WorkerView


def free_kv(worker: WorkerView) -> int:
    """KV not pinned by running hops (0 when the capacity is unknown)."""
    if not worker.kv_capacity_tokens:
        return 0
    return worker.kv_capacity_tokens - worker.kv_in_flight


def least_loaded(workers: Sequence[WorkerView]) -> WorkerView | None:
    """The worker with a free slot and the fewest in-flight hops; ties go to the one
    with the most free KV, then by id (deterministic)."""
    free = [w for w in workers if w.has_slot]
    if not free:
        return None
    return min(free, key=lambda w: (w.in_flight, -free_kv(w), w.worker_id))


class FcfsPeer:
    """Defaults for a peer: accept everything (peers do not shed), serve the queue in
    arrival order, never hold room ahead of a hop."""

    name = "fcfs-peer"

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
        return queued  # DispatchQueue keeps arrival order

    def wake_at(self, queued: QueuedHop, now: float) -> float | None:
        return None

    def choose_worker(self, queued: QueuedHop, workers: Sequence[WorkerView], now: float) -> str | None:
        worker = least_loaded(workers)
        return worker.worker_id if worker is not None else None

    def engine_priority(self, queued: QueuedHop, now: float) -> int:
        return 0

    def on_dispatch(self, queued: QueuedHop, worker_id: str, now: float) -> None:
        return None

    def on_finish(self, queued: QueuedHop, now: float, context_tokens: int, service_s: float) -> None:
        return None

    def plan_ahead(self, hop: HopView, workers: Sequence[WorkerView], until: float, now: float) -> str | None:
        return None

    def drop_ahead(self, hop: HopView) -> None:
        return None

    def on_chain_end(self, chain_key: str, now: float) -> None:
        return None

    def use_prefix_index(self, index: PrefixIndex) -> bool:
        return False
