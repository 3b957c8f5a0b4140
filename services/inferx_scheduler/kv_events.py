"""The live feed of the scheduler's prefix index: one `ModelWorker.KvEvents` stream
per registered worker, applied to the dispatcher's `PrefixIndex`.

Every stream starts with CLEARED + a snapshot, so (re)connecting is a resync. While a
worker's stream is down its entries are forgotten (`PrefixIndex.forget`): policies fall
back to their estimates for it rather than trust a stale picture. A worker whose
engine reports no KV events (UNIMPLEMENTED) is not asked again until it re-registers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from inferx.discovery import ChannelPool
from inferx.pools import PoolDirectory
from inferx.scheduling.prefix_index import CLEARED, REMOVED, STORED, EventKind, KvEvent, PrefixIndex
from inferx.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("inferx.scheduler.kv_events")

RETRY_S = 1.0  # after a stream ends or fails, before subscribing again

_KINDS: dict[int, EventKind] = {
    worker_pb2.KvEvent.KIND_STORED: STORED,
    worker_pb2.KvEvent.KIND_REMOVED: REMOVED,
    worker_pb2.KvEvent.KIND_CLEARED: CLEARED,
}


def event_of(message: worker_pb2.KvEvent) -> KvEvent | None:
    kind = _KINDS.get(message.kind)
    if kind is None:
        return None  # a newer worker's kind: skip it
    return KvEvent(kind, tuple((block.key, block.tokens) for block in message.blocks))


class KvEventSubscriber:
    def __init__(
        self,
        directory: PoolDirectory,
        channels: ChannelPool,
        index: PrefixIndex,
        reconcile_s: float = 1.0,
    ) -> None:
        self._directory = directory
        self._channels = channels
        self.index = index
        self._reconcile_s = reconcile_s
        self._streams: dict[str, tuple[str, asyncio.Task[None]]] = {}  # worker -> (address, task)
        self._unsupported: set[tuple[str, str]] = set()  # (worker, address) that answered UNIMPLEMENTED
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._reconcile_forever(), name="kv-events")

    async def close(self) -> None:
        tasks = [t for _, t in self._streams.values()]
        if self._task is not None:
            tasks.append(self._task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._streams.clear()

    def subscribed(self) -> set[str]:
        return set(self._streams)

    async def _reconcile_forever(self) -> None:
        while True:
            self.reconcile()
            await asyncio.sleep(self._reconcile_s)

    def reconcile(self) -> None:
        """One stream per registered worker: start the new ones, stop the departed."""
        current = {w.worker_id: w.address for w in self._directory.all_workers()}
        self._unsupported &= set(current.items())  # re-registered: asked again
        for worker_id, (address, task) in list(self._streams.items()):
            if current.get(worker_id) != address:
                task.cancel()
                del self._streams[worker_id]
                self.index.forget(worker_id)
        for worker_id, address in current.items():
            if worker_id in self._streams or (worker_id, address) in self._unsupported:
                continue
            task = asyncio.create_task(self._follow(worker_id, address), name=f"kv-events-{worker_id}")
            self._streams[worker_id] = (address, task)

    async def _follow(self, worker_id: str, address: str) -> None:
        stub = worker_pb2_grpc.ModelWorkerStub(self._channels.get(address))
        try:
            while True:
                try:
                    async for batch in stub.KvEvents(worker_pb2.KvEventsRequest()):
                        for message in batch.events:
                            event = event_of(message)
                            if event is not None:
                                self.index.apply(worker_id, event)
                    log.info("worker %s ended its KV-event stream: resubscribing", worker_id)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                        log.info("worker %s reports no KV events: %s", worker_id, exc.details())
                        self._unsupported.add((worker_id, address))
                        self._streams.pop(worker_id, None)
                        return
                    log.debug("KV events from worker %s: %s", worker_id, exc.code().name)
                # Down: what it holds is unknown until the next snapshot.
                self.index.forget(worker_id)
                await asyncio.sleep(RETRY_S)
        finally:
            entry = self._streams.get(worker_id)
            if entry is None or entry[1] is asyncio.current_task():
                self.index.forget(worker_id)  # (not when a newer stream for it took over)
