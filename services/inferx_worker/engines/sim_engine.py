"""`sim`: a latency model of a continuous-batching GPU engine. SIMULATED -- it runs no
model. It exists for benchmarks and fast tests and is only used when asked for with
`--engine sim`; it is never chosen silently.

The model (defaults from Vidur's published profile of Llama-3-8B on one A100):
  prefill time  = uncached prompt tokens / prefill_tokens_per_s
  decode step   = decode_step_ms * (1 + batch_slowdown * (batch - 1) / 31)
                  (about 10 ms at batch 1, about 13% slower at batch 32)
  prefix cache  = whole blocks of earlier prompts are reused (LRU over block hashes),
                  so cached tokens skip prefill, as in vLLM's automatic prefix caching.
`speed` divides every duration, so tests can run a "GPU" 20x faster than real time.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from inferx_worker.engines.base import (
    Engine,
    EngineCapacity,
    EngineChunk,
    EngineLoad,
    EngineRequest,
)

_WORDS = (
    "order shipping refund account agent support delivery status tracking update "
    "customer request answer policy invoice package warehouse courier return item"
).split()


@dataclass(frozen=True)
class SimParams:
    prefill_tokens_per_s: float = 15_000.0
    decode_step_ms: float = 10.0
    batch_slowdown: float = 0.13
    kv_capacity_tokens: int = 262_144
    block_size: int = 16
    max_concurrency: int = 64
    speed: float = 1.0
    chars_per_token: float = 4.0


def _tokens(text: str, chars_per_token: float) -> list[str]:
    # Fixed-width "tokens" keep prefix matching exact and cheap.
    width = max(1, int(chars_per_token))
    return [text[i : i + width] for i in range(0, len(text), width)]


class SimEngine(Engine):
    name = "sim"

    def __init__(self, params: SimParams | None = None, model_path: str = "sim") -> None:
        self.params = params or SimParams()
        self.model_path = model_path
        self._running = 0
        self._waiting = 0
        self._blocks: OrderedDict[str, None] = OrderedDict()  # prefix-cache block hashes, LRU
        self._slots: asyncio.Semaphore | None = None

    async def start(self) -> None:
        self._slots = asyncio.Semaphore(self.params.max_concurrency)

    def capacity(self) -> EngineCapacity:
        p = self.params
        return EngineCapacity(p.kv_capacity_tokens, p.max_concurrency, p.block_size)

    def load(self) -> EngineLoad:
        used = len(self._blocks) * self.params.block_size
        return EngineLoad(self._running, self._waiting, min(1.0, used / self.params.kv_capacity_tokens))

    def count_tokens(self, prompt: str) -> int:
        return len(_tokens(prompt, self.params.chars_per_token))

    def step_ms(self, batch: int) -> float:
        p = self.params
        return p.decode_step_ms * (1 + p.batch_slowdown * (max(batch, 1) - 1) / 31)

    def _cached_and_remember(self, prompt_tokens: list[str]) -> int:
        """Count leading whole blocks already cached, then cache all whole blocks."""
        size = self.params.block_size
        digest = hashlib.sha1()
        cached = 0
        still_prefix = True
        for start in range(0, len(prompt_tokens) - size + 1, size):
            digest.update("".join(prompt_tokens[start : start + size]).encode())
            key = digest.hexdigest()
            if still_prefix and key in self._blocks:
                cached += size
                self._blocks.move_to_end(key)
            else:
                still_prefix = False
                self._blocks[key] = None
        max_blocks = self.params.kv_capacity_tokens // size
        while len(self._blocks) > max_blocks:
            self._blocks.popitem(last=False)
        return cached

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        assert self._slots is not None, "start() first"
        p = self.params
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        self._running += 1
        try:
            prompt_tokens = _tokens(request.prompt, p.chars_per_token)
            cached = self._cached_and_remember(prompt_tokens)
            prefill_s = (len(prompt_tokens) - cached) / p.prefill_tokens_per_s
            await asyncio.sleep(prefill_s / p.speed)
            produced = 0
            for i in range(request.max_tokens):
                await asyncio.sleep(self.step_ms(self._running) / 1000 / p.speed)
                word = _WORDS[(len(prompt_tokens) + i * 7) % len(_WORDS)]
                produced += 1
                yield EngineChunk(text=(" " if i else "") + word)
            yield EngineChunk(
                text="",
                finished=True,
                finish_reason="length",
                prompt_tokens=len(prompt_tokens),
                completion_tokens=produced,
                cached_prompt_tokens=cached,
            )
        finally:
            self._running -= 1
            self._slots.release()
