"""The one error guard of InferX's OpenAI-compatible HTTP APIs (the router's front and
the sim worker's API): whatever a handler raises becomes an OpenAI-shaped reply with
the status `errors.error_reply` maps it to; a bug (not an `InferxError`) is logged with
its traceback and answered with a generic 500, never the traceback."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferx.errors import InferxError
from inferx.openai_compat.errors import ErrorReply, error_body, error_reply

Handler = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")

# What a reply to a client that went away gets (nobody reads it): nginx's "client
# closed request", in the access log.
CLIENT_GONE = 499

log = logging.getLogger("inferx.http")


# How an API words an error: OpenAI's shape as it is, or another API's (Anthropic's).
Shape = Callable[[ErrorReply], ErrorReply]


def openai_shape(reply: ErrorReply) -> ErrorReply:
    return reply


def error_reply_body(exc: BaseException, service: str, shape: Shape = openai_shape) -> dict[str, Any]:
    """The error body for `exc` (a streamed call's last SSE event), logging a bug."""
    return shape(_reply(exc, service)).body


def error_response(exc: BaseException, service: str, shape: Shape = openai_shape) -> JSONResponse:
    reply = shape(_reply(exc, service))
    return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)


def guarded(handler: Handler, service: str, shape: Shape = openai_shape) -> Handler:
    """`handler` with every error it raises answered as `error_response` (the one place),
    in OpenAI's shape unless the API words errors otherwise (`shape`)."""

    async def guarded_handler(request: Request) -> Response:
        try:
            return await handler(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return error_response(exc, service, shape)

    return guarded_handler


async def unless_client_leaves(request: Request, call: Awaitable[T]) -> T | None:
    """`call`'s result, or None when the client disconnected first: then `call` is
    cancelled -- its engine work aborted, as a streamed call's is when its client goes --
    rather than run to the end for nobody. Call it once the body has been read: what
    `receive` gives after that is the disconnect."""
    handler = asyncio.current_task()
    assert handler is not None
    finished = False
    gone = False

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass  # (a body already read: nothing else comes)

    def on_disconnect(watcher: asyncio.Task[None]) -> None:
        nonlocal gone
        if not finished and not watcher.cancelled() and watcher.exception() is None:
            gone = True
            handler.cancel()

    watcher = asyncio.ensure_future(watch())
    watcher.add_done_callback(on_disconnect)
    try:
        result = await call
        finished = True  # no await since the call returned: a disconnect now cancels nothing
        return result
    except asyncio.CancelledError:
        if gone:
            handler.uncancel()
            return None
        raise
    finally:
        watcher.cancel()


async def http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths and methods (Starlette's HTTPException), in OpenAI's shape too."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = f"{request.method} {request.url.path}: " + (
        exc.detail if isinstance(exc, HTTPException) else "internal error"
    )
    return JSONResponse(error_body(message, "invalid_request_error"), status_code=status)


def _reply(exc: BaseException, service: str) -> ErrorReply:
    if not isinstance(exc, InferxError | TimeoutError):
        log.error("unhandled error in the %s's HTTP API", service, exc_info=exc)
    return error_reply(exc, service=service)
