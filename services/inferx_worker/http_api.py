"""OpenAI-compatible HTTP on the model-worker (`--openai-http-port`, sim engine only), so
any OpenAI-compatible router (vllm-router, ...) can stand in front of the SIMULATED GPUs.

The same engine object serves this and the gRPC `ModelWorker`: a call over HTTP and one
over gRPC share the batch, the KV pool and the prefix cache. Endpoints:

  POST /v1/chat/completions   (stream or not; rendered by the model's chat template where
                              the engine has one, as on gRPC, else by inferx.openai_compat)
  POST /v1/completions        (stream or not)
  GET  /v1/models             the pool name and the engine's model path
  GET  /v1/models/{model}     one of them (404 model_not_found for another)
  GET  /health                200 once the engine serves, 503 before and while draining
  GET  /metrics               the engine's state under vLLM's metric names (vllm:
                              num_requests_running/waiting, kv_cache_usage_perc, ...):
                              what vllm-router's program scheduling reads
  GET  /get_load              {"load": running + waiting, ...}: vllm-router's power_of_two
  GET  /get_server_info, /get_model_info, /version

Request bodies, the chat rendering, response shapes and errors are
`inferx.openai_compat`'s, as on the router's front; `priority` (vLLM's extension, lower
runs first) is honoured. `usage.prompt_tokens_details.cached_tokens` is the engine's
prefix-cache hit. A chat call that offers tools has its reply read as the router's
fronts read it (`schema.reply_reader`, in the worker's tool-call format: its
--tool-call-format, else its chat template's): tool calls (a --sim-script reply writes
them) come back as `message.tool_calls`, or streamed as OpenAI's tool-call deltas, with
the finish reason "tool_calls", and tool_choice "required" or named is checked. A
stream starts with its first chunk, so a call that fails before it (a reply held for
its tool_choice too) gets its HTTP status.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from pydantic import Field
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from inferx import __version__
from inferx.chat_template import Chat
from inferx.errors import Unavailable
from inferx.openai_compat import schema
from inferx.openai_compat.errors import InvalidField, ModelNotFound
from inferx.openai_compat.reasoning import check_reasoning_parser
from inferx.openai_compat.render import chat_json, render_chat
from inferx.openai_compat.toolcalls import DEFAULT_FORMAT, check_format
from inferx.openai_http import CLIENT_GONE, error_reply_body, guarded, http_error, unless_client_leaves
from inferx_worker import metrics
from inferx_worker.engines.base import Engine, EngineChunk, EngineError, EngineRequest
from inferx_worker.servicer import engine_failure

log = logging.getLogger("inferx.worker.http")

SERVICE = "model-worker"  # what a generic 500 names


class WorkerChatRequest(schema.ChatCompletionRequest):
    priority: int = Field(0, description="vLLM's extension: lower runs first")


class WorkerCompletionRequest(schema.CompletionRequest):
    priority: int = Field(0, description="vLLM's extension: lower runs first")


class WorkerHttpApi:
    def __init__(
        self,
        engine: Engine,
        pool: str,
        worker_id: str,
        tool_call_format: str = DEFAULT_FORMAT,
        reasoning_parser: str = "",
    ) -> None:
        self._engine = engine
        self._pool = pool
        self._worker_id = worker_id
        self.tool_call_format = check_format(tool_call_format)  # what replies' tool calls are read in
        self.reasoning_parser = check_reasoning_parser(reasoning_parser)  # "": replies have no thinking apart
        self._created = int(time.time())
        self.serving = False  # /health: set once the engine is up, cleared on drain

    @property
    def model_names(self) -> list[str]:
        names = [self._pool]
        if self._engine.model_path and self._engine.model_path not in names:
            names.append(self._engine.model_path)
        return names

    @property
    def max_model_len(self) -> int:
        """Prompt + completion tokens one request may take: the KV pool (a sequence
        longer than that could never be scheduled)."""
        return self._engine.capacity().kv_capacity_tokens

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", guarded(self.chat_completions, SERVICE), methods=["POST"]),
                Route("/v1/completions", guarded(self.completions, SERVICE), methods=["POST"]),
                Route("/v1/models", guarded(self.models, SERVICE), methods=["GET"]),
                Route("/v1/models/{model:path}", guarded(self.model, SERVICE), methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/get_load", self.get_load, methods=["GET"]),
                Route("/get_server_info", self.server_info, methods=["GET"]),
                Route("/get_model_info", self.model_info, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
            ],
            exception_handlers={HTTPException: http_error},
        )

    # ----- model calls --------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        body = schema.parse_body(WorkerChatRequest, await request.body())
        return await self._serve(request, body, self._chat_prompt(body), body.priority, chat=True)

    def _chat_prompt(self, body: WorkerChatRequest) -> str:
        """The model's own chat template where the engine has one (as the gRPC path
        renders a front's chat_json), else InferX's generic rendering."""
        try:
            rendered = self._engine.render_chat(Chat.from_json(chat_json(body.messages, body.tools)))
        except ValueError as exc:  # ChatTemplateError: the template refused this chat
            raise InvalidField("messages", str(exc)) from None
        metrics.CHAT_RENDERS.labels("generic" if rendered is None else "model").inc()
        if rendered is not None:
            return rendered
        return render_chat(body.messages, body.tools, body.tool_choice)

    async def completions(self, request: Request) -> Response:
        body = schema.parse_body(WorkerCompletionRequest, await request.body())
        if not body.prompt_text:
            raise InvalidField("prompt", "must not be empty")
        return await self._serve(request, body, body.prompt_text, body.priority, chat=False)

    async def _serve(
        self, request: Request, body: schema.CallRequest, prompt: str, priority: int, *, chat: bool
    ) -> Response:
        if body.model not in self.model_names:
            raise ModelNotFound(body.model)
        if not self.serving:
            raise Unavailable("the engine is not serving (starting or draining)", retry_after_s=1.0)
        max_tokens = body.output_tokens() or None  # not set: up to the context room
        prompt_tokens = self._engine.count_tokens(prompt)
        if prompt_tokens + (max_tokens or 1) > self.max_model_len:
            wants = (
                f"max_tokens asks for {max_tokens:,} more" if max_tokens else "no room is left for a reply"
            )
            raise InvalidField(
                "messages" if chat else "prompt",
                f"this model's maximum context length is {self.max_model_len:,} tokens; the prompt "
                f"has {prompt_tokens:,} and {wants}",
            )
        call_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        engine_request = EngineRequest(
            request_id=f"http:{call_id}",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            stop=tuple(body.stop_sequences),
            response_format=body.structured_output,
            priority=priority,
        )
        created = int(time.time())
        if body.stream:
            return await self._stream(engine_request, body, call_id, created, chat=chat)
        text: list[str] = []

        async def generate() -> EngineChunk:
            final: EngineChunk | None = None
            async with contextlib.aclosing(self._generate(engine_request)) as generated:  # aborts on cancel
                async for chunk in generated:
                    text.append(chunk.text)
                    if chunk.finished:
                        final = chunk
            assert final is not None  # _generate always ends with the finished chunk
            return final

        final = await unless_client_leaves(request, generate())
        if final is None:  # the client went away: the engine call was aborted
            return Response(status_code=CLIENT_GONE)
        usage = _usage(final)
        if chat:
            reader = schema.reply_reader(body, self.tool_call_format, self.reasoning_parser)
            reader.feed("".join(text))
            reader.finish()  # ToolChoiceNotFollowed: a 500, as on the router
            reply = schema.chat_reply(call_id, created, body.model, reader, final.finish_reason, usage)
        else:
            reply = schema.text_completion(
                call_id, created, body.model, "".join(text), final.finish_reason, usage
            )
        return JSONResponse(reply)

    async def _stream(
        self,
        engine_request: EngineRequest,
        body: schema.CallRequest,
        call_id: str,
        created: int,
        *,
        chat: bool,
    ) -> Response:
        model = body.model
        object_ = "chat.completion.chunk" if chat else "text_completion"
        chat_chunks = schema.ChatChunks(
            call_id,
            created,
            model,
            reader=schema.reply_reader(body, self.tool_call_format, self.reasoning_parser),
        )

        async def payloads() -> AsyncGenerator[dict[str, Any], None]:
            """The chunks after the role's (a chat's tool calls as OpenAI's deltas); raises
            what fails the call (ToolChoiceNotFollowed at the end of a held reply too)."""
            final: EngineChunk | None = None
            # aclosing: closing this (the client went away) closes the engine's stream at
            # once, which aborts the request, rather than whenever it is collected.
            async with contextlib.aclosing(self._generate(engine_request)) as generated:
                async for piece in generated:
                    if piece.text and chat:
                        for payload in chat_chunks.text(piece.text):
                            yield payload
                    elif piece.text:
                        yield schema.text_completion(call_id, created, model, piece.text, None, None)
                    if piece.finished:
                        final = piece
            assert final is not None
            if chat:
                for payload in chat_chunks.finish(final.finish_reason):
                    yield payload
            else:
                yield schema.text_completion(call_id, created, model, "", final.finish_reason, None)
            if body.include_usage:
                yield schema.usage_chunk(call_id, created, model, object_, _usage(final))

        pieces = payloads()
        try:
            first = await anext(pieces)  # raises the call's error, if any, before the response starts
        except BaseException:
            await pieces.aclose()
            raise

        async def events() -> AsyncIterator[str]:
            try:
                if chat:
                    yield schema.sse(chat_chunks.start())
                yield schema.sse(first)
                try:
                    async for payload in pieces:
                        yield schema.sse(payload)
                except Exception as exc:
                    yield schema.sse(error_reply_body(exc, SERVICE))
                    return
                yield schema.SSE_DONE
            finally:
                await pieces.aclose()  # the client went away: the engine request is aborted

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def _generate(self, request: EngineRequest) -> AsyncGenerator[EngineChunk, None]:
        """The engine's chunks, with the gRPC path's metrics and error statuses."""
        started = time.perf_counter()
        metrics.REQUESTS_RUNNING.inc()
        try:
            async with contextlib.aclosing(self._engine.generate(request)) as chunks:
                async for chunk in chunks:
                    if chunk.finished:
                        metrics.observe_finished(chunk, (time.perf_counter() - started) * 1000)
                    yield chunk
        except EngineError as exc:
            raise engine_failure(self._engine, exc) from None
        finally:
            metrics.REQUESTS_RUNNING.dec()

    # ----- what routers read ----------------------------------------------------------

    async def models(self, request: Request) -> Response:
        data = schema.model_list(self.model_names, self._created)
        for entry in data["data"]:
            entry["max_model_len"] = self.max_model_len
        return JSONResponse(data)

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.model_names:
            raise ModelNotFound(name)
        return JSONResponse({**schema.model_card(name, self._created), "max_model_len": self.max_model_len})

    async def health(self, request: Request) -> Response:
        if self.serving:
            return Response(status_code=200)
        return PlainTextResponse("engine not serving", status_code=503)

    async def get_load(self, request: Request) -> Response:
        load = self._engine.load()
        return JSONResponse(
            {
                "load": load.running + load.waiting,
                "num_requests_running": load.running,
                "num_requests_waiting": load.waiting,
                "kv_cache_usage_perc": load.kv_usage_ratio,
            }
        )

    async def server_info(self, request: Request) -> Response:
        capacity = self._engine.capacity()
        return JSONResponse(
            {
                "engine": self._engine.name,
                "simulated": True,
                "worker_id": self._worker_id,
                "served_model_names": self.model_names,
                "model_path": self._engine.model_path,
                "max_model_len": self.max_model_len,
                "max_num_seqs": capacity.max_concurrency,
                "kv_capacity_tokens": capacity.kv_capacity_tokens,
                "block_size": capacity.block_size,
                "enable_prefix_caching": True,
                "version": __version__,
            }
        )

    async def model_info(self, request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": self._engine.model_path,
                "served_model_names": self.model_names,
                "is_generation": True,
            }
        )

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(
            vllm_metrics(self._engine, self._pool), media_type="text/plain; version=0.0.4; charset=utf-8"
        )


def _usage(final: EngineChunk) -> dict[str, Any]:
    return schema.usage(final.prompt_tokens, final.completion_tokens, final.cached_prompt_tokens)


# (name, type, help) of the vLLM metrics served, in vLLM's names; the values come from
# the engine's own state (load and counters), read when /metrics is called.
_VLLM_METRICS = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    ("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage (the name before vLLM V1)."),
    ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed."),
    ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed."),
    ("vllm:prefix_cache_queries_total", "counter", "Prefix-cache queries, in tokens."),
    ("vllm:prefix_cache_hits_total", "counter", "Prefix-cache hits, in tokens."),
    ("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions."),
)


def vllm_metrics(engine: Engine, model_name: str) -> str:
    """Prometheus text with the engine's state under vLLM's metric names (engine "0",
    one engine per worker)."""
    load = engine.load()
    counters = engine.counters()
    values: dict[str, float] = {
        "vllm:num_requests_running": load.running,
        "vllm:num_requests_waiting": load.waiting,
        "vllm:kv_cache_usage_perc": load.kv_usage_ratio,
        "vllm:gpu_cache_usage_perc": load.kv_usage_ratio,
    }
    if counters is not None:
        values |= {
            "vllm:prompt_tokens_total": counters.prompt_tokens,
            "vllm:generation_tokens_total": counters.generation_tokens,
            "vllm:prefix_cache_queries_total": counters.prompt_tokens,
            "vllm:prefix_cache_hits_total": counters.cached_prompt_tokens,
            "vllm:num_preemptions_total": counters.preemptions,
        }
    labels = f'{{engine="0",model_name="{model_name}"}}'
    lines = []
    for name, kind, help_ in _VLLM_METRICS:
        if name not in values:
            continue
        family = name.removesuffix("_total") if kind == "counter" else name
        lines += [
            f"# HELP {family} {help_}",
            f"# TYPE {family} {kind}",
            f"{name}{labels} {float(values[name])}",
        ]
    return "\n".join(lines) + "\n"
