"""The engine interface the model-worker serves. Engines: `vllm` (in-process AsyncLLM,
the default), `sim` (a documented latency model for benchmarks and fast tests)."""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from inferx.chat_template import Chat
from inferx.tokens import estimate_tokens
from inferx_worker.kv_events import KvEventHub


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt: str
    # None: not set, as OpenAI and vLLM mean it: until the model stops or prompt +
    # completion fill the engine's context (its max_model_len).
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # Stop sequences: the completion ends before the first one the model writes, which is
    # left out of the text (finish reason "stop"), as vLLM's `stop`.
    stop: tuple[str, ...] = ()
    # Structured output: OpenAI's response_format ({"type": "json_object"} or
    # {"type": "json_schema", "json_schema": {"schema": ...}}); None = free text. The
    # SIMULATED engine's text is synthetic and does not follow it.
    response_format: dict[str, Any] | None = None
    priority: int = 0  # lower runs first (vLLM's convention)
    # The prompt is a chat template's rendering (Engine.render_chat): it holds the special
    # tokens the template wrote (a BOS, say), and engines add none when tokenizing it.
    templated: bool = False
    # The chat the prompt is a rendering of, where the hop is a chat sent whole (None for
    # a prompt, and for a chat the context guard cut): an engine whose `sends_chats()`
    # sends it instead of the prompt.
    chat: Chat | None = None
    # Report the context's blocks on the last chunk (EngineChunk.context_blocks); off when
    # the caller does not read them (GenerateRequest.skip_context_blocks).
    context_blocks: bool = True


@dataclass(frozen=True)
class EngineChunk:
    """Text produced since the previous chunk. The last chunk has finished=True and
    carries the final token counts."""

    text: str
    finished: bool = False
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    # Last chunk: the whole blocks of prompt + output as the engine caches them, keyed
    # as its KV events key them ((key, tokens); empty when it reports no KV events).
    context_blocks: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class EngineCapacity:
    kv_capacity_tokens: int
    max_concurrency: int
    block_size: int
    # A KV offload tier in host memory (evicted prefixes come back from there): its
    # size and how fast a load runs; 0 = none.
    host_kv_capacity_tokens: int = 0
    host_kv_load_tokens_per_s: float = 0.0


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    kv_usage_ratio: float


@dataclass(frozen=True)
class EngineCounters:
    """Totals since the engine started (what vLLM's /metrics counts)."""

    prompt_tokens: int
    cached_prompt_tokens: int  # prompt tokens found in the prefix cache
    generation_tokens: int
    preemptions: int


class Engine(abc.ABC):
    name: str = ""
    model_path: str = ""

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model; return when the engine can serve."""

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncGenerator[EngineChunk, None]:
        """Stream the completion. Cancelling the iteration aborts the request."""

    def render_chat(self, chat: Chat) -> str | None:
        """The prompt the model's own chat template makes of `chat` (ending with the
        generation prompt); None when this engine has no template, and the worker runs
        InferX's generic rendering that came with the chat. Raises
        inferx.chat_template.ChatTemplateError when the template refuses the chat."""
        return None

    def sends_chats(self) -> bool:
        """True when this engine sends a chat whole (EngineRequest.chat) to a server that
        renders it with the model's own template (the `openai` engine on
        /v1/chat/completions), rather than running a prompt."""
        return False

    def chat_template_source(self) -> str | None:
        """The model's chat template (Jinja text), None when this engine knows none:
        the worker reads from it how the model writes tool calls."""
        return None

    def writes_tool_call_format(self) -> str | None:
        """The format this engine itself writes tool calls in, None when they are the
        model's own text. An engine whose server reads the calls out of the model's text
        and hands them apart (the `openai` engine on /v1/chat/completions) writes them
        back in a format it chooses; the routers must read that one, so the worker
        registers it (a model mapping that says another is refused, not misread)."""
        return None

    def writes_reasoning_parser(self) -> str | None:
        """The reasoning parser that reads this engine's own writing of a model's thinking
        (the `openai` engine writes a server's reasoning_content between <think> tags),
        None when the thinking is the model's own text."""
        return None

    def count_tokens(self, prompt: str) -> int:
        """Prompt tokens as this engine counts them (an estimate unless overridden)."""
        return estimate_tokens(prompt)

    def kv_events(self) -> KvEventHub | None:
        """Where this engine's prefix-cache changes are published (None: it reports none)."""
        return None

    @abc.abstractmethod
    def capacity(self) -> EngineCapacity: ...

    @abc.abstractmethod
    def load(self) -> EngineLoad: ...

    def counters(self) -> EngineCounters | None:
        """Token and preemption totals, where the engine keeps them (None: it does not)."""
        return None

    async def stop(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Free the engine's resources."""


class EngineError(Exception):
    """The engine could not be created or failed; the message says why."""
