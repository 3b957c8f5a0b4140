"""`openai`: any OpenAI-compatible completions server (vLLM's `vllm serve`, SGLang, TGI,
Ollama, ...) behind an InferX worker. Streams `/v1/completions`; closing the stream
when a hop is abandoned makes the server abort the request.

What the server does not report, InferX cannot know: KV capacity comes from
`--openai-kv-capacity-tokens`, and cached prompt tokens only where the server fills
`usage.prompt_tokens_details.cached_tokens` (vLLM with `--enable-prompt-tokens-details`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferx_worker.engines.registry import register_engine

if TYPE_CHECKING:
    from inferx_worker.config import WorkerSettings

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from inferx_worker.engines.base import (
    Engine,
    EngineCapacity,
    EngineChunk,
    EngineError,
    EngineLoad,
    EngineRequest,
)


class OpenAIEngine(Engine):
    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str = "",
        kv_capacity_tokens: int = 100_000,
        max_concurrency: int = 32,
        send_priority: bool = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model_path = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._capacity = EngineCapacity(kv_capacity_tokens, max_concurrency, 0)
        self._send_priority = send_priority
        self._client: httpx.AsyncClient | None = None
        self._running = 0

    async def start(self) -> None:
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=None)
        try:
            reply = await self._client.get("/v1/models", timeout=10)
            reply.raise_for_status()
        except httpx.HTTPError as exc:
            raise EngineError(
                f"the OpenAI-compatible server at {self.base_url} is not answering: {exc}"
            ) from exc
        served = [m.get("id") for m in reply.json().get("data", [])]
        if served and self.model_path not in served:
            raise EngineError(
                f"{self.base_url} serves {', '.join(map(str, served))}, not '{self.model_path}' "
                "(set --model-path to one of them)"
            )

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def capacity(self) -> EngineCapacity:
        return self._capacity

    def load(self) -> EngineLoad:
        return EngineLoad(self._running, 0, 0.0)

    def _body(self, request: EngineRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model_path,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.seed is not None:
            body["seed"] = request.seed
        if self._send_priority:
            body["priority"] = request.priority  # vLLM's priority scheduling; others ignore it
        return body

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        if self._client is None:
            raise EngineError("the openai engine is not started")
        self._running += 1
        finish_reason, usage = "", {}
        try:
            async with self._client.stream("POST", "/v1/completions", json=self._body(request)) as reply:
                if reply.status_code >= 400:
                    detail = (await reply.aread()).decode(errors="replace")[:500]
                    cause = ValueError(detail) if reply.status_code < 500 else RuntimeError(detail)
                    raise EngineError(f"{self.base_url} answered {reply.status_code}: {detail}") from cause
                async for line in reply.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices") or ():
                        if choice.get("text"):
                            yield EngineChunk(text=choice["text"])
                        if choice.get("finish_reason"):
                            finish_reason = choice["finish_reason"]
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.base_url}: {exc}") from exc
        finally:
            self._running -= 1
        details = usage.get("prompt_tokens_details") or {}
        yield EngineChunk(
            text="",
            finished=True,
            finish_reason=finish_reason or "stop",
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            cached_prompt_tokens=int(details.get("cached_tokens") or 0),
        )


@register_engine(
    "openai",
    summary="any OpenAI-compatible server (vLLM, SGLang, TGI, Ollama) over HTTP",
    standalone=False,  # needs that server running
)
def from_settings(settings: WorkerSettings) -> OpenAIEngine:
    return OpenAIEngine(
        settings.openai_base_url,
        settings.model_path,
        api_key=settings.openai_api_key,
        kv_capacity_tokens=settings.openai_kv_capacity_tokens,
        max_concurrency=settings.max_num_seqs,
    )
