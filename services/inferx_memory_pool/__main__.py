"""`inferx-memory-pool`: the cluster-wide KV-capacity ledger the scheduler reserves from."""

from __future__ import annotations

import time

from pydantic import Field

from inferx import etcd
from inferx.errors import InvalidArgument, NotFound, ResourceExhausted
from inferx.pools import PoolDirectory
from inferx.server import ServiceComponent, ServiceRuntime, run_service
from inferx.settings import ServiceSettings
from inferx.v1 import memory_pool_pb2, memory_pool_pb2_grpc
from inferx_memory_pool import metrics
from inferx_memory_pool.ledger import InsufficientCapacity, KvLedger, UnknownWorker


class MemoryPoolSettings(ServiceSettings):
    headroom_ratio: float = Field(
        0.2,
        ge=0.1,
        le=0.3,
        description="fraction of each worker's KV kept free for bursts (0.1-0.3)",
    )
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
                request.worker_id, request.tokens, time.monotonic(), request.run_id, request.hop_id
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
        reply = memory_pool_pb2.PoolUsage(headroom_ratio=self.ledger.headroom_ratio)
        for row in self.ledger.snapshot():
            reply.workers.add(
                worker_id=row.worker_id,
                pool=row.pool,
                capacity_tokens=row.capacity_tokens,
                reserved_tokens=row.reserved_tokens,
                usable_tokens=row.usable_tokens,
                reservations=row.reservations,
            )
        return reply


class MemoryPoolComponent(ServiceComponent):
    service_names = (memory_pool_pb2.DESCRIPTOR.services_by_name["MemoryPool"].full_name,)

    def __init__(self, runtime: ServiceRuntime, settings: MemoryPoolSettings) -> None:
        self.servicer = MemoryPoolServicer(KvLedger(settings.headroom_ratio, settings.reservation_ttl_s))
        self.workers = etcd.PrefixMirror(runtime.etcd, etcd.WORKERS, self._on_workers)
        memory_pool_pb2_grpc.add_MemoryPoolServicer_to_server(self.servicer, runtime.server)

    def _on_workers(self, items: dict[str, bytes]) -> None:
        directory = PoolDirectory()
        directory.update_workers(items)
        self.servicer.ledger.set_workers(
            {w.worker_id: (w.pool, int(w.kv_capacity_tokens)) for w in directory.all_workers()}
        )
        self.servicer._publish()

    async def ready(self) -> None:
        self.workers.start()
        await self.workers.wait_synced(timeout_s=30)

    async def stop(self) -> None:
        await self.workers.close()


async def build(runtime: ServiceRuntime, settings: MemoryPoolSettings) -> MemoryPoolComponent:
    return MemoryPoolComponent(runtime, settings)


def main() -> None:
    run_service("memory-pool", MemoryPoolSettings, build)


if __name__ == "__main__":
    main()
