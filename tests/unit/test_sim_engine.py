"""The SIMULATED engine's latency model: prefill per token, decode per step growing
with batch size, prefix-cache reuse of whole blocks."""

import time

from inferx_worker.engines.base import EngineRequest
from inferx_worker.engines.sim_engine import SimEngine, SimParams


async def _run(engine: SimEngine, prompt: str, max_tokens: int = 4):
    chunks = [c async for c in engine.generate(EngineRequest("r", prompt, max_tokens=max_tokens))]
    return chunks


def test_decode_step_grows_with_batch_like_the_published_profile() -> None:
    engine = SimEngine(SimParams(decode_step_ms=10.0, batch_slowdown=0.13))
    assert engine.step_ms(1) == 10.0
    assert abs(engine.step_ms(32) - 11.3) < 1e-9


async def test_streams_tokens_and_reports_usage() -> None:
    engine = SimEngine(SimParams(speed=100))
    await engine.start()
    chunks = await _run(engine, "x" * 400, max_tokens=5)
    assert [c.finished for c in chunks] == [False] * 5 + [True]
    final = chunks[-1]
    assert final.completion_tokens == 5 and final.prompt_tokens == 100
    assert final.cached_prompt_tokens == 0


async def test_shared_prefix_is_served_from_the_prefix_cache() -> None:
    engine = SimEngine(SimParams(speed=100, block_size=16))
    await engine.start()
    base = "the same long system prompt " * 20
    await _run(engine, base + "first question")
    second = (await _run(engine, base + "second question"))[-1]
    assert second.cached_prompt_tokens >= 16 * ((len(base) // 4) // 16) - 16
    assert second.cached_prompt_tokens < second.prompt_tokens


async def test_prefill_time_follows_uncached_tokens() -> None:
    engine = SimEngine(SimParams(prefill_tokens_per_s=10_000, decode_step_ms=0.001))
    await engine.start()
    started = time.perf_counter()
    await _run(engine, "y" * 4000, max_tokens=1)  # 1000 tokens -> 100 ms of prefill
    assert time.perf_counter() - started >= 0.09
    assert engine.load().running == 0
