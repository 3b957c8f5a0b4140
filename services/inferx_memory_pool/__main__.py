"""`inferx-memory-pool`: the cluster-wide KV-capacity ledger the scheduler reserves from."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
from pydantic import Field

from inferx import etcd
from inferx.discovery import ChannelPool
from inferx.errors import InvalidArgument, NotFound, ResourceExhausted
from inferx.pools import PoolDirectory
from inferx.server import ServiceComponent, ServiceRuntime, run_service
from inferx.settings import ServiceSettings
from inferx.v1 import common_pb2, memory_pool_pb2, memory_pool_pb2_grpc, worker_pb2, worker_pb2_grpc
from inferx_memory_pool import metrics
from inferx_memory_pool.ledger import InsufficientCapacity, KvLedger, UnknownWorker


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
    reservation_ttl_s: float = Field(300.0, gt=0, description="a reservation not released expires after this")


class MemoryPoolServicer(memory_pool_pb2_grpc.MemoryPoolServicer):
    def __init__(self, ledger: KvLedger) -> None:
        self.ledger = ledger

    def _publish(self) -> None:
        metrics.publish(self.ledger.snapshot())

    async def Reserve(self, request, context):
        if request.tokens <= 0:
            raise InvalidArgument("tokens: must be positive")
        try:
            res = self.ledger.reserve(
                request.worker_id,
                request.tokens,
                time.monotonic(),
                request.run_id,
                request.hop_id,
                protected=request.tier == common_pb2.TIER_REALTIME,
            )
        except UnknownWorker as exc:
            raise NotFound(str(exc)) from None
        except InsufficientCapacity as exc:
            metrics.RESERVATIONS.labels("refused").inc()
            raise ResourceExhausted(str(exc), retry_after_s=0.5) from None
        metrics.RESERVATIONS.labels("granted").inc()
        self._publish()
        return memory_pool_pb2.Reservation(
            reservation_id=res.reservation_id, worker_id=res.worker_id, tokens=res.tokens
        )

    async def Release(self, request, context):
        released = self.ledger.release(request.reservation_id)
        self._publish()
        return memory_pool_pb2.ReleaseResponse(released=released)

    async def GetUsage(self, request, context):
        self.ledger.expire(time.monotonic())
        reply = memory_pool_pb2.PoolUsage(
            headroom_ratio=self.ledger.headroom_ratio, high_usage_ratio=self.ledger.high_usage_ratio
        )
        for row in self.ledger.snapshot():
            reply.workers.add(
                worker_id=row.worker_id,
                pool=row.pool,
                capacity_tokens=row.capacity_tokens,
                reserved_tokens=row.reserved_tokens,
                usable_tokens=row.usable_tokens,
                reservations=row.reservations,
                engine_kv_usage_ratio=row.engine_usage_ratio,
            )
        return reply


class MemoryPoolComponent(ServiceComponent):
    service_names = (memory_pool_pb2.DESCRIPTOR.services_by_name["MemoryPool"].full_name,)

    def __init__(self, runtime: ServiceRuntime, settings: MemoryPoolSettings) -> None:
        self.servicer = MemoryPoolServicer(
            KvLedger(settings.headroom_ratio, settings.reservation_ttl_s, settings.high_usage_ratio)
        )
        self.directory = PoolDirectory()
        self.workers = etcd.PrefixMirror(runtime.etcd, etcd.WORKERS, self._on_workers)
        self.channels = ChannelPool()
        self._poll_s = settings.usage_poll_s
        self._poller: asyncio.Task[None] | None = None
        memory_pool_pb2_grpc.add_MemoryPoolServicer_to_server(self.servicer, runtime.server)

    def _on_workers(self, items: dict[str, bytes]) -> None:
        self.directory.update_workers(items)
        self.servicer.ledger.set_workers(
            {w.worker_id: (w.pool, int(w.kv_capacity_tokens)) for w in self.directory.all_workers()}
        )
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
        await self.workers.wait_synced(timeout_s=30)
        self._poller = asyncio.create_task(self._poll_usage(), name="kv-usage-poller")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self.workers.close()
        await self.channels.close()


async def build(runtime: ServiceRuntime, settings: MemoryPoolSettings) -> MemoryPoolComponent:
    return MemoryPoolComponent(runtime, settings)


def main() -> None:
    run_service("memory-pool", MemoryPoolSettings, build)


if __name__ == "__main__":
    main()
