"""The live side of the scheduler's KV budget (`budget.LocalBudget`): one background
task declares the budget wanted per worker to the memory-pool (`SyncBudget`) every
`sync_s` and whenever a reservation finds the budget low, reports what is reserved from
it, and applies the grants. Hops reserve and release through `reserve`/`release` with
no call; nothing here is on a hop's critical path.

One call at a time, each numbered (`seq`), so the pool applies them in order and a late
duplicate changes nothing. The budget stays with the memory-pool that granted it: when
that instance leaves etcd, what it granted is forgotten here before another one is asked.
A memory-pool that cannot be reached (or none registered) makes the scheduler
conservative (half concurrency), as a failed Reserve does; the budget already granted
is still used until its lease runs out, and hops beyond it go to the memory-pool (and,
when it cannot be reached, run unreserved at half concurrency, as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc

from inferx.discovery import ChannelPool, ServiceLocator
from inferx.metric_children import child
from inferx.v1 import memory_pool_pb2, memory_pool_pb2_grpc
from inferx_scheduler import metrics
from inferx_scheduler.budget import LocalBudget, LocalReservation, ReservationKind

log = logging.getLogger("inferx.scheduler.budget")

# A reservation that finds the budget low wakes the sync at once, but no more often
# than this (a pool with no room to grant would otherwise be asked on every hop).
MIN_GAP_S = 0.05
CALL_TIMEOUT_S = 2.0


class KvBudget:
    def __init__(
        self,
        services: ServiceLocator,
        channels: ChannelPool,
        *,
        holder: str,
        sync_s: float = 0.5,
        ttl_s: float = 0.0,
        on_reachable: Callable[[bool, str], None] = lambda ok, why: None,
        budget: LocalBudget | None = None,
    ) -> None:
        self.budget = budget or LocalBudget()
        self._services = services
        self._channels = channels
        self._holder = holder
        self._sync_s = sync_s
        self._ttl_s = ttl_s  # 0: the pool's default
        self._on_reachable = on_reachable
        self._seq = 0
        self._address: str | None = None  # the memory-pool whose grants we hold
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.supported = True  # False once a memory-pool answered UNIMPLEMENTED (older version)

    # ----- the hop path (no I/O) ------------------------------------------------------

    def reserve(
        self,
        worker_id: str,
        tokens: int,
        *,
        kind: ReservationKind,
        protected: bool = False,
        lease_s: float | None = None,
        replaces: str = "",
        run_id: str = "",
        hop_id: str = "",
    ) -> LocalReservation | None:
        res = self.budget.reserve(
            worker_id,
            tokens,
            time.monotonic(),
            kind=kind,
            protected=protected,
            lease_s=lease_s,
            replaces=replaces,
            run_id=run_id,
            hop_id=hop_id,
        )
        child(metrics.KV_RESERVATIONS, "budget" if res is not None else "beyond_budget", kind).inc()
        if self.budget.grow_wanted and self.supported:
            self._wake.set()
        return res

    def release(self, reservation_id: str) -> bool:
        return self.budget.release(reservation_id)

    # ----- the sync ----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-budget-sync")

    async def close(self) -> None:
        """Stop syncing and hand the budget back (best effort: if this call does not
        arrive, the lease or the end of our etcd registration returns it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._address is not None and self.supported:
            stub = memory_pool_pb2_grpc.MemoryPoolStub(self._channels.get(self._address))
            self._seq += 1
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.SyncBudget(
                    memory_pool_pb2.SyncBudgetRequest(holder=self._holder, seq=self._seq, ttl_s=self._ttl_s),
                    timeout=1.0,
                )

    async def _run(self) -> None:
        while self.supported:
            started = time.monotonic()
            try:
                await self.sync_once()
            except Exception:  # never let the loop die: the lease would lapse quietly
                log.exception("KV budget sync failed")
            # Sleep the period, or until a reservation finds the budget low.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._sync_s)
            self._wake.clear()
            await asyncio.sleep(max(0.0, MIN_GAP_S - (time.monotonic() - started)))

    def _pick(self) -> str | None:
        """The memory-pool that holds our budget while it is registered; another one
        (after forgetting what the old one granted) when it is gone."""
        live = [info.address for info in self._services.instances("memory-pool")]
        leader = self._services.leader("memory-pool")  # the one ledger, when they elect one
        if self._address in live and leader in (None, self._address):
            return self._address
        if self._address is not None:
            log.info("memory-pool %s left or lost the ledger: its KV budget is forgotten", self._address)
            self.budget.forget_grants()
            self._address = None
        address = self._services.pick("memory-pool")
        self._address = address
        return address

    async def sync_once(self) -> bool:
        """Declare, report, apply: one SyncBudget call. False when it failed."""
        address = self._pick()
        if address is None:
            self._on_reachable(False, "no memory-pool is registered")
            return False
        now = time.monotonic()
        rows = self.budget.begin_sync(now)
        self._seq += 1
        request = memory_pool_pb2.SyncBudgetRequest(holder=self._holder, seq=self._seq, ttl_s=self._ttl_s)
        for row in rows:
            request.workers.add(
                worker_id=row.worker_id,
                target_tokens=row.target_tokens,
                reserved_tokens=row.reserved_tokens,
                reservations=row.reservations,
                lookahead_tokens=row.lookahead_tokens,
                lookahead_reservations=row.lookahead_reservations,
            )
        stub = memory_pool_pb2_grpc.MemoryPoolStub(self._channels.get(address))
        try:
            reply = await stub.SyncBudget(request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            metrics.KV_BUDGET_SYNCS.labels("failed").inc()
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                # A memory-pool from before budgets: every hop reserves there, as before.
                log.warning("memory-pool %s has no SyncBudget: reserving every hop there", address)
                self.supported = False
                return False
            self._on_reachable(False, f"memory-pool: {exc.code().name}")
            return False
        metrics.KV_BUDGET_SYNCS.labels("ok").inc()
        self.budget.apply_grants(
            {grant.worker_id: grant.granted_tokens for grant in reply.workers},
            now,
            reply.ttl_s,
            engine_usage={grant.worker_id: grant.engine_kv_usage_ratio for grant in reply.workers},
            high_usage_ratio=reply.high_usage_ratio or None,
        )
        self._on_reachable(True, "")
        metrics.publish_budget(
            {w: (self.budget.granted(w), self.budget.used(w)) for w in self.budget.workers()}
        )
        return True
