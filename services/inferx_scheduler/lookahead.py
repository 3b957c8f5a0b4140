"""Look-ahead KV reservations: room kept for a chain's next hop before it is submitted.

When a hop starts and the chain's next hop will run on another model's pool (a bigger
model, say) or needs a much longer context, the policy picks the worker that hop will
go to and holds room there, and the memory-pool backs the hold with a LOOKAHEAD
reservation under a lease (this scheduler is its holder). When the hop arrives, its
own reservation replaces the look-ahead one atomically, so it cannot be refused the
room kept for it. A hop that never comes (its router died, the chain failed) costs
the room only until the lease ends; a scheduler that dies loses its holds with its
etcd registration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from inferx.discovery import ChannelPool, ServiceLocator
from inferx.scheduling.views import HopView
from inferx.tokens import estimate_tokens
from inferx.v1 import common_pb2, memory_pool_pb2, memory_pool_pb2_grpc, scheduler_pb2
from inferx_scheduler import metrics

if TYPE_CHECKING:
    from inferx_scheduler.servicer import HopDispatcher

log = logging.getLogger("inferx.scheduler")


@dataclass(frozen=True)
class AheadHold:
    worker_id: str
    reservation_id: str
    expires_at: float  # monotonic


class LookAhead:
    def __init__(
        self,
        dispatcher: HopDispatcher,
        services: ServiceLocator,
        channels: ChannelPool,
        *,
        holder: str,
        lease_s: float,
        growth: float,
    ) -> None:
        self._dispatcher = dispatcher
        self._services = services
        self._channels = channels
        self._holder = holder
        self._lease_s = lease_s
        self._growth = growth
        self._held: dict[tuple[str, str], AheadHold] = {}  # (run id, hop id) -> hold
        self._pending: set[tuple[str, str]] = set()  # being reserved (a re-dispatch must not repeat it)
        self._tasks: set[asyncio.Task[None]] = set()

    def wanted(self, pool: str, request: scheduler_pb2.HopRequest) -> list[HopView]:
        """The next hops worth reserving for: another pool, or a context `growth` times
        this hop's."""
        directory = self._dispatcher.directory
        ctx = request.context
        current = max(estimate_tokens(request.prompt), 1)
        views = []
        for nxt in ctx.next_hops:
            if not nxt.model or not directory.workers_for(nxt.model):
                continue
            next_pool = directory.pool_of(nxt.model)
            if next_pool == pool and nxt.prompt_tokens < self._growth * current:
                continue
            if (ctx.run_id, nxt.hop_id) in self._held or (ctx.run_id, nxt.hop_id) in self._pending:
                continue
            views.append(
                HopView(
                    pool=next_pool,
                    run_id=ctx.run_id,
                    hop_id=nxt.hop_id,
                    session_id=ctx.session_id,
                    tier=int(ctx.tier),
                    prompt_tokens=int(nxt.prompt_tokens),
                    max_tokens=nxt.max_tokens or 64,
                    hop_index=ctx.hop_index + 1,
                )
            )
        return views

    def start(self, pool: str, request: scheduler_pb2.HopRequest, deadline_s: float | None) -> None:
        """The hop was dispatched: reserve for its successors in the background, so the
        hop itself does not wait for the memory-pool."""
        views = self.wanted(pool, request)
        if not views:
            return
        lease = self._lease_s if deadline_s is None else max(min(self._lease_s, deadline_s), 0.1)
        self._pending.update((view.run_id, view.hop_id) for view in views)
        task = asyncio.create_task(self._reserve(views, request.context.tier, lease))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reserve(self, views: list[HopView], tier: int, lease_s: float) -> None:
        try:
            await self._reserve_each(views, tier, lease_s)
        finally:
            self._pending.difference_update((view.run_id, view.hop_id) for view in views)

    async def _reserve_each(self, views: list[HopView], tier: int, lease_s: float) -> None:
        address = self._services.pick("memory-pool")
        if address is None:
            return
        stub = memory_pool_pb2_grpc.MemoryPoolStub(self._channels.get(address))
        for view in views:
            now = time.monotonic()
            worker_id = self._dispatcher.queue.plan_ahead(view, now + lease_s, now)
            if worker_id is None:
                metrics.LOOKAHEAD.labels(view.pool, "no_room").inc()
                continue
            try:
                reply = await stub.Reserve(
                    memory_pool_pb2.ReserveRequest(
                        worker_id=worker_id,
                        tokens=view.kv_tokens,
                        run_id=view.run_id,
                        hop_id=view.hop_id,
                        tier=tier,
                        holder=self._holder,
                        lease_s=lease_s,
                        kind=memory_pool_pb2.RESERVATION_KIND_LOOKAHEAD,
                    ),
                    timeout=2.0,
                )
            except grpc.aio.AioRpcError as exc:
                self._dispatcher.queue.drop_ahead(view)
                metrics.LOOKAHEAD.labels(view.pool, "refused").inc()
                log.info("look-ahead for %s/%s refused: %s", view.run_id, view.hop_id, exc.details())
                continue
            self._held[(view.run_id, view.hop_id)] = AheadHold(
                worker_id, reply.reservation_id, time.monotonic() + lease_s
            )
            metrics.LOOKAHEAD.labels(view.pool, "reserved").inc()

    def take(self, context: common_pb2.HopContext) -> AheadHold | None:
        """The hop arrived: the hold kept for it, if any (its reservation is replaced)."""
        now = time.monotonic()
        for key in [k for k, hold in self._held.items() if hold.expires_at <= now]:
            del self._held[key]
        return self._held.pop((context.run_id, context.hop_id), None)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
