"""Look-ahead KV reservations: room kept for a chain's next hop before it is submitted.

When a hop starts and the chain's next hop will run on another model's pool (a bigger
model, say) or needs a much longer context, the policy picks the worker that hop will
go to and holds room there, and the memory-pool backs the hold with a LOOKAHEAD
reservation under a lease (this scheduler is its holder). When the hop arrives, its
own reservation replaces the look-ahead one atomically, so it cannot be refused the
room kept for it. A hop that never comes (its router died, the chain failed) costs
the room only until the lease ends; a scheduler that dies loses its holds with its
etcd registration.

With a leased KV budget (`budget_sync.KvBudget`) the hold is reserved from it locally,
with the same lease, when it fits (no call; the hop then takes it over locally); only
what does not fit becomes a LOOKAHEAD reservation at the memory-pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import grpc

from inferx.discovery import ChannelPool, ServiceLocator
from inferx.scheduling.queue import DispatchQueue
from inferx.scheduling.views import HopKey, HopView, Tier
from inferx.v1 import memory_pool_pb2, memory_pool_pb2_grpc
from inferx.wire import tier_to_proto
from inferx_scheduler import metrics
from inferx_scheduler.budget import LOOKAHEAD
from inferx_scheduler.budget_sync import KvBudget

log = logging.getLogger("inferx.scheduler")


@dataclass(frozen=True)
class AheadHold:
    worker_id: str
    reservation_id: str
    expires_at: float  # monotonic
    local: bool = False  # reserved from the local budget, not at the memory-pool


class LookAhead:
    def __init__(
        self,
        queue: DispatchQueue,
        services: ServiceLocator,
        channels: ChannelPool,
        *,
        holder: str,
        lease_s: float,
        growth: float,
        budget: KvBudget | None = None,
    ) -> None:
        self._queue = queue
        self._services = services
        self._channels = channels
        self._holder = holder
        self._lease_s = lease_s
        self._growth = growth
        self._budget = budget
        self._held: dict[HopKey, AheadHold] = {}
        self._pending: set[HopKey] = set()  # being reserved (a re-dispatch must not repeat it)
        self._arrived: set[HopKey] = set()  # pending ones whose hop came first: released when made
        self._tasks: set[asyncio.Task[None]] = set()

    def wanted(self, hop: HopView, next_hops: list[HopView]) -> list[HopView]:
        """The next hops worth reserving for: in another pool, or with a context
        `growth` times this hop's."""
        current = max(hop.prompt_tokens, 1)
        return [
            nxt
            for nxt in next_hops
            if (nxt.pool != hop.pool or nxt.prompt_tokens >= self._growth * current)
            and nxt.key not in self._held
            and nxt.key not in self._pending
        ]

    def start(self, hop: HopView, next_hops: list[HopView], deadline_s: float | None) -> None:
        """The hop was dispatched: reserve for its successors in the background, so the
        hop itself does not wait for the memory-pool."""
        views = self.wanted(hop, next_hops)
        if not views:
            return
        lease = self._lease_s if deadline_s is None else max(min(self._lease_s, deadline_s), 0.1)
        self._pending.update(view.key for view in views)
        task = asyncio.create_task(self._reserve(views, lease))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reserve(self, views: list[HopView], lease_s: float) -> None:
        try:
            await self._reserve_each(views, lease_s)
        finally:
            self._pending.difference_update(view.key for view in views)
            self._arrived.difference_update(view.key for view in views)

    async def _reserve_each(self, views: list[HopView], lease_s: float) -> None:
        stub = None
        for view in views:
            now = time.monotonic()
            worker_id = self._queue.plan_ahead(view, now + lease_s, now)
            if worker_id is None:
                metrics.LOOKAHEAD.labels(view.pool, "no_room").inc()
                continue
            if self._budget is not None:
                local = self._budget.reserve(
                    worker_id,
                    view.kv_tokens,
                    kind=LOOKAHEAD,
                    protected=view.tier == Tier.REALTIME,
                    lease_s=lease_s,
                    run_id=view.run_id,
                    hop_id=view.hop_id,
                )
                if local is not None:
                    metrics.LOOKAHEAD.labels(view.pool, "reserved").inc()
                    if view.key in self._arrived:  # its hop came first and reserved for itself
                        self._budget.release(local.reservation_id)
                        self._late(view)
                        continue
                    self._held[view.key] = AheadHold(
                        worker_id, local.reservation_id, now + lease_s, local=True
                    )
                    continue
            if stub is None:
                address = self._services.pick("memory-pool")
                if address is None:
                    self._queue.drop_ahead(view)
                    return
                stub = memory_pool_pb2_grpc.MemoryPoolStub(self._channels.get(address))
            try:
                reply = await stub.Reserve(
                    memory_pool_pb2.ReserveRequest(
                        worker_id=worker_id,
                        tokens=view.kv_tokens,
                        run_id=view.run_id,
                        hop_id=view.hop_id,
                        tier=tier_to_proto(view.tier),
                        holder=self._holder,
                        lease_s=lease_s,
                        kind=memory_pool_pb2.RESERVATION_KIND_LOOKAHEAD,
                    ),
                    timeout=2.0,
                )
            except grpc.aio.AioRpcError as exc:
                self._queue.drop_ahead(view)
                metrics.LOOKAHEAD.labels(view.pool, "refused").inc()
                log.info("look-ahead for %s/%s refused: %s", view.run_id, view.hop_id, exc.details())
                continue
            metrics.LOOKAHEAD.labels(view.pool, "reserved").inc()
            if view.key in self._arrived:  # its hop came first and reserved for itself
                self._late(view)
                try:
                    await stub.Release(
                        memory_pool_pb2.ReleaseRequest(reservation_id=reply.reservation_id), timeout=2.0
                    )
                except grpc.aio.AioRpcError as exc:
                    log.info("release of late look-ahead %s failed (%s)", reply.reservation_id, exc.details())
                continue
            self._held[view.key] = AheadHold(worker_id, reply.reservation_id, time.monotonic() + lease_s)

    def _late(self, view: HopView) -> None:
        self._queue.drop_ahead(view)
        metrics.LOOKAHEAD.labels(view.pool, "late").inc()

    def take(self, hop: HopView) -> AheadHold | None:
        """The hop arrived: the hold kept for it, if any (its reservation is replaced).
        A look-ahead still being made for it is released as soon as it is made: the
        hop reserves for itself (it used to be held, unused, for the whole lease)."""
        if hop.key in self._pending:
            self._arrived.add(hop.key)
        now = time.monotonic()
        for key in [k for k, hold in self._held.items() if hold.expires_at <= now]:
            del self._held[key]
        return self._held.pop(hop.key, None)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
