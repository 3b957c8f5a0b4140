"""InferX's domain errors as OpenAI-shaped HTTP errors, mapped in this one place.

The body is what OpenAI's API sends (and its SDKs parse):
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`, with the HTTP
status the SDKs turn into their exception classes (400 BadRequestError, 404
NotFoundError, 413 for a body over the router's limit, 429 RateLimitError, ...).
Anything that is not an `InferxError` is a bug: a 500 with a generic message, never a
traceback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from inferx.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InferxError,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from inferx.limits import LimitExceeded, format_bytes


class InvalidField(InvalidArgument):
    """A bad request naming what was bad: a body field (`messages[0].role`) or a
    header (`X-InferX-Tier`); OpenAI's `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class BodyTooLarge(LimitExceeded):
    """A request body over the router's --http-max-body-bytes: a 413. `size` is None
    when the body had no Content-Length and reading stopped at the limit."""

    def __init__(self, size: int | None, limit: int) -> None:
        flag = "--http-max-body-bytes"
        unknown = f"body: larger than the router's limit of {format_bytes(limit)} ({flag})"
        super().__init__(
            "body", limit + 1 if size is None else size, limit, flag, message=unknown if size is None else ""
        )
        self.param = "body"
        self.code_name = "request_too_large"


class ModelNotFound(NotFound):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist (GET /v1/models lists the models served)")
        self.param = "model"
        self.code_name = "model_not_found"


class ResponseNotKept(NotFound):
    """A stored response asked for (retrieved, deleted, cancelled, its input listed):
    InferX's Responses API is stateless, so there is none."""

    def __init__(self, response_id: str) -> None:
        super().__init__(
            f"No response with id '{response_id}': InferX keeps no responses (each call sends the"
            " whole conversation as `input`)"
        )
        self.param = "response_id"


class ToolChoiceNotFollowed(Internal):
    """The call said tool_choice "required" (or named a function) and the model's reply
    has no such tool call. vLLM enforces tool_choice by constraining decoding; InferX
    runs engines it cannot constrain, so it checks the reply instead and answers a 500
    (`server_error`, code `tool_choice_not_followed`) rather than a reply that breaks
    the promise; a retry samples again."""

    def __init__(self, choice: str, reply: str) -> None:
        shown = reply if len(reply) <= 200 else reply[:200] + "..."
        super().__init__(
            f"tool_choice {choice}: the model's reply has no such tool call (InferX checks the "
            f"reply; it cannot constrain the model's decoding); the reply was {shown!r}"
        )
        self.param = "tool_choice"
        self.code_name = "tool_choice_not_followed"


@dataclass(frozen=True)
class ErrorReply:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


# (domain error, HTTP status, OpenAI error type, code); the first match wins.
_TABLE: tuple[tuple[type[InferxError], int, str, str], ...] = (
    (BodyTooLarge, 413, "invalid_request_error", "request_too_large"),
    (InvalidArgument, 400, "invalid_request_error", "invalid_argument"),
    (FailedPrecondition, 400, "invalid_request_error", "failed_precondition"),
    (Unauthenticated, 401, "authentication_error", "invalid_api_key"),
    (PermissionDenied, 403, "permission_error", "permission_denied"),
    (NotFound, 404, "invalid_request_error", "not_found"),
    (Aborted, 409, "conflict_error", "aborted"),
    (ResourceExhausted, 429, "rate_limit_error", "rate_limit_exceeded"),
    (Unavailable, 503, "service_unavailable_error", "unavailable"),
    (DeadlineExceeded, 504, "timeout_error", "deadline_exceeded"),
)


def error_body(message: str, type_: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_reply(exc: BaseException, service: str = "InferX router") -> ErrorReply:
    """The HTTP status, body and headers for an error raised while serving a call.
    A `TimeoutError` (the call's deadline passed) is a 504, like DEADLINE_EXCEEDED;
    anything else that is not an `InferxError` a generic 500 naming `service`."""
    if isinstance(exc, TimeoutError):
        exc = DeadlineExceeded("the call's deadline passed before the model finished")
    if not isinstance(exc, InferxError):
        return ErrorReply(500, error_body(f"internal error in the {service}", "server_error"))
    # Internal, or a status with no better match: a 500.
    status, type_, code = next(
        (row[1:] for row in _TABLE if isinstance(exc, row[0])), (500, "server_error", "internal")
    )
    headers = {}
    if status in (429, 503) and (status == 429 or exc.retry_after_s is not None):
        retry_after = exc.retry_after_s if exc.retry_after_s is not None else 1.0
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    body = error_body(
        exc.message,
        type_,
        param=getattr(exc, "param", None),
        code=getattr(exc, "code_name", code),
    )
    return ErrorReply(status, body, headers)
