"""The OpenAI-compatible HTTP front of the router (`--http-port`), served by uvicorn in
the router process's own event loop.

`POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses` and Anthropic's
`POST /v1/messages` (each call one model hop of its program, run by
`program_calls.ProgramCalls` -- the path `Router.CallModel` takes too -- through the
same `SchedulerExecutor` as declared chains' hops, so the scheduler's tiers, affinity
and deadlines apply; a Responses or Messages call is read as the chat call it means),
`GET /v1/models` and `GET /v1/models/{model}`. Request parsing, the chat rendering,
program identity, response shapes and error mapping are pure code in
`inferx.openai_compat`; this module is the I/O around them, and a `ReplyWriter` per API
puts a call's reply in that API's shapes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any, Protocol

from opentelemetry import context as otel_context
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from inferx import telemetry
from inferx.auth.model import Principal
from inferx.errors import NotFound
from inferx.httpserve import EmbeddedHttpServer
from inferx.limits import RequestLimits
from inferx.openai_compat import anthropic, responses, schema
from inferx.openai_compat.errors import BodyTooLarge, ModelNotFound, ResponseNotKept
from inferx.openai_compat.identity import ProgramIdentity, parse_identity
from inferx.openai_compat.schema import ReplyEvent
from inferx.openai_compat.toolcalls import Content
from inferx.openai_http import (
    CLIENT_GONE,
    Shape,
    error_reply_body,
    guarded,
    http_error,
    openai_shape,
    unless_client_leaves,
)
from inferx_router.access import AccessControl
from inferx_router.hops import HopDone
from inferx_router.program_calls import CallDone, ProgramCalls
from inferx_router.programs import Call

log = logging.getLogger("inferx.router.http")

SERVICE = "InferX router"  # what a generic 500 names


WORKER_HEADER = "X-InferX-Worker"  # the worker that ran the call (debugging, tests)
RUN_HEADER = "X-InferX-Run"  # the run id of the call's program record (`inferx trace`; not streamed)


class OpenAIFront:
    """The HTTP I/O around `ProgramCalls`, the path `Router.CallModel` takes too."""

    def __init__(
        self, calls: ProgramCalls, *, access: AccessControl, request_limits: RequestLimits | None = None
    ) -> None:
        self._access = access
        self._calls = calls
        self._request_limits = request_limits or RequestLimits()
        self._created = int(time.time())

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", guarded(self.chat_completions, SERVICE), methods=["POST"]),
                Route("/v1/completions", guarded(self.completions, SERVICE), methods=["POST"]),
                Route("/v1/responses", guarded(self.responses, SERVICE), methods=["POST"]),
                Route(
                    "/v1/messages", guarded(self.messages, SERVICE, anthropic.error_reply), methods=["POST"]
                ),
                # count_tokens (and whatever else Anthropic adds there): a 404 in Anthropic's shape
                Route(
                    "/v1/messages/{rest:path}",
                    guarded(self.not_served, SERVICE, anthropic.error_reply),
                    methods=["GET", "POST", "DELETE"],
                ),
                # retrieve, delete, cancel, input_items: InferX keeps no responses to find
                Route(
                    "/v1/responses/{rest:path}",
                    guarded(self.stored_response, SERVICE),
                    methods=["GET", "POST", "DELETE"],
                ),
                Route("/v1/models", guarded(self.models, SERVICE), methods=["GET"]),
                # the SDKs' models.retrieve; a model id may hold "/" (meta-llama/...)
                Route("/v1/models/{model:path}", guarded(self.model, SERVICE), methods=["GET"]),
            ],
            exception_handlers={HTTPException: http_error},
        )

    # ----- endpoints ----------------------------------------------------------------

    def model_names(self) -> list[str]:
        return self._calls.model_names()

    def _caller(self, request: Request) -> Principal:
        """The same bearer tokens as the gRPC API (every role may call a model), in
        `Authorization: Bearer` or, as Anthropic's SDKs send them, `x-api-key`."""
        api_key = request.headers.get("x-api-key")
        return self._access.authenticate(
            request.headers.get("authorization") or (f"Bearer {api_key}" if api_key else None)
        )

    async def models(self, request: Request) -> Response:
        self._caller(request)
        return JSONResponse(schema.model_list(self.model_names(), self._created))

    async def model(self, request: Request) -> Response:
        self._caller(request)
        name = request.path_params["model"]
        if name not in self.model_names():
            raise ModelNotFound(name)
        return JSONResponse(schema.model_card(name, self._created))

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, _read_chat)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, _read_completion)

    async def responses(self, request: Request) -> Response:
        return await self._serve(request, _read_responses)

    async def messages(self, request: Request) -> Response:
        return await self._serve(request, _read_messages)

    async def not_served(self, request: Request) -> Response:
        self._caller(request)
        raise NotFound(f"{request.method} {request.url.path}: not served by InferX")

    async def stored_response(self, request: Request) -> Response:
        self._caller(request)
        raise ResponseNotKept(request.path_params["rest"].partition("/")[0])

    async def _body(self, request: Request) -> bytes:
        """The request body, read no further than --http-max-body-bytes (413 past it)."""
        limit = self._request_limits.http_max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(int(declared), limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(None, limit)
            chunks.append(chunk)
        return b"".join(chunks)

    # ----- one call -----------------------------------------------------------------

    async def _serve(self, request: Request, read: BodyReader) -> Response:
        who = self._caller(request)
        data = schema.load_object(await self._body(request))
        identity = parse_identity(request.headers, data)  # headers, agentic_context, sessions
        body, writer_for = read(data)
        call = self._calls.prepare(body)
        reader = self._calls.reader(body)  # before the call: a bad mapping refuses it
        parent = telemetry.context_from_headers(request.headers)  # the caller's traceparent
        writer = writer_for(call, int(time.time()), reader)
        if body.stream:
            return await self._stream(request, who, identity, call, reader, writer, parent=parent)
        result = await unless_client_leaves(
            request, self._calls.call(who, identity, call, reader=reader, parent=parent)
        )
        if result is None:  # the client went away: the call was abandoned (recorded as cancelled)
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(writer.whole(result.done), headers=_call_headers(result))

    async def _stream(
        self,
        request: Request,
        who: Principal,
        identity: ProgramIdentity,
        call: Call,
        reader: schema.ReplyReader,
        writer: ReplyWriter,
        *,
        parent: otel_context.Context | None,
    ) -> Response:
        """Server-sent events in the API's stream format. The response starts with the
        first text (or the call's end), so a call refused or failed before producing
        anything still gets its HTTP status; a failure after that is an error event (a
        reply that breaks its tool_choice too: ProgramCalls reads it inside the call, and
        nothing of it was sent)."""
        pieces = self._calls.stream(who, identity, call, reader=reader, parent=parent)
        try:
            # Raises the call's error, if any, before the response starts; a client that
            # leaves meanwhile (tired of a queue, say) cancels the call before it runs.
            first = await unless_client_leaves(request, anext(pieces))
        except BaseException:
            await pieces.aclose()
            raise
        if first is None:
            await pieces.aclose()
            return Response(status_code=CLIENT_GONE)

        async def events() -> AsyncIterator[str]:
            try:
                for event in writer.start():
                    yield event
                piece = first
                try:
                    while not isinstance(piece, CallDone):
                        for event in writer.events([piece]):
                            yield event
                        piece = await anext(pieces)
                except Exception as exc:  # ToolChoiceNotFollowed too: what was held back fails the call
                    for event in writer.failed(exc):
                        yield event
                    return
                for event in writer.end(piece.done):
                    yield event
            finally:
                await pieces.aclose()  # the client went away: the call is abandoned (its engine call aborted)

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )


# ----- how each API writes its reply ---------------------------------------------------


class ReplyWriter(Protocol):
    """One call's reply in its API's shapes: the whole body, or the stream's events (SSE)."""

    def whole(self, done: HopDone) -> dict[str, Any]: ...

    def start(self) -> list[str]: ...

    def events(self, events: list[ReplyEvent]) -> list[str]: ...

    def end(self, done: HopDone) -> list[str]: ...

    def failed(self, exc: BaseException) -> list[str]: ...


WriterFor = Callable[[Call, int, schema.ReplyReader], ReplyWriter]
BodyReader = Callable[[dict[str, Any]], tuple[schema.CallRequest, WriterFor]]


class _ChatWriter:
    """Chat completions (`chat.completion`, and `chat.completion.chunk`s then [DONE])."""

    object_ = "chat.completion.chunk"

    def __init__(
        self, body: schema.CallRequest, call: Call, created: int, reader: schema.ReplyReader
    ) -> None:
        self._body, self._head, self._reader = body, (call.call_id, created, body.model), reader
        self._chunks = schema.ChatChunks(*self._head, reader=reader)

    def whole(self, done: HopDone) -> dict[str, Any]:
        return schema.chat_reply(*self._head, self._reader, done.finish_reason, _usage(done))

    def start(self) -> list[str]:
        return [schema.sse(self._chunks.start())]

    def events(self, events: list[ReplyEvent]) -> list[str]:
        return [schema.sse(chunk) for chunk in self._chunks.events(events)]

    def _finish(self, done: HopDone) -> list[dict[str, Any]]:
        return self._chunks.end(done.finish_reason)

    def end(self, done: HopDone) -> list[str]:
        out = [schema.sse(chunk) for chunk in self._finish(done)]
        if self._body.include_usage:
            out.append(schema.sse(schema.usage_chunk(*self._head, self.object_, _usage(done))))
        return [*out, schema.SSE_DONE]

    def failed(self, exc: BaseException) -> list[str]:
        return [schema.sse(error_reply_body(exc, SERVICE))]


class _TextWriter(_ChatWriter):
    """Text completions (`text_completion`, streamed as the same object per piece)."""

    object_ = "text_completion"

    def whole(self, done: HopDone) -> dict[str, Any]:
        return schema.text_completion(*self._head, done.text, done.finish_reason, _usage(done))

    def start(self) -> list[str]:
        return []

    def events(self, events: list[ReplyEvent]) -> list[str]:
        texts = [event.text for event in events if isinstance(event, Content)]
        return [schema.sse(schema.text_completion(*self._head, text, None, None)) for text in texts]

    def _finish(self, done: HopDone) -> list[dict[str, Any]]:
        return [schema.text_completion(*self._head, "", done.finish_reason, None)]


class ItemsWriter(Protocol):
    """A pure writer of an API whose reply is a list of items or content blocks
    (`responses.ResponseWriter`, `anthropic.MessageWriter`)."""

    def whole(
        self, reader: schema.ReplyReader, engine_reason: str, usage: dict[str, Any]
    ) -> dict[str, Any]: ...

    def start(self) -> list[dict[str, Any]]: ...

    def events(self, events: list[ReplyEvent]) -> list[dict[str, Any]]: ...

    def end(self, engine_reason: str, usage: dict[str, Any]) -> list[dict[str, Any]]: ...

    def failed(self, body: dict[str, Any]) -> list[dict[str, Any]]: ...


class _ItemsReplyWriter:
    """The Responses API and Anthropic's Messages API: a reply, or its typed events,
    each named in SSE's `event:` line as OpenAI and Anthropic send them (no [DONE]);
    errors in the API's own shape."""

    def __init__(
        self,
        writer: ItemsWriter,
        reader: schema.ReplyReader,
        usage: Callable[[int, int, int], dict[str, Any]],
        shape: Shape,
    ) -> None:
        self._writer, self._reader, self._usage, self._shape = writer, reader, usage, shape

    def _usage_of(self, done: HopDone) -> dict[str, Any]:
        return _with_cost(
            self._usage(done.prompt_tokens, done.completion_tokens, done.cached_prompt_tokens), done
        )

    def whole(self, done: HopDone) -> dict[str, Any]:
        return self._writer.whole(self._reader, done.finish_reason, self._usage_of(done))

    def start(self) -> list[str]:
        return _named(self._writer.start())

    def events(self, events: list[ReplyEvent]) -> list[str]:
        return _named(self._writer.events(events))

    def end(self, done: HopDone) -> list[str]:
        return _named(self._writer.end(done.finish_reason, self._usage_of(done)))

    def failed(self, exc: BaseException) -> list[str]:
        return _named(self._writer.failed(error_reply_body(exc, SERVICE, self._shape)))


def _own_id(call: Call) -> str:
    """The call's own id, as its record has it (chatcmpl-<hex>: the hex)."""
    return call.call_id.rpartition("-")[2]


def _named(events: list[dict[str, Any]]) -> list[str]:
    return [f"event: {event['type']}\n{schema.sse(event)}" for event in events]


def _read_chat(data: dict[str, Any]) -> tuple[schema.CallRequest, WriterFor]:
    body = schema.validate_body(schema.ChatCompletionRequest, data)
    return body, partial(_ChatWriter, body)


def _read_completion(data: dict[str, Any]) -> tuple[schema.CallRequest, WriterFor]:
    body = schema.validate_body(schema.CompletionRequest, data)
    return body, partial(_TextWriter, body)


def _read_messages(data: dict[str, Any]) -> tuple[schema.CallRequest, WriterFor]:
    ask = schema.validate_body(anthropic.MessagesRequest, data)

    def writer_for(call: Call, created: int, reader: schema.ReplyReader) -> ReplyWriter:
        writer = anthropic.MessageWriter(f"msg_{_own_id(call)}", ask.model)
        return _ItemsReplyWriter(writer, reader, anthropic.message_usage, anthropic.error_reply)

    return ask.chat_request(), writer_for


def _read_responses(data: dict[str, Any]) -> tuple[schema.CallRequest, WriterFor]:
    ask = schema.validate_body(responses.ResponsesRequest, data)

    def writer_for(call: Call, created: int, reader: schema.ReplyReader) -> ReplyWriter:
        writer = responses.ResponseWriter(f"resp_{_own_id(call)}", created, ask)
        return _ItemsReplyWriter(writer, reader, responses.response_usage, openai_shape)

    return ask.chat_request(), writer_for


def _call_headers(result: CallDone) -> dict[str, str]:
    return {WORKER_HEADER: result.done.worker_id, RUN_HEADER: result.run_id}


def _usage(done: HopDone) -> dict[str, Any]:
    return _with_cost(
        schema.usage(done.prompt_tokens, done.completion_tokens, done.cached_prompt_tokens), done
    )


def _with_cost(usage: dict[str, Any], done: HopDone) -> dict[str, Any]:
    """InferX's usage extension: `cost`, what the call cost at its model's price
    (inferx pool price; as OpenRouter's `usage.cost`), when the model is priced."""
    if done.cost:
        usage["cost"] = done.cost
    return usage


# The router's HTTP front is the shared embedded uvicorn server (HTTPS with the router's
# certificate when it has one).
HttpServer = EmbeddedHttpServer
