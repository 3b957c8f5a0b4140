"""What the router knows of the pools' load, polled from the scheduler, so it can
degrade (fallback model, skip non-critical nodes) before an SLO is missed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import grpc

from inferx.discovery import ChannelPool, ServiceLocator
from inferx.pools import PoolDirectory
from inferx.resilience import overloaded
from inferx.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("inferx.router.load")


@dataclass(frozen=True)
class PoolLoad:
    running: int
    queued: int
    capacity: int


class LoadMonitor:
    def __init__(
        self,
        directory: PoolDirectory,
        services: ServiceLocator,
        channels: ChannelPool,
        threshold: float,
        interval_s: float = 0.5,
    ) -> None:
        self._directory = directory
        self._services = services
        self._channels = channels
        self.threshold = threshold
        self._interval_s = interval_s
        self.pools: dict[str, PoolLoad] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll(), name="load-monitor")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def overloaded(self, model: str) -> bool:
        load = self.pools.get(self._directory.pool_of(model))
        if load is None:
            return False  # unknown load: do not degrade on a guess
        return overloaded(load.running, load.queued, load.capacity, self.threshold)

    def load(self, model: str) -> float | None:
        """The model's pool: (running + queued) / capacity; None when not known yet."""
        load = self.pools.get(self._directory.pool_of(model))
        if load is None or load.capacity <= 0:
            return None
        return (load.running + load.queued) / load.capacity

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            # Every scheduler: each answers for the pools it owns (partitioned), or
            # for its share of every pool; summed, that is the pool's load.
            addresses = [info.address for info in self._services.instances("scheduler")]
            if not addresses:
                continue
            replies = await asyncio.gather(*(self._status(a) for a in addresses))
            if all(reply is None for reply in replies):
                continue
            self.pools = merge_loads([reply for reply in replies if reply is not None])

    async def _status(self, address: str) -> scheduler_pb2.SchedulerStatus | None:
        stub = scheduler_pb2_grpc.SchedulerStub(self._channels.get(address))
        try:
            return await stub.GetSchedulerStatus(scheduler_pb2.SchedulerStatusRequest(), timeout=1.0)
        except grpc.aio.AioRpcError:
            return None


def merge_loads(statuses: list[scheduler_pb2.SchedulerStatus]) -> dict[str, PoolLoad]:
    """Per pool: hops running and queued summed over the schedulers, capacity the most
    any of them sees (they all see the same workers)."""
    pools: dict[str, PoolLoad] = {}
    for status in statuses:
        for pool in status.pools:
            capacity = sum(w.worker.max_concurrency or 1 for w in pool.workers)
            seen = pools.get(pool.pool)
            if seen is None:
                pools[pool.pool] = PoolLoad(pool.running, pool.queued, capacity)
            else:
                pools[pool.pool] = PoolLoad(
                    seen.running + pool.running, seen.queued + pool.queued, max(seen.capacity, capacity)
                )
    return pools
