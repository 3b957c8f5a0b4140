"""The worker side of KV events: the hub (snapshot + live fan-out), the sim engine
publishing its cache changes, and the relay of vLLM's own ZMQ events (its real event
classes, msgpack-encoded as vLLM's publisher sends them)."""

from __future__ import annotations

import asyncio

# A plain import, not importorskip: `make test` installs vLLM (or its CPU build, the same
# module), so a missing or moved module must fail here rather than skip (issue #45).
import vllm.distributed.kv_events as events_mod

from inferx.scheduling.prefix_index import CLEARED, REMOVED, STORED, KvEvent, PrefixIndex, chain_keys
from inferx_worker import kv_events
from inferx_worker.engines.base import EngineRequest
from inferx_worker.engines.sim_engine import SimEngine, SimParams
from inferx_worker.kv_events import KvEventHub, VllmEventRelay, translate


async def _next(stream, timeout: float = 5.0):
    return await asyncio.wait_for(stream.__anext__(), timeout)


async def test_hub_sends_a_snapshot_then_live_batches() -> None:
    hub = KvEventHub()
    hub.publish([KvEvent(STORED, (("a", 16), ("b", 16)))])
    hub.publish([KvEvent(REMOVED, (("a", 0),))])
    stream = hub.subscribe()
    snapshot = await _next(stream)
    assert snapshot == [KvEvent(CLEARED), KvEvent(STORED, (("b", 16),))]
    hub.stored("c", 16)
    hub.removed("b")  # both within one loop turn: one batch
    assert await _next(stream) == [KvEvent(STORED, (("c", 16),)), KvEvent(REMOVED, (("b", 0),))]
    # A reconnecting subscriber is in sync from its first batch.
    index = PrefixIndex()
    index.stored("x", [("stale", 16)])
    for event in await _next(hub.subscribe()):
        index.apply("x", event)
    assert index.match("x", [("c", 16)]) == 16 and index.match("x", [("stale", 16)]) == 0
    await stream.aclose()


async def test_a_subscriber_that_falls_behind_is_dropped(monkeypatch) -> None:
    monkeypatch.setattr(kv_events, "MAX_PENDING", 3)
    hub = KvEventHub()
    stream = hub.subscribe()
    await _next(stream)  # the (empty) snapshot
    for i in range(5):
        hub.stored(f"k{i}", 16)
        await asyncio.sleep(0)  # one batch per turn, none read
    received = [batch async for batch in stream]  # ends: it was dropped
    assert len(received) == 3


async def test_the_sim_engine_publishes_what_its_cache_stores_and_reports_context_keys() -> None:
    engine = SimEngine(SimParams(speed=1000.0))
    await engine.start()
    try:
        stream = engine.kv_events().subscribe()
        assert await _next(stream) == [KvEvent(CLEARED)]
        prompt = "x" * (4 * 16 * 3 + 10)  # 3 whole 16-token blocks and a partial one
        chunks = [c async for c in engine.generate(EngineRequest("r1", prompt, max_tokens=20))]
        index = PrefixIndex()
        while engine.kv_events().published > index.events:
            for event in await _next(stream):
                index.apply("w", event)
        context = chunks[-1].context_blocks
        # 3 prompt blocks, plus the block the output completed (prompt tail + output).
        assert len(context) == 4 and all(tokens == 16 for _, tokens in context)
        assert index.match("w", context) == 64  # everything it reported is cached there
        await stream.aclose()
    finally:
        await engine.stop()


def test_translate_keys_vllm_blocks_by_token_ids() -> None:
    from inferx.scheduling.prefix_index import EngineKeyMap

    tokens = list(range(100, 164))
    batch = events_mod.KVEventBatch(
        ts=0.0,
        events=[
            events_mod.BlockStored(
                block_hashes=[b"h1", b"h2"],
                parent_block_hash=None,
                token_ids=tokens[:32],
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            events_mod.BlockStored(
                block_hashes=[b"h3"],
                parent_block_hash=b"h2",
                token_ids=tokens[32:48],
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            events_mod.BlockStored(  # an offloaded copy: not where requests are served from
                block_hashes=[b"c1"],
                parent_block_hash=None,
                token_ids=tokens[:16],
                block_size=16,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            ),
            events_mod.BlockRemoved(block_hashes=[b"h3"], medium="GPU"),
        ],
    )
    events = translate(EngineKeyMap(), batch)
    keys = chain_keys(tokens, 16)
    assert events == [
        KvEvent(STORED, ((keys[0], 16), (keys[1], 16))),
        KvEvent(STORED, ((keys[2], 16),)),
        KvEvent(REMOVED, ((keys[2], 0),)),
    ]
    batch = events_mod.KVEventBatch(ts=0.0, events=[events_mod.AllBlocksCleared()])
    cleared = translate(EngineKeyMap(), batch)
    assert cleared == [KvEvent(CLEARED)]


async def test_the_relay_reads_vllms_zmq_stream(tmp_path) -> None:
    """vLLM's publisher frames (topic, 8-byte sequence, msgpack KVEventBatch) on a real
    ZMQ PUB socket reach the hub re-keyed; a gap in the sequence clears the picture."""
    import msgspec
    import zmq
    import zmq.asyncio

    endpoint = f"ipc://{tmp_path}/kv.sock"
    pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    hub = KvEventHub()
    relay = VllmEventRelay(endpoint, hub)
    relay.start()
    encoder = msgspec.msgpack.Encoder()
    tokens = list(range(32))

    def frame(seq: int, event) -> list[bytes]:
        payload = encoder.encode(events_mod.KVEventBatch(ts=0.0, events=[event]))
        return [b"", seq.to_bytes(8, "big"), payload]

    stored = events_mod.BlockStored(
        block_hashes=[7, 8],
        parent_block_hash=None,
        token_ids=tokens,
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    try:
        # PUB drops messages until the subscription has propagated: repeat until seen.
        for _ in range(200):
            await pub.send_multipart(frame(0, stored))
            await asyncio.sleep(0.02)
            if hub.blocks:
                break
        assert hub.blocks == dict.fromkeys(chain_keys(tokens, 16), 16)
        relay.last_seq = 0  # whatever repeats arrived, the next one is 1
        await pub.send_multipart(frame(5, events_mod.BlockRemoved(block_hashes=[999], medium="GPU")))
        for _ in range(200):
            await asyncio.sleep(0.02)
            if relay.last_seq == 5:
                break
        assert relay.last_seq == 5 and hub.blocks == {}  # 1..4 lost: cleared, not trusted
    finally:
        await relay.stop()
        pub.close(linger=0)


async def test_closing_the_hub_ends_every_stream() -> None:
    """A worker shutting down ends its KV-event streams (they would never end by
    themselves and would hold the drain for its whole timeout)."""
    hub = KvEventHub()
    stream = hub.subscribe()
    await _next(stream)
    hub.close()
    assert [batch async for batch in stream] == []
    assert [batch async for batch in hub.subscribe()] == []  # later ones end at once
