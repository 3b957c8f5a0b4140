"""The tiered tool-result cache as the router sees it.

L1: a small, short-TTL store inside this router process: the hottest results cost no
network hop. L2: the cache service; with several replicas each key lives on the
replica the consistent-hash ring assigns, so adding a replica moves only its share of
keys. Every failure of L2 is reported as "unavailable", never raised: chains go on
without caching.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from inferx.discovery import ChannelPool, ServiceLocator
from inferx.hashring import HashRing
from inferx.ttlcache import TtlLruStore, stats_message
from inferx.v1 import cache_pb2, cache_pb2_grpc

log = logging.getLogger("inferx.router.cache")

L2_TIMEOUT_S = 0.5


class TieredCache:
    def __init__(
        self,
        services: ServiceLocator,
        channels: ChannelPool,
        *,
        l1_max_bytes: int = 8 * 1024 * 1024,
        l1_ttl_s: float = 5.0,
    ) -> None:
        self._services = services
        self._channels = channels
        self.local = TtlLruStore(max_bytes=l1_max_bytes, default_ttl_s=l1_ttl_s)
        self._l1_ttl_s = l1_ttl_s
        self._ring = HashRing()

    def replicas(self) -> list[str]:
        return sorted(info.address for info in self._services.instances("cache"))

    def _stub_for(self, key: str) -> tuple[cache_pb2_grpc.CacheStub | None, str]:
        self._ring.set_members(self.replicas())
        address = self._ring.owner(key)
        if address is None:
            return None, ""
        return cache_pb2_grpc.CacheStub(self._channels.get(address)), address

    async def get(self, key: str, *, use_l1: bool = True) -> tuple[bytes | None, bool]:
        """(value or None, whether L2 was unavailable)."""
        if use_l1:
            found = self.local.get(key, time.monotonic())
            if found is not None:
                return found[0], False
        stub, address = self._stub_for(key)
        if stub is None:
            return None, True
        try:
            reply = await stub.Get(cache_pb2.CacheGetRequest(key=key), timeout=L2_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("cache %s get failed (%s); calling the tool", address, exc.code().name)
            return None, True
        if not reply.hit:
            return None, False
        if use_l1:
            self.local.put(key, reply.value, time.monotonic(), self._l1_ttl_s)
        return reply.value, False

    async def put(self, key: str, value: bytes, ttl_s: float, *, use_l1: bool = True) -> bool:
        if use_l1:
            self.local.put(key, value, time.monotonic(), min(ttl_s, self._l1_ttl_s))
        stub, address = self._stub_for(key)
        if stub is None:
            return False
        try:
            await stub.Put(cache_pb2.CachePutRequest(key=key, value=value, ttl_s=ttl_s), timeout=L2_TIMEOUT_S)
            return True
        except grpc.aio.AioRpcError as exc:
            log.warning("cache %s put failed (%s)", address, exc.code().name)
            return False

    async def append(self, key: str, value: bytes, ttl_s: float) -> None:
        stub, _ = self._stub_for(key)
        if stub is None:
            return
        try:
            await stub.Append(
                cache_pb2.CacheAppendRequest(key=key, value=value, ttl_s=ttl_s), timeout=L2_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("could not store session memory (%s)", exc.code().name)

    async def get_list(self, key: str) -> list[bytes] | None:
        """None when the cache is unreachable (distinct from an empty list)."""
        stub, _ = self._stub_for(key)
        if stub is None:
            return None
        try:
            reply = await stub.GetList(cache_pb2.CacheGetRequest(key=key), timeout=L2_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return None
        return list(reply.values)

    async def invalidate(self, *, key: str = "", prefix: str = "") -> tuple[int, int]:
        """Drop from L1 and from every replica (a key may sit on any replica it was
        assigned to before the ring changed). Returns (removed from replicas, replicas)."""
        self.local.invalidate(key, prefix)
        replicas = self.replicas()

        async def one(address: str) -> int:
            stub = cache_pb2_grpc.CacheStub(self._channels.get(address))
            reply = await stub.Invalidate(cache_pb2.InvalidateRequest(key=key, prefix=prefix), timeout=2.0)
            return reply.removed

        removed = await asyncio.gather(*(one(a) for a in replicas))
        return sum(removed), len(replicas)

    async def replica_stats(self) -> list[tuple[str, cache_pb2.CacheStats | None, str]]:
        async def one(address: str):
            stub = cache_pb2_grpc.CacheStub(self._channels.get(address))
            try:
                return address, await stub.GetCacheStats(cache_pb2.CacheStatsRequest(), timeout=2.0), ""
            except grpc.aio.AioRpcError as exc:
                return address, None, exc.code().name

        return list(await asyncio.gather(*(one(a) for a in self.replicas())))

    def local_stats(self) -> cache_pb2.CacheStats:
        return stats_message(self.local)
