"""`inferx-cache`: tool-result cache and session-memory store (TTL, LRU, byte bound)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from prometheus_client import Counter, Gauge
from pydantic import Field

from inferx.errors import InvalidArgument
from inferx.server import ServiceComponent, ServiceRuntime, run_service
from inferx.settings import ServiceSettings
from inferx.ttlcache import TtlLruStore, stats_message
from inferx.v1 import cache_pb2, cache_pb2_grpc

LOOKUPS = Counter("inferx_cache_lookups_total", "Cache look-ups", ["result"])
ENTRIES = Gauge("inferx_cache_entries", "Entries held")
BYTES = Gauge("inferx_cache_bytes", "Bytes held")


class CacheSettings(ServiceSettings):
    max_bytes: int = Field(64 * 1024 * 1024, gt=0, description="size bound of the cache in bytes")
    default_ttl_s: float = Field(300.0, gt=0, description="TTL when a put gives none")


class CacheServicer(cache_pb2_grpc.CacheServicer):
    def __init__(self, store: TtlLruStore) -> None:
        self.store = store

    def _gauges(self) -> None:
        ENTRIES.set(len(self.store))
        BYTES.set(self.store.bytes_used)

    async def Get(self, request, context):
        _require_key(request.key)
        found = self.store.get(request.key, time.monotonic())
        LOOKUPS.labels("hit" if found else "miss").inc()
        if found is None:
            return cache_pb2.CacheGetResponse(hit=False)
        value, age = found
        return cache_pb2.CacheGetResponse(hit=True, value=value, age_s=age)

    async def Put(self, request, context):
        _require_key(request.key)
        if request.ttl_s < 0:
            raise InvalidArgument("ttl_s: must not be negative")
        self.store.put(request.key, request.value, time.monotonic(), request.ttl_s)
        self._gauges()
        return cache_pb2.CachePutResponse()

    async def Append(self, request, context):
        _require_key(request.key)
        self.store.append(
            request.key, request.value, time.monotonic(), request.ttl_s, request.max_items or 50
        )
        self._gauges()
        return cache_pb2.CachePutResponse()

    async def GetList(self, request, context):
        _require_key(request.key)
        return cache_pb2.CacheListResponse(values=self.store.get_list(request.key, time.monotonic()))

    async def GetCacheStats(self, request, context):
        return stats_message(self.store)

    async def Invalidate(self, request, context):
        if not request.key and not request.prefix:
            raise InvalidArgument("key or prefix: one is required")
        removed = self.store.invalidate(request.key, request.prefix)
        self._gauges()
        return cache_pb2.InvalidateResponse(removed=removed)


def _require_key(key: str) -> None:
    if not key:
        raise InvalidArgument("key: must not be empty")


class CacheComponent(ServiceComponent):
    service_names = (cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name,)

    def __init__(self, runtime: ServiceRuntime, settings: CacheSettings) -> None:
        self.servicer = CacheServicer(TtlLruStore(settings.max_bytes, settings.default_ttl_s))
        cache_pb2_grpc.add_CacheServicer_to_server(self.servicer, runtime.server)
        self._sweeper: asyncio.Task[None] | None = None

    async def ready(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(5)
            self.servicer.store.sweep(time.monotonic())
            self.servicer._gauges()

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper


async def build(runtime: ServiceRuntime, settings: CacheSettings) -> CacheComponent:
    return CacheComponent(runtime, settings)


def main() -> None:
    run_service("cache", CacheSettings, build)


if __name__ == "__main__":
    main()
