"""How the router's HTTP front writes one call's reply in each API's shapes: the end of
a stream, and a failure after the stream started (an error event in the API's own
shape, never a server-error type for a known failure)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from inferx.errors import Unavailable
from inferx.openai_compat import responses, schema
from inferx.openai_compat.toolcalls import Content
from inferx_router.hops import HopDone
from inferx_router.http_front import _read_chat, _read_completion, _read_messages, _read_responses
from inferx_router.programs import Call

CALL = Call(call_id="chatcmpl-abc123", model="m", prompt="p", max_tokens=4, temperature=1.0)
DONE = HopDone(
    text="Hi",
    worker_id="w1",
    prompt_tokens=10,
    completion_tokens=1,
    cached_prompt_tokens=4,
    finish_reason="stop",
)
BODIES = {
    "chat": (_read_chat, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}),
    "completion": (_read_completion, {"model": "m", "prompt": "hi", "stream": True}),
    "responses": (_read_responses, {"model": "m", "input": "hi", "stream": True}),
    "messages": (
        _read_messages,
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    ),
}


def writer(api: str) -> Any:
    read, data = BODIES[api]
    body, writer_for = read(data)
    return writer_for(CALL, 1700000000, schema.reply_reader(body))


def payloads(sse: list[str]) -> list[dict[str, Any]]:
    out = []
    for event in sse:
        lines = event.strip().split("\n")
        data = next(line for line in lines if line.startswith("data: "))[6:]
        if data != "[DONE]":
            out.append(json.loads(data))
    return out


@pytest.mark.parametrize("api", sorted(BODIES))
def test_a_failure_after_the_start_is_an_error_event_in_the_apis_shape(api: str) -> None:
    out = writer(api)
    out.start()
    (error,) = payloads(out.failed(Unavailable("the worker went away")))
    if api == "responses":
        event = TypeAdapter(ResponseStreamEvent).validate_python(error)
        assert event.type == "error" and event.code == "unavailable" and "went away" in event.message
    elif api == "messages":
        assert error == {
            "type": "error",
            "error": {"type": "overloaded_error", "message": "the worker went away"},
        }
    else:
        assert (
            error["error"]["type"] == "service_unavailable_error" and error["error"]["code"] == "unavailable"
        )


@pytest.mark.parametrize("api", sorted(BODIES))
def test_a_stream_ends_with_the_apis_last_event(api: str) -> None:
    out = writer(api)
    sse = [*out.start(), *out.events([Content("Hi")]), *out.end(DONE)]
    last = {
        "chat": "data: [DONE]",
        "completion": "data: [DONE]",
        "responses": "response.completed",
        "messages": "message_stop",
    }
    assert last[api] in sse[-1]
    if api in ("responses", "messages"):  # each event named in SSE's event: line, as the data's type
        for event in sse:
            name = event.split("\n", 1)[0].removeprefix("event: ")
            assert json.loads(event.split("data: ", 1)[1])["type"] == name


def test_the_whole_replies_carry_the_calls_id() -> None:
    assert writer("chat").whole(DONE)["id"] == "chatcmpl-abc123"
    assert writer("responses").whole(DONE)["id"] == "resp_abc123"
    assert writer("messages").whole(DONE)["id"] == "msg_abc123"
    assert responses.response_usage(10, 1, 4)["input_tokens_details"]["cached_tokens"] == 4
