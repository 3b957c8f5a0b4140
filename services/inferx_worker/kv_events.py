"""The worker's KV events: what its engine's prefix cache stores and evicts, fanned out
to every scheduler subscribed with `ModelWorker.KvEvents`.

`KvEventHub` keeps the set of blocks the engine holds now (from the events it was
given), so each new subscriber first gets CLEARED + a STORED snapshot and is in sync
after a reconnect, then the live events. Events given within one event-loop turn go
out as one batch. A subscriber that falls `MAX_PENDING` batches behind is dropped (its
stream ends; the scheduler reconnects and resyncs) rather than buffering without bound.

`VllmEventRelay` subscribes to vLLM's ZMQ KV-event publisher (`KVEventsConfig`,
msgpack `KVEventBatch`es of BlockStored / BlockRemoved / AllBlocksCleared) and gives
the hub the same events re-keyed with `inferx.scheduling.prefix_index.chain_keys`
over the events' token ids, as llm-d does: the scheduler never needs vLLM's hash
function or seed, and the keys of a finished request's context (`context_keys`) are
computed the same way from its token ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from inferx.scheduling.prefix_index import CLEARED, REMOVED, STORED, EngineKeyMap, KvEvent

log = logging.getLogger("inferx.worker.kv_events")

MAX_PENDING = 1024  # batches a subscriber may fall behind before it is dropped

_END = None  # put on a subscriber's queue: the stream ends


class KvEventHub:
    def __init__(self) -> None:
        self._blocks: dict[str, int] = {}  # key -> tokens: what the engine holds now
        self._subscribers: set[asyncio.Queue[list[KvEvent] | None]] = set()
        self._pending: list[KvEvent] = []
        self._flush: asyncio.Handle | None = None
        self.published = 0  # events given so far
        self.closed = False

    @property
    def blocks(self) -> dict[str, int]:
        return dict(self._blocks)

    def publish(self, events: Iterable[KvEvent]) -> None:
        """Apply events to the snapshot and queue them for the subscribers."""
        for event in events:
            self.published += 1
            if event.kind == STORED:
                for key, tokens in event.blocks:
                    self._blocks[key] = tokens
            elif event.kind == REMOVED:
                for key, _ in event.blocks:
                    self._blocks.pop(key, None)
            elif event.kind == CLEARED:
                self._blocks.clear()
            if self._subscribers:
                self._pending.append(event)
        if self._pending and self._flush is None:
            try:
                self._flush = asyncio.get_running_loop().call_soon(self._send)
            except RuntimeError:  # no loop (a test driving the engine model directly)
                self._send()

    def stored(self, key: str, tokens: int) -> None:
        """`inferx.sim.kv.KvListener`: the sim engine's cache stored an entry."""
        self.publish([KvEvent(STORED, ((key, tokens),))])

    def removed(self, key: str) -> None:
        self.publish([KvEvent(REMOVED, ((key, 0),))])

    def _send(self) -> None:
        self._flush = None
        batch, self._pending = self._pending, []
        for queue in list(self._subscribers):
            if queue.qsize() >= MAX_PENDING:
                self._subscribers.discard(queue)
                queue.put_nowait(_END)
                log.warning("a KV-event subscriber fell %d batches behind: dropped (it resyncs)", MAX_PENDING)
                continue
            queue.put_nowait(batch)

    def close(self) -> None:
        """End every subscriber's stream (the worker is shutting down); later
        subscriptions end at once."""
        self.closed = True
        for queue in self._subscribers:
            queue.put_nowait(_END)
        self._subscribers.clear()

    async def subscribe(self) -> AsyncGenerator[list[KvEvent], None]:
        """A snapshot (CLEARED, then STORED of every block held), then live batches."""
        if self.closed:
            return
        queue: asyncio.Queue[list[KvEvent] | None] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            snapshot = [KvEvent(CLEARED)]
            if self._blocks:
                snapshot.append(KvEvent(STORED, tuple(self._blocks.items())))
            yield snapshot
            while True:
                batch = await queue.get()
                if batch is _END:
                    return
                yield batch
        finally:
            self._subscribers.discard(queue)


def translate(keymap: EngineKeyMap, batch: Any) -> list[KvEvent]:
    """One vLLM `KVEventBatch` as hub events. Only blocks of the engine's own cache
    count (medium GPU or unset): an offloaded copy is not where a request is served from."""
    events: list[KvEvent] = []
    for event in batch.events:
        kind = type(event).__name__
        medium = getattr(event, "medium", None)
        if kind == "AllBlocksCleared":
            events.append(keymap.cleared())
        elif medium not in (None, "GPU"):
            continue
        elif kind == "BlockStored":
            stored = keymap.stored(
                event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size
            )
            if stored is not None and stored.blocks:
                events.append(stored)
        elif kind == "BlockRemoved":
            removed = keymap.removed(event.block_hashes)
            if removed is not None:
                events.append(removed)
    return events


class VllmEventRelay:
    """Reads vLLM's ZMQ PUB stream at `endpoint` and feeds `hub`. vLLM publishes
    (topic, 8-byte sequence number, msgpack KVEventBatch) frames."""

    def __init__(self, endpoint: str, hub: KvEventHub, topic: str = "") -> None:
        self.endpoint, self.hub, self.topic = endpoint, hub, topic
        self.keymap = EngineKeyMap()
        self._task: asyncio.Task[None] | None = None
        self._socket: Any = None
        self.last_seq = -1
        self.connected = asyncio.Event()

    def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._socket.connect(self.endpoint)
        self._task = asyncio.create_task(self._run(), name="vllm-kv-events")
        self.connected.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while True:
            _, seq_bytes, payload = await self._socket.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self.last_seq >= 0 and seq != self.last_seq + 1:
                # Batches were lost (PUB drops when a subscriber lags): what the cache
                # holds is no longer known exactly. Start over from empty; blocks stored
                # again are learned again (an under-estimate, never a false hit).
                log.warning("vLLM KV events %d..%d lost: cleared", self.last_seq + 1, seq - 1)
                self.hub.publish([self.keymap.cleared()])
            self.last_seq = seq
            try:
                batch = decoder.decode(payload)
            except msgspec.DecodeError as exc:
                log.warning("a vLLM KV-event batch could not be decoded: %s", exc)
                continue
            self.hub.publish(translate(self.keymap, batch))
