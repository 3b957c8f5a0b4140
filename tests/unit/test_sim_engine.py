"""The live SIMULATED engine drives the simulator's EngineModel against the wall clock:
streaming, prefix reuse of whole blocks (prompt and output), batching, and agreement
with the virtual-time model's timing."""

import asyncio
import time
from collections.abc import AsyncGenerator

import pytest

from inferx.sim.engine import EngineModel, SimRequest
from inferx.sim.profile import EngineProfile
from inferx_worker.engines.base import EngineError, EngineRequest
from inferx_worker.engines.sim_engine import (
    UNSET_REPLY_TOKENS,
    SimEngine,
    SimParams,
    block_segments,
    eos_directive,
    split_tokens,
    stop_at,
)


async def _run(engine: SimEngine, prompt: str, max_tokens: int | None = 4, rid: str = "r"):
    return [c async for c in engine.generate(EngineRequest(rid, prompt, max_tokens=max_tokens))]


def _fast(**profile) -> SimParams:
    return SimParams(profile=EngineProfile(**profile), speed=100)


def test_decode_step_grows_with_batch_like_the_published_profile() -> None:
    engine = SimEngine(SimParams(profile=EngineProfile(decode_step_ms=10.0, batch_slowdown=0.13)))
    assert engine.step_ms(1) == pytest.approx(10.0)
    assert engine.step_ms(32) == pytest.approx(11.3)


def test_overrides_change_only_the_given_profile_keys() -> None:
    params = SimParams.with_overrides(None, speed=3.0, decode_step_ms=None, max_num_seqs=2)
    assert params.speed == 3.0
    assert params.profile.max_num_seqs == 2
    assert params.profile.decode_step_ms == EngineProfile().decode_step_ms


def test_block_segments_key_prefixes_and_keep_partial_blocks_private() -> None:
    a = block_segments(split_tokens("x" * (4 * 40), 4), 16)
    b = block_segments(split_tokens("x" * (4 * 32) + "y" * 64, 4), 16)
    c = block_segments(split_tokens("x" * (4 * 48), 4), 16)
    assert [s.tokens for s in a] == [16, 16, 8] and a[-1].key is None
    assert a[:2] == b[:2] == c[:2] and b[2].key not in (None, c[2].key)
    assert block_segments(split_tokens("x" * (4 * 40), 4), 16, first=1) == a[1:]


async def test_streams_tokens_and_reports_usage() -> None:
    engine = SimEngine(_fast())
    await engine.start()
    try:
        chunks = await _run(engine, "x" * 400, max_tokens=5)
    finally:
        await engine.stop()
    final = chunks[-1]
    assert final.finished and not any(c.finished for c in chunks[:-1])
    assert final.completion_tokens == 5 and final.prompt_tokens == 100
    assert final.cached_prompt_tokens == 0
    assert len("".join(c.text for c in chunks)) == 5 * 4  # every token is 4 characters
    # The last step's token rides on the finished chunk (as vLLM's final output does):
    # no empty chunk of its own, so a one-token reply is one message.
    assert final.text and all(c.text for c in chunks)
    one = SimEngine(_fast())
    await one.start()
    try:
        single = await _run(one, "x" * 400, max_tokens=1)
    finally:
        await one.stop()
    assert [(c.finished, len(c.text)) for c in single] == [(True, 4)]


async def test_a_request_without_max_tokens_stops_where_the_model_does_or_when_its_context_is_full() -> None:
    engine = SimEngine(_fast(kv_capacity_tokens=1024))
    await engine.start()
    try:
        untold = await _run(engine, "x" * 400, max_tokens=None, rid="untold")
        told = await _run(engine, "y" * 400 + eos_directive(300), max_tokens=None, rid="told")
        full = await _run(engine, "z" * 400 + eos_directive(5000), max_tokens=None, rid="full")
    finally:
        await engine.stop()
    assert (untold[-1].completion_tokens, untold[-1].finish_reason) == (UNSET_REPLY_TOKENS, "stop")
    assert (told[-1].completion_tokens, told[-1].finish_reason) == (300, "stop")
    room = 1024 - full[-1].prompt_tokens  # the context room: the whole KV pool here
    assert (full[-1].completion_tokens, full[-1].finish_reason) == (room, "length")


async def test_a_prompt_that_fills_the_pool_is_refused_as_a_client_error() -> None:
    engine = SimEngine(_fast(kv_capacity_tokens=1024))
    await engine.start()
    try:
        with pytest.raises(EngineError, match="max_model_len .* 1,024") as refused:
            await _run(engine, "x" * 8192, max_tokens=4)
        capped = await _run(engine, "y" * 4000, max_tokens=500)  # more than the room left
    finally:
        await engine.stop()
    assert isinstance(refused.value.__cause__, ValueError)  # the worker answers INVALID_ARGUMENT
    room = 1024 - capped[-1].prompt_tokens
    assert (capped[-1].completion_tokens, capped[-1].finish_reason) == (room, "length")


async def test_next_hop_hits_the_prompt_and_the_previous_output() -> None:
    engine = SimEngine(_fast(block_size=16))
    await engine.start()
    try:
        first_prompt = "the same long system prompt " * 20  # 560 chars = 140 tokens
        chunks = await _run(engine, first_prompt, max_tokens=40, rid="a")
        completion = "".join(c.text for c in chunks)
        second = (await _run(engine, first_prompt + completion + "next question", rid="b"))[-1]
    finally:
        await engine.stop()
    # 140 + 40 = 180 tokens before the new input: 11 whole blocks are cached.
    assert second.cached_prompt_tokens == 11 * 16
    assert second.prompt_tokens == 180 + len("next question") // 4 + 1


async def test_concurrent_requests_share_the_decode_batch() -> None:
    # 10 ms steps at speed 10: 100 steps alone take ~100 ms. Four together must run in
    # one decode batch: all four running at once, taking about as long as one, not as
    # long as four one after the other.
    engine = SimEngine(SimParams(profile=EngineProfile(kv_read_ms_per_1k_tokens=0), speed=10))
    steps = 100
    batched_s = steps * engine.step_ms(4) / 1000 / 10
    one_by_one_s = 4 * steps * engine.step_ms(1) / 1000 / 10
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, engine.load().running)
            await asyncio.sleep(0.005)

    await engine.start()
    watcher = asyncio.create_task(watch())
    try:
        started = time.perf_counter()
        await asyncio.gather(*(_run(engine, f"q{i}" * 8, steps, f"r{i}") for i in range(4)))
        elapsed = time.perf_counter() - started
    finally:
        watcher.cancel()
        await engine.stop()
    assert peak == 4
    # Halfway between the two hypotheses (~100 ms vs ~400 ms): the most room for a
    # loaded machine either way, and still failing if the requests ran in turn.
    assert elapsed < (batched_s + one_by_one_s) / 2, (elapsed, batched_s, one_by_one_s)
    assert engine.load().running == 0 and engine.model.idle


async def test_wall_time_follows_the_model() -> None:
    # 1000 tokens at 10k tokens/s = 100 ms of prefill at speed 1.
    profile = EngineProfile(prefill_tokens_per_s=10_000, decode_step_ms=0.001, prefill_attention_ms=0)
    engine = SimEngine(SimParams(profile=profile))
    await engine.start()
    try:
        started = time.perf_counter()
        await _run(engine, "y" * 4000, max_tokens=1)
        elapsed = time.perf_counter() - started
    finally:
        await engine.stop()
    model = EngineModel(profile)
    model.add(SimRequest("r", tuple(block_segments(split_tokens("y" * 4000, 4), 16)), 1))
    plan = model.plan()
    assert plan is not None and plan.duration_s == pytest.approx(0.1)
    # The engine sleeps what the model says (a lower bound: a loaded machine only adds);
    # 10 ms of slack for the event loop's clock resolution.
    assert elapsed >= plan.duration_s - 0.01


async def test_cancelled_request_is_aborted_in_the_model() -> None:
    engine = SimEngine(SimParams(speed=1))
    await engine.start()
    try:
        stream = engine.generate(EngineRequest("long", "z" * 64, max_tokens=10_000))
        assert isinstance(stream, AsyncGenerator)  # closing it is how a caller cancels
        await stream.__anext__()
        await stream.aclose()
        assert engine.model.idle
    finally:
        await engine.stop()


async def test_without_prefix_caching_nothing_is_reused() -> None:
    engine = SimEngine(SimParams(profile=EngineProfile(), speed=100, prefix_caching=False))
    await engine.start()
    try:
        base = "the same long system prompt " * 20
        await _run(engine, base + "first", rid="a")
        second = (await _run(engine, base + "second", rid="b"))[-1]
    finally:
        await engine.stop()
    assert second.cached_prompt_tokens == 0 and second.prompt_tokens > 100


def test_stop_at_ends_at_the_token_completing_the_first_stop_written() -> None:
    out = ["Thou", "ght:", " a\nO", "bser", "vati", "on: ", "x"]
    assert stop_at(out, ("\nObservation:",)) == (6, len("Thought: a"))  # tokens through "on: "
    assert stop_at(out, ("Observation", "ght")) == (2, len("Thou"))  # the one completed first wins
    assert stop_at(out, ("nowhere",)) is None and stop_at(out, ()) is None


async def test_a_stop_sequence_ends_a_scripted_reply_before_it() -> None:
    from inferx.sim.script import SimScript

    reply = "Thought: look it up\nAction: track[7]\nObservation: invented"
    engine = SimEngine(_fast(), script=SimScript.from_data([{"reply": reply}]))
    await engine.start()
    try:
        request = EngineRequest("r", "x" * 40, max_tokens=100, stop=("\nObservation:",))
        chunks = [c async for c in engine.generate(request)]
        plain = await _run(engine, "y" * 40, max_tokens=100, rid="p")
    finally:
        await engine.stop()
    assert "".join(c.text for c in chunks) == "Thought: look it up\nAction: track[7]"
    final = chunks[-1]
    assert final.finish_reason == "stop"
    assert final.completion_tokens == -(-len("Thought: look it up\nAction: track[7]\nObservation:") // 4)
    assert "".join(c.text for c in plain) == reply and plain[-1].finish_reason == "stop"
