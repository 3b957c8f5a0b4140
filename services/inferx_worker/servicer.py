"""ModelWorker gRPC servicer: a thin layer from protobuf to the engine and back."""

from __future__ import annotations

import itertools
import json
import time

import grpc

from inferx import hopstream
from inferx.chat_template import Chat
from inferx.context_guard import ContextTooLong, check_or_truncate
from inferx.errors import InferxError, Internal, InvalidArgument, Unavailable, Unimplemented
from inferx.openai_compat import schema
from inferx.scheduling.prefix_index import KvEvent
from inferx.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from inferx_worker import metrics
from inferx_worker.engines.base import Engine, EngineError, EngineRequest

# The engine's request ids need only be unique in this process (with the run and hop they
# are also readable in its logs): a counter, not a uuid4 per hop (~2% of the worker's CPU
# under load, issue #14).
_REQUEST_SEQ = itertools.count(1)


class ModelWorkerServicer(worker_pb2_grpc.ModelWorkerServicer):
    def __init__(self, engine: Engine, worker_id: str) -> None:
        self._engine = engine
        self._worker_id = worker_id

    async def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if not request.prompt:
            raise InvalidArgument("prompt: must not be empty")
        max_tokens = request.sampling.max_tokens or None  # not set: up to the context room
        prompt, templated, chat = self._prompt(request)
        guarded = await self._guard_context(prompt, request.sampling, max_tokens or 1)
        if guarded != prompt:  # the guard cut the context: the cut prompt runs, not the whole chat
            prompt, chat = guarded, None
        if request.chat_json:
            kind = (
                "server"
                if chat is not None and self._engine.sends_chats()
                else "model"
                if templated
                else "generic"
            )
            metrics.CHAT_RENDERS.labels(kind).inc()
        engine_request = EngineRequest(
            request_id=":".join(
                (
                    request.context.run_id or "adhoc",
                    request.context.hop_id or "hop",
                    format(next(_REQUEST_SEQ), "08x"),
                )
            ),
            prompt=prompt,
            # A replay's stop_after_tokens plays the model's EOS within the cap.
            max_tokens=min(filter(None, (max_tokens, request.sampling.stop_after_tokens)), default=None),
            temperature=request.sampling.temperature,
            top_p=request.sampling.top_p or 1.0,
            seed=request.sampling.seed if request.sampling.HasField("seed") else None,
            stop=tuple(request.sampling.stop),
            response_format=response_format(request.sampling.response_format_json),
            priority=request.context.priority,
            templated=templated,
            chat=chat,
            context_blocks=not request.skip_context_blocks,
        )
        started = time.perf_counter()
        first_token_at: float | None = None
        metrics.REQUESTS_RUNNING.inc()
        try:
            async for chunk in self._guarded(engine_request):
                if chunk.text and first_token_at is None:
                    first_token_at = time.perf_counter()
                if not chunk.finished:
                    yield worker_pb2.GenerateChunk(text=chunk.text)
                    continue
                engine_ms = (time.perf_counter() - started) * 1000
                ttft_ms = ((first_token_at or time.perf_counter()) - started) * 1000
                metrics.observe_finished(chunk, engine_ms)
                yield worker_pb2.GenerateChunk(
                    text=chunk.text,
                    finished=True,
                    finish_reason=chunk.finish_reason,
                    usage=common_pb2.TokenUsage(
                        prompt_tokens=chunk.prompt_tokens,
                        completion_tokens=chunk.completion_tokens,
                        cached_prompt_tokens=chunk.cached_prompt_tokens,
                    ),
                    worker_id=self._worker_id,
                    engine_ms=engine_ms,
                    ttft_ms=ttft_ms,
                    context_blocks=[worker_pb2.KvBlock(key=k, tokens=t) for k, t in chunk.context_blocks],
                )
        finally:
            metrics.REQUESTS_RUNNING.dec()

    async def GenerateStream(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        """Generate's requests, many on one stream (`inferx.hopstream`)."""
        await hopstream.StreamServer(context, self.Generate, hopstream.GENERATE).serve()

    def _prompt(self, request: worker_pb2.GenerateRequest) -> tuple[str, bool, Chat | None]:
        """A chat rendered by the model's own template, where the engine has one; else
        the prompt as it came (for a chat: the router's generic rendering of it). True
        with a template's rendering. The chat itself, for engines that send it whole."""
        if not request.chat_json:
            return request.prompt, False, None
        try:
            chat = Chat.from_json(request.chat_json)
            rendered = self._engine.render_chat(chat)
        except ValueError as exc:  # a malformed chat_json, or ChatTemplateError (the template refused it)
            raise InvalidArgument(str(exc)) from None
        return (request.prompt, False, chat) if rendered is None else (rendered, True, chat)

    async def _guard_context(self, prompt: str, sampling, max_tokens: int) -> str:
        if not sampling.max_context_tokens:
            return prompt
        try:
            guarded, dropped = check_or_truncate(
                prompt,
                max_context_tokens=sampling.max_context_tokens,
                max_tokens=max_tokens,
                count=self._engine.count_tokens,
                truncate=sampling.truncate_context,
            )
        except ContextTooLong as exc:
            raise InvalidArgument(f"context guard: {exc}") from None
        if dropped:
            metrics.CONTEXT_TRUNCATIONS.inc()
        return guarded

    async def _guarded(self, request: EngineRequest):
        """The engine's failures as status codes. A request the engine rejects (e.g. a
        prompt longer than the model allows) is INVALID_ARGUMENT: the caller's fault,
        no reason to take this worker out. A dead engine is UNAVAILABLE: the scheduler
        stops sending here and re-dispatches. Anything else is INTERNAL (this request
        failed; the worker may be fine)."""
        try:
            async for chunk in self._engine.generate(request):
                yield chunk
        except EngineError as exc:
            raise engine_failure(self._engine, exc) from None

    async def KvEvents(self, request: worker_pb2.KvEventsRequest, context: grpc.aio.ServicerContext):
        hub = self._engine.kv_events()
        if hub is None:
            raise Unimplemented(f"engine '{self._engine.name}' reports no KV events")
        async for batch in hub.subscribe():
            yield worker_pb2.KvEventBatch(events=[_event_pb(event) for event in batch])

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        load = self._engine.load()
        capacity = self._engine.capacity()
        return worker_pb2.WorkerLoad(
            worker_id=self._worker_id,
            running=load.running,
            waiting=load.waiting,
            kv_capacity_tokens=capacity.kv_capacity_tokens,
            kv_usage_ratio=load.kv_usage_ratio,
            host_kv_capacity_tokens=capacity.host_kv_capacity_tokens,
            host_kv_load_tokens_per_s=capacity.host_kv_load_tokens_per_s,
        )


def engine_failure(engine: Engine, exc: EngineError) -> InferxError:
    """An engine's failure as a status (the gRPC and the sim worker's HTTP paths alike):
    a request the engine rejects is INVALID_ARGUMENT, a dead engine UNAVAILABLE,
    anything else INTERNAL."""
    if _rejected_request(exc.__cause__):
        return InvalidArgument(str(exc))
    check = getattr(engine, "alive", None)
    if callable(check) and not check():
        return Unavailable(str(exc))
    return Internal(str(exc))


def _rejected_request(cause: BaseException | None) -> bool:
    """ValueError/TypeError, or an engine's own "client error" class (vLLM raises
    VLLMValidationError, a VLLMClientError, for prompts longer than the model allows)."""
    if cause is None:
        return False
    if isinstance(cause, ValueError | TypeError):
        return True
    return any(cls.__name__.endswith(("ClientError", "ValidationError")) for cls in type(cause).__mro__)


_KIND = {
    "stored": worker_pb2.KvEvent.KIND_STORED,
    "removed": worker_pb2.KvEvent.KIND_REMOVED,
    "cleared": worker_pb2.KvEvent.KIND_CLEARED,
}


def _event_pb(event: KvEvent) -> worker_pb2.KvEvent:
    return worker_pb2.KvEvent(
        kind=_KIND[event.kind], blocks=[worker_pb2.KvBlock(key=k, tokens=t) for k, t in event.blocks]
    )


def response_format(text: str) -> dict | None:
    """SamplingOptions.response_format_json as the engine takes it; INVALID_ARGUMENT for
    one that is not a JSON object with a type (the router checks it; a direct caller may not)."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidArgument("sampling.response_format_json: not valid JSON") from None
    if not isinstance(value, dict) or value.get("type") not in schema.RESPONSE_FORMATS:
        raise InvalidArgument("sampling.response_format_json: expected OpenAI's response_format object")
    return None if value["type"] == "text" else value
