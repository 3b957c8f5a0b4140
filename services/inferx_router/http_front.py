"""The OpenAI-compatible HTTP front of the router (`--http-port`), served by uvicorn in
the router process's own event loop.

`POST /v1/chat/completions` and `POST /v1/completions` (each call one model hop, sent
through the same `SchedulerExecutor` as declared chains' hops, so the scheduler's tiers,
affinity and deadlines apply), `GET /v1/models`. Request parsing, the chat rendering,
program identity, response shapes and error mapping are pure code in
`inferx.openai_compat`; this module is the I/O around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from inferx.errors import InferxError
from inferx.openai_compat import schema
from inferx.openai_compat.errors import InvalidField, ModelNotFound, error_body, error_reply
from inferx.openai_compat.identity import ProgramIdentity, parse_identity
from inferx.openai_compat.render import render_chat
from inferx.pools import PoolDirectory
from inferx_router.executors import SchedulerExecutor
from inferx_router.hops import HopDone, ModelHop
from inferx_router.programs import Call, ProgramBook, program_hop

log = logging.getLogger("inferx.router.http")

Handler = Callable[[Request], Awaitable[Response]]


def _error_response(exc: BaseException) -> JSONResponse:
    reply = error_reply(exc)
    if reply.status >= 500 and not isinstance(exc, InferxError | TimeoutError):
        log.error("unhandled error in the HTTP front", exc_info=exc)
    return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)


def _guarded(handler: Handler) -> Handler:
    """Every error a handler raises becomes an OpenAI-shaped reply (the one place)."""

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return _error_response(exc)

    return guarded


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths and methods, in OpenAI's shape too."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = f"{request.method} {request.url.path}: " + (
        exc.detail if isinstance(exc, HTTPException) else "internal error"
    )
    return JSONResponse(error_body(message, "invalid_request_error"), status_code=status)


WORKER_HEADER = "X-InferX-Worker"  # the worker that ran the call (debugging, tests)


class OpenAIFront:
    def __init__(
        self,
        directory: PoolDirectory,
        executor: SchedulerExecutor,
        *,
        default_timeout_s: float,
        programs: ProgramBook | None = None,
    ) -> None:
        self._directory = directory
        self._executor = executor
        self._default_timeout_ms = int(default_timeout_s * 1000)
        self._programs = programs or ProgramBook()
        self._created = int(time.time())

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", _guarded(self.chat_completions), methods=["POST"]),
                Route("/v1/completions", _guarded(self.completions), methods=["POST"]),
                Route("/v1/models", _guarded(self.models), methods=["GET"]),
            ],
            exception_handlers={HTTPException: _http_error},
        )

    # ----- endpoints ----------------------------------------------------------------

    def model_names(self) -> list[str]:
        """Models mapped in etcd, and pools with live workers (a pool is a model too)."""
        pools = {pool for pool, workers in self._directory.workers_by_pool.items() if workers}
        return sorted(set(self._directory.model_to_pool) | pools)

    async def models(self, request: Request) -> Response:
        return JSONResponse(schema.model_list(self.model_names(), self._created))

    async def chat_completions(self, request: Request) -> Response:
        identity = parse_identity(request.headers)
        body = schema.parse_body(schema.ChatCompletionRequest, await request.body())
        prompt = render_chat(body.messages, body.tools, body.tool_choice)
        return await self._serve(identity, body, prompt, chat=True)

    async def completions(self, request: Request) -> Response:
        identity = parse_identity(request.headers)
        body = schema.parse_body(schema.CompletionRequest, await request.body())
        return await self._serve(identity, body, body.prompt_text, chat=False)

    # ----- one call -----------------------------------------------------------------

    async def _serve(
        self, identity: ProgramIdentity, body: schema.CallRequest, prompt: str, *, chat: bool
    ) -> Response:
        if body.model not in self.model_names():
            raise ModelNotFound(body.model)
        if not prompt:
            raise InvalidField("prompt", "empty")
        call = Call(
            call_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            model=body.model,
            prompt=prompt,
            max_tokens=body.output_tokens(),
            temperature=1.0 if body.temperature is None else body.temperature,
        )
        hop, timeout_s = program_hop(
            call,
            identity,
            self._programs,
            now_unix_ms=int(time.time() * 1000),
            default_timeout_ms=self._default_timeout_ms,
        )
        created = int(time.time())
        if body.stream:
            return await self._stream(call, body, hop, timeout_s, created, chat=chat)
        done = await self._executor.run_hop(hop, timeout_s, lambda _worker: None)
        usage = _usage(done)
        if chat:
            reply = schema.chat_completion(
                call.call_id, created, body.model, done.text, done.finish_reason, usage
            )
        else:
            reply = schema.text_completion(
                call.call_id, created, body.model, done.text, done.finish_reason, usage
            )
        return JSONResponse(reply, headers={WORKER_HEADER: done.worker_id})

    async def _stream(
        self,
        call: Call,
        body: schema.CallRequest,
        hop: ModelHop,
        timeout_s: float,
        created: int,
        *,
        chat: bool,
    ) -> Response:
        """Server-sent events in OpenAI's chunk format. The response starts with the
        first text (or the hop's end), so a hop refused or failed before producing
        anything still gets its HTTP status; a failure after that is an error event."""
        pieces: asyncio.Queue[str | None] = asyncio.Queue()
        workers: list[str] = []
        task = asyncio.create_task(
            self._executor.run_hop(hop, timeout_s, workers.append, on_text=pieces.put_nowait)
        )
        task.add_done_callback(lambda _task: pieces.put_nowait(None))
        try:
            first = await pieces.get()
            if first is None:
                task.result()  # raises the hop's error, if any, before the response starts
        except BaseException:
            task.cancel()
            raise
        model, call_id = body.model, call.call_id
        object_ = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, reason: str | None) -> dict[str, Any]:
            if chat:
                delta = {} if text is None else {"content": text}
                return schema.chat_chunk(call_id, created, model, delta, reason)
            return schema.text_completion(call_id, created, model, text or "", reason, None)

        async def events() -> AsyncIterator[str]:
            try:
                if chat:
                    yield schema.sse(
                        schema.chat_chunk(call_id, created, model, {"role": "assistant", "content": ""})
                    )
                piece = first
                while piece is not None:
                    yield schema.sse(chunk(piece, None))
                    piece = await pieces.get()
                try:
                    done = task.result()
                except Exception as exc:
                    yield schema.sse(_error_response_body(exc))
                    return
                yield schema.sse(chunk(None, done.finish_reason))
                if body.include_usage:
                    yield schema.sse(schema.usage_chunk(call_id, created, model, object_, _usage(done)))
                yield schema.SSE_DONE
            finally:
                if not task.done():
                    task.cancel()  # the client went away: abandon the hop (its engine call is aborted)

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )


def _usage(done: HopDone) -> dict[str, Any]:
    return schema.usage(done.prompt_tokens, done.completion_tokens, done.cached_prompt_tokens)


def _error_response_body(exc: BaseException) -> dict[str, Any]:
    if not isinstance(exc, InferxError | TimeoutError):
        log.error("unhandled error in a streamed call", exc_info=exc)
    return error_reply(exc).body


# ----- the server, in the router's event loop ------------------------------------------


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # SIGTERM/SIGINT belong to the router's bootstrap (graceful drain), not uvicorn


class HttpServer:
    """uvicorn serving `app` as a task of the running event loop."""

    def __init__(self, app: Starlette, host: str, port: int, *, drain_timeout_s: float) -> None:
        self._app = app
        self._host = host
        self._port = port
        self._drain_timeout_s = drain_timeout_s
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.address = ""

    async def start(self) -> str:
        """Bind and serve; the address it listens on. OSError when it cannot bind."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.create_server((self._host, self._port), family=family)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see inferx.httpserve.listen_socket
        config = uvicorn.Config(
            self._app,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(self._drain_timeout_s) or None,
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="http-front")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"the HTTP front on {self._host}:{self._port} stopped during start-up")
            await asyncio.sleep(0.01)
        self.address = f"{self._host}:{sock.getsockname()[1]}"
        return self.address

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
