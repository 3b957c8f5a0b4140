"""The real vLLM engine (AsyncLLM in-process) on the tiny dummy-weight model.

One engine serves the whole module (start-up is ~30 s on a 2-core CPU). The weights are
random, so the text is gibberish and a request may end early on a sampled EOS; the tests
only rely on structure: streaming, token counts, prefix-cache hits, capacity and aborts.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncGenerator

import pytest
import pytest_asyncio

from inferx.tinymodel import make_tiny_model
from inferx_worker.engines.base import EngineChunk, EngineRequest
from inferx_worker.engines.vllm_engine import VllmEngine
from tests.polling import poll_until

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

# Everything is local; never try the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# With greedy decoding this prompt makes the dummy model loop without sampling EOS
# (checked on the CPU build), so generations run to max_tokens.
LOOP_PROMPT = "The customer placed an order for shoes"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")
    eng = VllmEngine(str(model_dir), dummy_weights=True, max_model_len=1024, max_num_seqs=8)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


async def collect(engine: VllmEngine, request: EngineRequest) -> list[EngineChunk]:
    return [chunk async for chunk in engine.generate(request)]


async def wait_idle(engine: VllmEngine, timeout: float = 5.0) -> None:
    await poll_until(
        lambda: engine.load().running == 0 and engine.num_unfinished_requests() == 0,
        timeout_s=timeout,
        interval_s=0.05,
        what="the engine to be idle",
    )


def load_is_zero(engine: VllmEngine) -> bool:
    load = engine.load()
    return load.running == 0 and load.waiting == 0


async def test_capacity(engine: VllmEngine):
    cap = engine.capacity()
    assert cap.kv_capacity_tokens > 0
    assert cap.block_size > 0 and cap.kv_capacity_tokens % cap.block_size == 0
    assert cap.max_concurrency == 8
    if not engine.on_gpu:
        assert cap.block_size == 32


async def test_streaming_chunks_and_final_counts(engine: VllmEngine):
    max_tokens = 16
    chunks = await collect(
        engine, EngineRequest(request_id="stream-1", prompt=LOOP_PROMPT, max_tokens=max_tokens)
    )
    assert len(chunks) >= 2, chunks
    final = chunks[-1]
    assert final.finished
    assert not any(c.finished for c in chunks[:-1])
    assert 1 <= final.completion_tokens <= max_tokens
    assert final.finish_reason in ("length", "stop")
    if final.finish_reason == "length":
        assert final.completion_tokens == max_tokens
    assert final.prompt_tokens >= 2  # BOS + some text
    text = "".join(c.text for c in chunks)
    assert text, "no text streamed"
    assert load_is_zero(engine)


async def test_shared_prefix_hits_the_prefix_cache(engine: VllmEngine):
    block = engine.capacity().block_size
    prefix = " ".join(
        f"Order {n} was shipped by express and the agent refunded the shipping cost." for n in range(12)
    )
    first = (await collect(engine, EngineRequest("prefix-1", prefix, max_tokens=2)))[-1]
    assert first.prompt_tokens > 2 * block, "the shared prefix must span > 2 KV blocks"
    second = (
        await collect(
            engine,
            EngineRequest("prefix-2", prefix + " Then the customer asked about returns.", max_tokens=2),
        )
    )[-1]
    assert second.prompt_tokens > first.prompt_tokens
    assert second.cached_prompt_tokens > 0
    # Only full blocks are cached, and never more than the shared prefix.
    assert second.cached_prompt_tokens % block == 0
    assert second.cached_prompt_tokens <= first.prompt_tokens


async def test_cancel_mid_stream_aborts_the_request(engine: VllmEngine):
    got_chunk = asyncio.Event()
    chunks: list[EngineChunk] = []

    async def consume():
        async for chunk in engine.generate(EngineRequest("cancel-1", LOOP_PROMPT, max_tokens=900)):
            chunks.append(chunk)
            got_chunk.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_chunk.wait(), timeout=30)
    assert engine.load().running + engine.load().waiting == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not any(c.finished for c in chunks), "finished before it could be cancelled"
    await wait_idle(engine)
    assert engine.load().running == 0
    assert engine.num_unfinished_requests() == 0


async def test_consumer_stopping_early_aborts_the_request(engine: VllmEngine):
    stream = engine.generate(EngineRequest("break-1", LOOP_PROMPT, max_tokens=900))
    assert isinstance(stream, AsyncGenerator)  # closing it is how a caller cancels
    async for chunk in stream:
        assert not chunk.finished
        break
    await stream.aclose()
    await wait_idle(engine)
    assert engine.load().running == 0
    assert engine.num_unfinished_requests() == 0


async def test_no_context_blocks_for_a_caller_that_reads_none(engine: VllmEngine):
    """GenerateRequest.skip_context_blocks (a scheduler not placing by exact prefix):
    the finished chunk carries no blocks, and nothing hashed the context for them."""
    prompt = " ".join(f"Ticket {n}: the parcel arrived damaged and was replaced." for n in range(10))
    request = EngineRequest("kv-skip-1", prompt, max_tokens=2, context_blocks=False)
    final = (await collect(engine, request))[-1]
    assert final.finished and final.prompt_tokens > 3 * engine.capacity().block_size
    assert final.context_blocks == ()


async def test_kv_events_report_the_blocks_a_request_cached(engine: VllmEngine):
    """vLLM's own BlockStored events (its ZMQ publisher, relayed) arrive at the worker's
    hub keyed as the finished request reports its context: so the scheduler's index
    finds exactly the blocks this engine holds of a chain's next prompt."""
    hub = engine.kv_events()
    assert hub is not None
    stream = hub.subscribe()
    first_batch = await asyncio.wait_for(stream.__anext__(), timeout=5)
    assert first_batch[0].kind == "cleared"
    block = engine.capacity().block_size
    prompt = " ".join(f"Ticket {n}: the parcel arrived damaged and was replaced." for n in range(10))
    final = (await collect(engine, EngineRequest("kv-events-1", prompt, max_tokens=4)))[-1]
    assert final.prompt_tokens > 3 * block
    context = final.context_blocks
    assert len(context) == (final.prompt_tokens + final.completion_tokens - 1) // block
    assert all(tokens == block for _, tokens in context)
    await poll_until(
        lambda: all(key in hub.blocks for key, _ in context),
        timeout_s=10,
        interval_s=0.05,
        what="vLLM's BlockStored events for the request's blocks",
    )
    await stream.aclose()


async def test_a_stop_sequence_ends_the_text_before_it(engine: VllmEngine):
    """The request's stop sequences reach vLLM's SamplingParams: greedy decoding writes
    the same text again, which now ends before the first occurrence of a piece of it."""
    first = await collect(engine, EngineRequest("stop-1", LOOP_PROMPT, max_tokens=24))
    text = "".join(c.text for c in first)
    stop = next(
        (text[i : i + 3] for i in range(len(text) // 2, len(text) - 3) if text[i : i + 3].strip()),
        None,
    )
    assert stop is not None, f"no stop sequence to take from {text!r}"
    again = await collect(engine, EngineRequest("stop-2", LOOP_PROMPT, max_tokens=24, stop=(stop,)))
    assert "".join(c.text for c in again) == text[: text.find(stop)]
    assert again[-1].finish_reason == "stop" and again[-1].completion_tokens < first[-1].completion_tokens


async def test_a_json_schema_response_format_constrains_the_output(engine: VllmEngine):
    """vLLM's structured outputs on the random-weight model: without the schema its text
    is gibberish; with it, a JSON object with the one boolean field (the grammar allows
    only whitespace after the value, so a reply cut at max_tokens is that object but its
    closing brace)."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}
    chunks = await collect(engine, EngineRequest("json-1", LOOP_PROMPT, max_tokens=48, response_format=fmt))
    text = "".join(c.text for c in chunks)
    whole = text if chunks[-1].finish_reason == "stop" else text.rstrip() + "}"
    value = json.loads(whole)
    assert list(value) == ["ok"] and isinstance(value["ok"], bool), text
