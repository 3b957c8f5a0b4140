"""The OpenAI-compatible HTTP front of the router (`--http-port`), served by uvicorn in
the router process's own event loop.

`POST /v1/chat/completions` and `POST /v1/completions` (each call one model hop of its
program, run by `program_calls.ProgramCalls` -- the path `Router.CallModel` takes too --
through the same `SchedulerExecutor` as declared chains' hops, so the scheduler's tiers,
affinity and deadlines apply), `GET /v1/models` and `GET /v1/models/{model}`. Request
parsing, the chat rendering, program identity, response shapes and error mapping are
pure code in `inferx.openai_compat`; this module is the I/O around them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry import context as otel_context
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from inferx import telemetry
from inferx.auth.model import Principal
from inferx.httpserve import EmbeddedHttpServer
from inferx.limits import RequestLimits
from inferx.openai_compat import schema
from inferx.openai_compat.errors import BodyTooLarge, ModelNotFound
from inferx.openai_compat.identity import ProgramIdentity, parse_identity
from inferx.openai_compat.schema import ReplyEvent
from inferx.openai_compat.toolcalls import Content
from inferx.openai_http import CLIENT_GONE, error_reply_body, guarded, http_error, unless_client_leaves
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
        """The same bearer tokens as the gRPC API (every role may call a model)."""
        return self._access.authenticate(request.headers.get("authorization"))

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
        return await self._serve(request, schema.ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, schema.CompletionRequest)

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

    async def _serve(self, request: Request, kind: type[schema.CallRequest]) -> Response:
        who = self._caller(request)
        data = schema.load_object(await self._body(request))
        identity = parse_identity(request.headers, data)  # headers, agentic_context, sessions
        body = schema.validate_body(kind, data)
        call = self._calls.prepare(body)
        reader = self._calls.reader(body)  # before the call: a bad mapping refuses it
        parent = telemetry.context_from_headers(request.headers)  # the caller's traceparent
        created = int(time.time())
        if body.stream:
            return await self._stream(request, who, identity, call, body, created, reader, parent=parent)
        result = await unless_client_leaves(
            request, self._calls.call(who, identity, call, reader=reader, parent=parent)
        )
        if result is None:  # the client went away: the call was abandoned (recorded as cancelled)
            return Response(status_code=CLIENT_GONE)
        done = result.done
        usage = _usage(done)
        if isinstance(body, schema.ChatCompletionRequest):
            reply = schema.chat_reply(call.call_id, created, body.model, reader, done.finish_reason, usage)
        else:
            reply = schema.text_completion(
                call.call_id, created, body.model, done.text, done.finish_reason, usage
            )
        return JSONResponse(reply, headers=_call_headers(result))

    async def _stream(
        self,
        request: Request,
        who: Principal,
        identity: ProgramIdentity,
        call: Call,
        body: schema.CallRequest,
        created: int,
        reader: schema.ReplyReader,
        *,
        parent: otel_context.Context | None,
    ) -> Response:
        """Server-sent events in OpenAI's chunk format. The response starts with the
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
        model, call_id = body.model, call.call_id
        chat = isinstance(body, schema.ChatCompletionRequest)
        object_ = "chat.completion.chunk" if chat else "text_completion"
        chat_chunks = schema.ChatChunks(call_id, created, model, reader=reader)

        def chunks(event: ReplyEvent | None, reason: str | None) -> list[dict[str, Any]]:
            if chat:  # the reader read tool calls out of the text as it came
                return chat_chunks.events([event]) if event is not None else chat_chunks.end(reason or "")
            text = event.text if isinstance(event, Content) else ""
            return [schema.text_completion(call_id, created, model, text, reason, None)]

        async def events() -> AsyncIterator[str]:
            try:
                if chat:
                    yield schema.sse(chat_chunks.start())
                piece = first
                try:
                    while not isinstance(piece, CallDone):
                        for payload in chunks(piece, None):
                            yield schema.sse(payload)
                        piece = await anext(pieces)
                except Exception as exc:  # ToolChoiceNotFollowed too: what was held back fails the call
                    yield schema.sse(error_reply_body(exc, SERVICE))
                    return
                done = piece.done
                for payload in chunks(None, done.finish_reason):
                    yield schema.sse(payload)
                if body.include_usage:
                    yield schema.sse(schema.usage_chunk(call_id, created, model, object_, _usage(done)))
                yield schema.SSE_DONE
            finally:
                await pieces.aclose()  # the client went away: the call is abandoned (its engine call aborted)

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )


def _call_headers(result: CallDone) -> dict[str, str]:
    return {WORKER_HEADER: result.done.worker_id, RUN_HEADER: result.run_id}


def _usage(done: HopDone) -> dict[str, Any]:
    return schema.usage(done.prompt_tokens, done.completion_tokens, done.cached_prompt_tokens)


# The router's HTTP front is the shared embedded uvicorn server (HTTPS with the router's
# certificate when it has one).
HttpServer = EmbeddedHttpServer
