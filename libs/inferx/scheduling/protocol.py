"""The `Policy` protocol: the decisions a scheduling policy makes. Pure: no I/O, time is
passed in, so the live scheduler and the simulator run the very same decisions."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from inferx.scheduling.prefix_index import PrefixIndex
from inferx.scheduling.views import Admission, HopView, QueuedHop, WorkerView


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

    def use_prefix_index(self, index: PrefixIndex) -> bool:
        """Where the workers' prefix blocks are, kept current from their KV events; a
        policy that can use it (and is told to) places by it, else ignores it. True when
        it will read it (then hops should carry their `prompt_blocks`)."""
        ...
