"""`inferx-memory-pool`: the cluster-wide KV-capacity ledger the scheduler reserves from.

Schedulers lease a budget of KV tokens per worker (`SyncBudget`, every
--kv-budget-sync-s and when a budget runs low) and reserve hops from it locally; they
call `Reserve`/`Release` only for hops beyond their budget. The budget's holder is the
scheduler instance, so the rule below returns a dead scheduler's budget too; a budget
not renewed within --budget-ttl-s is returned as well.

One ledger: the memory-pool instances elect a leader under an etcd lease
(`/inferx/v1/partitions/memory-pool/*`, `inferx.partitions`); only the leader answers
Reserve, Release and SyncBudget, the others refuse them with FAILED_PRECONDITION naming
it, so a reservation and its release always meet one ledger. When the leader dies,
another instance takes over within the lease TTL with a fresh ledger: workers and their
engine usage it already mirrors; the schedulers' budgets, and what they reserved from
them, it learns at their next SyncBudget (each scheduler forgets the old leader's grants
and asks again); a hop reserved beyond its budget at the old leader is not known to the
new one (its engine usage is), and ends by itself.

Holders: a reservation may name its holder, the registered instance id of the
scheduler that made it. The pool mirrors the schedulers' registrations
(`/inferx/v1/services/scheduler/<instance-id>`) and drops a holder's reservations when
its registration goes away (its lease ended: it died). The rule is race-free because it
acts only on a transition the mirror saw: a holder is dropped only if the mirror saw it
registered and then saw it gone. A holder the mirror has never seen (its registration is
not mirrored yet, it is not a registered scheduler, or it came and went while the watch
was down) is never dropped this way; its reservations end by their lease like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

import grpc
from pydantic import Field

from inferx import etcd
from inferx.discovery import ChannelPool
from inferx.errors import InvalidArgument, NoOwner, NotFound, NotOwner, ResourceExhausted
from inferx.partitions import ALL_POOLS, PartitionElector
from inferx.pools import PoolDirectory
from inferx.server import ServiceComponent, ServiceRuntime, run_service
from inferx.settings import ServiceSettings
from inferx.v1 import common_pb2, memory_pool_pb2, memory_pool_pb2_grpc, worker_pb2, worker_pb2_grpc
from inferx_memory_pool import metrics
from inferx_memory_pool.ledger import (
    HOP,
    LOOKAHEAD,
    BudgetWant,
    InsufficientCapacity,
    KvLedger,
    ReservationKind,
    UnknownWorker,
)

log = logging.getLogger("inferx.memory_pool")

# Registrations of the services that hold reservations; the key's last segment is the id.
HOLDERS = etcd.SERVICES + "scheduler/"

KIND_FROM_PROTO: dict[int, ReservationKind] = {
    memory_pool_pb2.RESERVATION_KIND_UNSPECIFIED: HOP,
    memory_pool_pb2.RESERVATION_KIND_HOP: HOP,
    memory_pool_pb2.RESERVATION_KIND_LOOKAHEAD: LOOKAHEAD,
}
KIND_TO_PROTO: dict[ReservationKind, memory_pool_pb2.ReservationKind] = {
    HOP: memory_pool_pb2.RESERVATION_KIND_HOP,
    LOOKAHEAD: memory_pool_pb2.RESERVATION_KIND_LOOKAHEAD,
}


class MemoryPoolSettings(ServiceSettings):
    headroom_ratio: float = Field(
        0.2,
        ge=0.1,
        le=0.3,
        description="fraction of each worker's KV kept free for bursts (0.1-0.3)",
    )
    high_usage_ratio: float = Field(
        0.85, gt=0, le=1, description="engine KV usage above which only realtime work is admitted"
    )
    usage_poll_s: float = Field(1.0, gt=0, description="how often to read each worker's KV usage")
    reservation_ttl_s: float = Field(
        300.0, gt=0, description="a hop reservation not released expires after this (request lease_s 0)"
    )
    lookahead_lease_s: float = Field(
        30.0, gt=0, description="a look-ahead reservation not released expires after this (request lease_s 0)"
    )
    elect: bool = Field(
        True,
        description="instances elect one leader that holds the ledger (etcd lease); the others refuse "
        "Reserve, Release and SyncBudget naming it; off: answer every call (one instance only)",
    )
    budget_ttl_s: float = Field(
        10.0,
        gt=0,
        description="a scheduler's KV budget (SyncBudget) not renewed by then is returned; the default "
        "and the longest lease a scheduler may ask for",
    )


class MemoryPoolServicer(memory_pool_pb2_grpc.MemoryPoolServicer):
    def __init__(self, ledger: KvLedger, elector: PartitionElector | None = None) -> None:
        self.ledger = ledger
        self.calls: dict[str, int] = dict.fromkeys(metrics.METHODS, 0)  # answered, by method
        self._elector = elector

    async def _check_leader(self) -> None:
        """Only the elected leader's ledger answers: a reservation and its release must
        meet the same ledger, and two ledgers would each grant the same room."""
        elector = self._elector
        if elector is None or await elector.confirm(ALL_POOLS):
            return
        if elector.table.owner(ALL_POOLS) is None and await elector.campaign(ALL_POOLS):
            return
        owner = elector.table.owner(ALL_POOLS)
        if owner is None or owner.instance_id == elector.instance_id:
            raise NoOwner("no memory-pool holds the ledger yet (an election is under way); retry")
        raise NotOwner(
            f"memory-pool {elector.instance_id} does not hold the ledger: {owner.instance_id} at "
            f"{owner.address} does",
            owner_address=owner.address,
        )

    def _count(self, method: str) -> None:
        self.calls[method] += 1
        metrics.CALLS.labels(method).inc()

    def _publish(self) -> None:
        metrics.publish(self.ledger.snapshot(time.monotonic()))

    async def Reserve(self, request, context):
        await self._check_leader()
        self._count("Reserve")
        if request.tokens <= 0:
            raise InvalidArgument("tokens: must be positive")
        if not (math.isfinite(request.lease_s) and request.lease_s >= 0):
            raise InvalidArgument("lease_s: must be >= 0 and finite (0 = the pool's default)")
        kind = KIND_FROM_PROTO.get(request.kind)
        if kind is None:
            raise InvalidArgument(f"kind: unknown reservation kind {request.kind}")
        now = time.monotonic()
        try:
            res = self.ledger.reserve(
                request.worker_id,
                request.tokens,
                now,
                request.run_id,
                request.hop_id,
                protected=request.tier == common_pb2.TIER_REALTIME,
                holder=request.holder,
                lease_s=request.lease_s or None,
                kind=kind,
                replaces=request.replaces,
            )
        except UnknownWorker as exc:
            raise NotFound(str(exc)) from None
        except InsufficientCapacity as exc:
            metrics.RESERVATIONS.labels("refused", kind).inc()
            raise ResourceExhausted(str(exc), retry_after_s=0.5) from None
        metrics.RESERVATIONS.labels("granted", kind).inc()
        self._publish()
        return memory_pool_pb2.Reservation(
            reservation_id=res.reservation_id,
            worker_id=res.worker_id,
            tokens=res.tokens,
            kind=KIND_TO_PROTO[res.kind],
            expires_in_s=max(0.0, res.expires_at - now),
        )

    async def Release(self, request, context):
        await self._check_leader()
        self._count("Release")
        released = self.ledger.release(request.reservation_id)
        self._publish()
        return memory_pool_pb2.ReleaseResponse(released=released)

    async def SyncBudget(self, request, context):
        await self._check_leader()
        self._count("SyncBudget")
        if not request.holder:
            raise InvalidArgument("holder: must name the scheduler instance that holds the budget")
        if not (math.isfinite(request.ttl_s) and request.ttl_s >= 0):
            raise InvalidArgument("ttl_s: must be >= 0 and finite (0 = the pool's default)")
        wants = [
            BudgetWant(
                row.worker_id,
                row.target_tokens,
                row.reserved_tokens,
                row.reservations,
                row.lookahead_tokens,
                row.lookahead_reservations,
            )
            for row in request.workers
        ]
        ttl_s = min(request.ttl_s or self.ledger.budget_ttl_s, self.ledger.budget_ttl_s)
        grants = self.ledger.sync_budget(
            request.holder, wants, time.monotonic(), ttl_s=ttl_s, seq=request.seq
        )
        self._publish()
        reply = memory_pool_pb2.SyncBudgetReply(ttl_s=ttl_s, high_usage_ratio=self.ledger.high_usage_ratio)
        for worker_id, granted in grants.items():
            reply.workers.add(
                worker_id=worker_id,
                granted_tokens=granted,
                engine_kv_usage_ratio=self.ledger.engine_usage(worker_id),
            )
        return reply

    async def GetUsage(self, request, context):
        self._count("GetUsage")
        reply = memory_pool_pb2.PoolUsage(
            headroom_ratio=self.ledger.headroom_ratio, high_usage_ratio=self.ledger.high_usage_ratio
        )
        reply.calls.update(self.calls)
        for row in self.ledger.snapshot(time.monotonic()):
            reply.workers.add(
                worker_id=row.worker_id,
                pool=row.pool,
                capacity_tokens=row.capacity_tokens,
                reserved_tokens=row.reserved_tokens,
                usable_tokens=row.usable_tokens,
                reservations=row.reservations,
                engine_kv_usage_ratio=row.engine_usage_ratio,
                lookahead_tokens=row.lookahead_tokens,
                lookahead_reservations=row.lookahead_reservations,
                leased_tokens=row.leased_tokens,
                budget_holders=row.budget_holders,
            )
        return reply


class MemoryPoolComponent(ServiceComponent):
    service_names = (memory_pool_pb2.DESCRIPTOR.services_by_name["MemoryPool"].full_name,)

    def __init__(self, runtime: ServiceRuntime, settings: MemoryPoolSettings) -> None:
        self.elector = (
            PartitionElector(
                runtime.etcd,
                "memory-pool",
                instance_id=runtime.instance_id,
                address=runtime.address,
                ttl_s=settings.lease_ttl_s,
                wanted=frozenset({ALL_POOLS}),
                on_change=self._on_leadership,
            )
            if settings.elect
            else None
        )
        self._leading = False
        self.servicer = MemoryPoolServicer(
            KvLedger(
                settings.headroom_ratio,
                settings.reservation_ttl_s,
                settings.high_usage_ratio,
                lookahead_ttl_s=settings.lookahead_lease_s,
                budget_ttl_s=settings.budget_ttl_s,
            ),
            self.elector,
        )
        self.directory = PoolDirectory()
        self.workers = etcd.PrefixMirror(runtime.etcd, etcd.WORKERS, self._on_workers)
        self.holders = etcd.PrefixMirror(runtime.etcd, HOLDERS, self._on_holders)
        self._holders_seen: set[str] = set()  # registered holders as the mirror last saw them
        self.channels = ChannelPool(runtime.transport)
        self._poll_s = settings.usage_poll_s
        self._poller: asyncio.Task[None] | None = None
        memory_pool_pb2_grpc.add_MemoryPoolServicer_to_server(self.servicer, runtime.server)

    def _on_leadership(self) -> None:
        """Taking the ledger (again): start from a fresh one, so nothing this instance
        counted in an earlier term (since granted again by another leader) counts twice;
        the workers it mirrors and their usage carry over, the budgets come with the
        schedulers' next sync."""
        assert self.elector is not None
        leading = self.elector.owns(ALL_POOLS)
        if leading and not self._leading:
            self.servicer.ledger = self.servicer.ledger.fresh()
            log.info("memory-pool %s holds the ledger now", self.elector.instance_id)
        elif self._leading and not leading:
            log.warning("memory-pool %s no longer holds the ledger", self.elector.instance_id)
        self._leading = leading

    def _on_workers(self, items: dict[str, bytes]) -> None:
        self.directory.update_workers(items)
        self.servicer.ledger.set_workers(
            {w.worker_id: (w.pool, int(w.kv_capacity_tokens)) for w in self.directory.all_workers()}
        )
        self.servicer._publish()

    def _on_holders(self, items: dict[str, bytes]) -> None:
        """Drop the reservations of holders whose registration the mirror saw go away
        (never of a holder it has not seen registered: see the module docstring)."""
        live = {key.rsplit("/", 1)[-1] for key in items}
        gone, self._holders_seen = self._holders_seen - live, live
        dropped = 0
        for holder in sorted(gone):
            leased = sum(b.granted for b in self.servicer.ledger.budgets() if b.holder == holder)
            count = self.servicer.ledger.drop_holder(holder)
            if count or leased:
                log.info(
                    "holder %s is gone (its registration ended): dropped %d reservations and %d "
                    "tokens of budget",
                    holder,
                    count,
                    leased,
                )
            dropped += count
        if dropped:
            metrics.HOLDER_DROPPED.inc(dropped)
        if gone:
            self.servicer._publish()

    async def _poll_usage(self) -> None:
        """The ledger's usage comes from what each engine reports, not from guesses."""
        while True:
            await asyncio.sleep(self._poll_s)
            for worker in self.directory.all_workers():
                stub = worker_pb2_grpc.ModelWorkerStub(self.channels.get(worker.address))
                try:
                    load = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=self._poll_s)
                except grpc.aio.AioRpcError:
                    continue  # the worker's lease decides whether it is still there
                self.servicer.ledger.set_engine_usage(worker.worker_id, load.kv_usage_ratio)
            self.servicer._publish()

    async def ready(self) -> None:
        self.workers.start()
        self.holders.start()
        await self.workers.wait_synced(timeout_s=30)
        await self.holders.wait_synced(timeout_s=30)
        self._poller = asyncio.create_task(self._poll_usage(), name="kv-usage-poller")
        if self.elector is not None:
            self.elector.start()
            # Serving only once the first campaign is done: a lone instance owns what
            # it may serve from its first call (etcd down: go on, it campaigns later).
            await self.elector.wait_first_round(timeout_s=5)

    async def draining(self) -> None:
        if self.elector is not None:  # another instance takes the ledger now
            await self.elector.resign()

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self.elector is not None:
            await self.elector.close()
        await self.workers.close()
        await self.holders.close()
        await self.channels.close()


async def build(runtime: ServiceRuntime, settings: MemoryPoolSettings) -> MemoryPoolComponent:
    return MemoryPoolComponent(runtime, settings)


def main() -> None:
    run_service("memory-pool", MemoryPoolSettings, build)


if __name__ == "__main__":
    main()
