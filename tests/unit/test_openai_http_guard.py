"""The OpenAI-compatible APIs' one error guard (`inferx.openai_http`): domain
errors keep their status, a bug is a generic 500 naming the service (logged, never the
traceback in the reply), unknown paths are OpenAI-shaped too."""

from __future__ import annotations

import logging

import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from inferx.errors import NotFound, ResourceExhausted
from inferx.openai_http import guarded, http_error


def app_raising(exc: Exception) -> TestClient:
    async def handler(request: Request) -> Response:
        raise exc

    app = Starlette(
        routes=[Route("/v1/x", guarded(handler, "test service"), methods=["GET"])],
        exception_handlers={HTTPException: http_error},
    )
    return TestClient(app, raise_server_exceptions=False)


def test_a_bug_is_a_generic_500_naming_the_service_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="inferx.http"):
        reply = app_raising(ValueError("secret detail")).get("/v1/x")
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert error["message"] == "internal error in the test service"
    assert error["type"] == "server_error"
    assert "secret detail" not in reply.text
    assert "ValueError" in caplog.text  # the traceback goes to the log


def test_domain_errors_keep_their_status_and_retry_hint() -> None:
    assert app_raising(NotFound("no such model")).get("/v1/x").status_code == 404
    reply = app_raising(ResourceExhausted("busy", retry_after_s=2.5)).get("/v1/x")
    assert reply.status_code == 429
    assert reply.headers["Retry-After"] == "3"
    assert reply.json()["error"]["message"] == "busy"


def test_a_deadline_is_a_504() -> None:
    assert app_raising(TimeoutError()).get("/v1/x").status_code == 504


def test_unknown_paths_and_methods_are_openai_shaped() -> None:
    client = app_raising(ValueError())
    missing = client.get("/v1/nothing")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "GET /v1/nothing: Not Found"
    assert client.post("/v1/x").status_code == 405
