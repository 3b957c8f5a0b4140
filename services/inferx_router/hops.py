"""The model hop as the router's chain walker hands it to an executor, and what comes
back: plain values, so the walker runs (and is unit-tested) without gRPC."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from inferx.scheduling.views import Tier


@dataclass(frozen=True)
class NextHop:
    """A model hop that may follow this one: what look-ahead reserves for."""

    hop_id: str
    model: str
    prompt_tokens: int  # estimated: this hop's prompt plus its output
    max_tokens: int


@dataclass(frozen=True)
class ModelHop:
    run_id: str
    hop_id: str  # the node id
    session_id: str
    chain_name: str
    chain_version: int
    tier: Tier
    priority: int  # the node's priority rank, 0 (high) .. 3 (low)
    deadline_unix_ms: int  # the chain's end-to-end deadline
    hop_index: int  # model hops of the run finished before this one
    remaining_hops: int | None  # model hops of the run after this one; None = unknown (a dynamic program)
    remaining_critical_path_ms: float  # expected time left on the longest path, this hop included
    next_hops: tuple[NextHop, ...]
    model: str
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop sequences (the OpenAI front's calls)
    response_format_json: str = ""  # structured output (OpenAI's response_format); "" = free text
    max_context_tokens: int = 0
    truncate_context: bool = False
    chat_json: str = ""  # a chat for the worker's chat template (the OpenAI front's calls); "" = none
    # The client's KV retention hint for its program after this hop (HopContext.kv_retention_s);
    # None = none given.
    kv_retention_s: float | None = None
    # The shared head the prompt starts with (HopContext.prefix_id / prefix_tokens,
    # inferx.tokens.shared_prefix); "" / 0 = none named.
    prefix_id: str = ""
    prefix_tokens: int = 0


@dataclass(frozen=True)
class HopDone:
    text: str
    worker_id: str
    pool: str = ""
    queue_ms: float = 0.0
    engine_ms: float = 0.0
    ttft_ms: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    finish_reason: str = ""
    cost: float = 0.0  # set by the caller that prices it (inferx.pricing); 0 = unpriced


class ModelExecutor(Protocol):
    async def run_hop(self, hop: ModelHop, timeout_s: float, on_dispatched: Callable[[str], None]) -> HopDone:
        """Run one model hop within `timeout_s`. Raises TimeoutError when the time runs
        out, an InferxError for a failure the caller may retry or degrade around."""
        ...


class WorkerHints:
    """Where each chain's latest model hop ran, per pool, as the router saw it (pure:
    time passed in). Sent with the chain's next hop in that pool (`HopContext.
    last_worker_id`) so a scheduler that has no record of the chain -- it took the pool
    over from one that died -- keeps it on the worker that holds its context.

    Keyed as the scheduler keys affinity: the chain key (session id, else run id) and
    the pool. Bounded: least recently used entries go past `capacity`, and an entry is
    not sent after `ttl_s` (the worker has likely evicted the context by then)."""

    def __init__(self, capacity: int = 100_000, ttl_s: float = 600.0) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._last: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def get(self, chain_key: str, pool: str, now: float) -> str:
        """The worker of the chain's latest finished hop in the pool; "" = none known."""
        entry = self._last.get((chain_key, pool))
        if entry is None:
            return ""
        worker_id, at = entry
        if now - at > self.ttl_s:
            del self._last[(chain_key, pool)]
            return ""
        return worker_id

    def put(self, chain_key: str, pool: str, worker_id: str, now: float) -> None:
        if not chain_key or not worker_id:
            return
        key = (chain_key, pool)
        self._last[key] = (worker_id, now)
        self._last.move_to_end(key)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
