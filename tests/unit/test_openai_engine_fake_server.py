"""The `openai` engine against a fake OpenAI-compatible server (a real HTTP server in
the test's event loop): chats stream from /v1/chat/completions (messages, tools and
tool_choice passed on), prompts from /v1/completions; the chat deltas become the
engine's chunks (text, usage with cached tokens, finish reason), tool calls the server
parsed are written back into the text in the worker's tool-call format; the server's
errors are clear engine errors; `--openai-chat-endpoint off` sends chats as the prompt."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from inferx.chat_template import Chat
from inferx.errors import Internal, InvalidArgument
from inferx.httpserve import EmbeddedHttpServer
from inferx.openai_compat.toolcalls import (
    DEEPSEEK_V3,
    FORMATS,
    GRANITE,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PYTHONIC,
    split_tool_calls,
)
from inferx.settings import load_settings
from inferx.v1 import common_pb2, worker_pb2
from inferx_worker import metrics
from inferx_worker.config import WorkerSettings
from inferx_worker.engines.base import EngineChunk, EngineError, EngineRequest
from inferx_worker.engines.openai_engine import ChatDeltas, OpenAIEngine, from_settings, server_messages
from inferx_worker.servicer import ModelWorkerServicer, engine_failure

TOOLS = [{"type": "function", "function": {"name": "track", "parameters": {"type": "object"}}}]
MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "Where is TRK-42?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "track", "arguments": {"id": "T"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "out for delivery"},
]
USAGE = {"prompt_tokens": 40, "completion_tokens": 6, "prompt_tokens_details": {"cached_tokens": 32}}


def chat_chunk(delta: dict[str, Any] | None = None, reason: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": reason}]}


def tool_delta(index: int, *, call_id: str = "", name: str = "", arguments: str = "") -> dict[str, Any]:
    piece: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id:
        piece |= {"id": call_id, "type": "function"}
        piece["function"]["name"] = name
    return chat_chunk({"tool_calls": [piece]})


class FakeServer:
    """An OpenAI-compatible server that records what it was sent and streams `events`
    (or answers `status` with `error`)."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.events: list[dict[str, Any] | str] = []
        self.status, self.error = 200, ""
        self.http = EmbeddedHttpServer(
            Starlette(
                routes=[
                    Route("/v1/models", self.models, methods=["GET"]),
                    Route("/v1/chat/completions", self.call, methods=["POST"]),
                    Route("/v1/completions", self.call, methods=["POST"]),
                ]
            ),
            "127.0.0.1",
            0,
        )

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "served-model", "object": "model"}]})

    async def call(self, request: Request) -> Response:
        self.received.append((request.url.path, json.loads(await request.body())))
        if self.status != 200:
            return Response(self.error, status_code=self.status, media_type="application/json")

        async def stream() -> AsyncIterator[str]:
            for event in self.events:  # a str: a line as it is (not JSON, say)
                yield f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")


@pytest.fixture
async def server() -> AsyncIterator[FakeServer]:
    fake = FakeServer()
    await fake.http.start()
    try:
        yield fake
    finally:
        await fake.http.stop()


async def engine_for(server: FakeServer, **kw) -> OpenAIEngine:
    engine = OpenAIEngine(f"http://{server.http.address}", "served-model", **kw)
    await engine.start()
    return engine


async def run(engine: OpenAIEngine, request: EngineRequest) -> list[EngineChunk]:
    try:
        return [chunk async for chunk in engine.generate(request)]
    finally:
        await engine.stop()


def chat_request(chat: Chat, **kw) -> EngineRequest:
    return EngineRequest("r1", "<|user|>\ngeneric rendering\n<|assistant|>\n", max_tokens=16, chat=chat, **kw)


# ----- where requests go, and what they carry ------------------------------------------------


async def test_a_chat_goes_to_the_chat_endpoint_with_its_tools_and_tool_choice(server: FakeServer) -> None:
    server.events = [
        chat_chunk({"role": "assistant", "content": ""}),
        chat_chunk({"content": "It is "}),
        chat_chunk({"content": "on its way."}),
        chat_chunk(reason="stop"),
        {"choices": [], "usage": USAGE},
    ]
    chat = Chat(MESSAGES, TOOLS, "required")
    chunks = await run(await engine_for(server), chat_request(chat, seed=7, priority=2))
    ((path, body),) = server.received
    assert path == "/v1/chat/completions"
    assert body["messages"][0] == MESSAGES[0] and body["messages"][2] == MESSAGES[2]
    # OpenAI's API takes a call's arguments as JSON text (the chat holds them as objects, for templates)
    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"id": "T"}'
    assert (body["tools"], body["tool_choice"]) == (TOOLS, "required")
    assert (body["model"], body["max_tokens"], body["seed"], body["priority"]) == ("served-model", 16, 7, 2)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "prompt" not in body
    assert "".join(c.text for c in chunks) == "It is on its way."
    final = chunks[-1]
    assert final.finished and final.finish_reason == "stop"
    assert (final.prompt_tokens, final.completion_tokens, final.cached_prompt_tokens) == (40, 6, 32)


async def test_stop_sequences_top_p_and_seed_go_to_the_server(server: FakeServer) -> None:
    server.events = [chat_chunk({"content": "Thought: x"}), chat_chunk(reason="stop")]
    chat = Chat(MESSAGES, TOOLS)
    await run(await engine_for(server), chat_request(chat, seed=7, top_p=0.5, stop=("\nObservation:",)))
    await run(await engine_for(server, chat_endpoint=False), EngineRequest("r2", "p", stop=("END",)))
    (_, chat_body), (_, text_body) = server.received
    assert (chat_body["stop"], chat_body["top_p"], chat_body["seed"]) == (["\nObservation:"], 0.5, 7)
    assert text_body["stop"] == ["END"] and "seed" not in text_body
    assert "response_format" not in chat_body
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "object"}}}
    await run(await engine_for(server), chat_request(chat, response_format=fmt))
    assert server.received[-1][1]["response_format"] == fmt  # the server constrains its output


async def test_a_chat_without_tools_sends_neither_tools_nor_tool_choice(server: FakeServer) -> None:
    server.events = [chat_chunk({"content": "hi"}), chat_chunk(reason="length")]
    chunks = await run(await engine_for(server), chat_request(Chat(MESSAGES[:1])))
    ((path, body),) = server.received
    assert path == "/v1/chat/completions" and "tools" not in body and "tool_choice" not in body
    assert chunks[-1].finish_reason == "length" and chunks[-1].prompt_tokens == 0  # no usage reported


async def test_a_prompt_goes_to_the_completions_endpoint(server: FakeServer) -> None:
    server.events = [
        {"choices": [{"index": 0, "text": "Hel", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "lo", "finish_reason": "length"}]},
        {"choices": [], "usage": USAGE},
    ]
    chunks = await run(await engine_for(server), EngineRequest("r1", "Say hello", max_tokens=2))
    ((path, body),) = server.received
    assert path == "/v1/completions" and body["prompt"] == "Say hello" and "messages" not in body
    assert "".join(c.text for c in chunks) == "Hello"
    assert (chunks[-1].finish_reason, chunks[-1].cached_prompt_tokens) == ("length", 32)


async def test_a_request_without_max_tokens_leaves_it_to_the_server(server: FakeServer) -> None:
    """Not set means the server's own meaning (vLLM, OpenAI: up to the context room);
    sending any number in its place would cap the reply."""
    server.events = [{"choices": [{"index": 0, "text": "a long reply", "finish_reason": "stop"}]}]
    await run(await engine_for(server), EngineRequest("r1", "Say it all", max_tokens=None))
    ((_, body),) = server.received
    assert "max_tokens" not in body


async def test_with_the_chat_endpoint_off_a_chat_goes_as_its_prompt_to_completions(
    server: FakeServer,
) -> None:
    server.events = [{"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}]
    request = chat_request(Chat(MESSAGES, TOOLS))
    chunks = await run(await engine_for(server, chat_endpoint=False), request)
    ((path, body),) = server.received
    assert path == "/v1/completions" and body["prompt"] == request.prompt
    assert "messages" not in body and "tools" not in body
    assert "".join(c.text for c in chunks) == "ok"


# ----- tool calls the server parsed: written back into the text --------------------------------


async def test_tool_calls_the_server_parsed_come_back_as_text_the_routers_read_as_the_same_calls(
    server: FakeServer,
) -> None:
    server.events = [
        chat_chunk({"role": "assistant", "content": "Checking."}),
        tool_delta(0, call_id="srv_1", name="track"),
        tool_delta(0, arguments='{"id": '),
        tool_delta(0, arguments='"TRK-42"}'),
        tool_delta(1, call_id="srv_2", name="lookup"),
        tool_delta(1, arguments='{"order": 7}'),
        chat_chunk(reason="tool_calls"),
        {"choices": [], "usage": USAGE},
    ]
    chunks = await run(await engine_for(server), chat_request(Chat(MESSAGES[:1], TOOLS)))
    texts = [c.text for c in chunks if c.text]
    # Each call is written once it is whole: the first when the second begins.
    assert texts[0] == "Checking." and "track" in texts[1] and "lookup" not in texts[1]
    content, calls = split_tool_calls("".join(texts), format_=HERMES)
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("track", {"id": "TRK-42"}),
        ("lookup", {"order": 7}),
    ]
    assert chunks[-1].finish_reason == "stop"  # "tool_calls" is the router's to say, from the text


@pytest.mark.parametrize("format_", FORMATS)
def test_chat_deltas_write_calls_in_the_workers_format(format_: str) -> None:
    deltas = ChatDeltas(format_)
    # A llama3_json or pythonic reply is calls only when it is nothing but calls.
    content = "" if format_ in (LLAMA3_JSON, PYTHONIC) else "Let me see."
    pieces = [deltas.event(chat_chunk({"content": content}))] if content else []
    pieces += [
        deltas.event(tool_delta(0, call_id="a", name="track", arguments='{"id": "T"}')),
        deltas.event(tool_delta(1, call_id="b", name="track", arguments="")),  # no arguments: {}
        deltas.event(chat_chunk(reason="tool_calls")),
        deltas.finish(),
    ]
    read, calls = split_tool_calls("".join(pieces), format_=format_)
    assert (read or "") == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("track", {"id": "T"}), ("track", {})]


@pytest.mark.parametrize("format_", [HERMES, MISTRAL, DEEPSEEK_V3, GRANITE])
def test_content_after_a_call_writes_the_call_and_ends_its_section_first(format_: str) -> None:
    deltas = ChatDeltas(format_)
    text = deltas.event(tool_delta(0, call_id="a", name="track", arguments='{"id": "T"}'))
    assert text == ""  # not whole yet: more arguments may come
    text += deltas.event(chat_chunk({"content": " done"}))
    assert text.endswith(" done") and deltas.finish() == ""
    content, calls = split_tool_calls(text, format_=format_)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("track", {"id": "T"})]
    assert (content or "").strip() == "done"


@pytest.mark.parametrize("format_", FORMATS)
def test_whitespace_the_server_sends_between_calls_keeps_them_calls(format_: str) -> None:
    """A server may send a newline as content between two calls (or after the last): in
    pythonic or Granite that must not close the list and turn both calls into text."""
    deltas = ChatDeltas(format_)
    text = deltas.event(tool_delta(0, call_id="a", name="track", arguments='{"id": "T"}'))
    text += deltas.event(chat_chunk({"content": "\n"}))
    text += deltas.event(tool_delta(1, call_id="b", name="lookup", arguments='{"order": 7}'))
    text += deltas.event(chat_chunk({"content": " \n"}))
    text += deltas.finish()
    content, calls = split_tool_calls(text, format_=format_)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("track", {"id": "T"}),
        ("lookup", {"order": 7}),
    ]


def test_whitespace_between_a_call_and_content_stays_in_the_content() -> None:
    deltas = ChatDeltas(HERMES)
    text = deltas.event(tool_delta(0, call_id="a", name="track", arguments='{"id": "T"}'))
    text += deltas.event(chat_chunk({"content": "\n\n"})) + deltas.event(chat_chunk({"content": "Done."}))
    content, calls = split_tool_calls(text + deltas.finish(), format_=HERMES)
    assert [c.name for c in calls] == ["track"] and content is not None and content.endswith("\n\nDone.")


def test_the_engine_registers_the_format_it_writes_server_calls_in() -> None:
    """What the worker registers for the routers: the chat endpoint's calls are written
    in the engine's format; on /v1/completions the model's own text carries them."""
    assert OpenAIEngine("http://x", "m", tool_call_format=PYTHONIC).writes_tool_call_format() == PYTHONIC
    assert OpenAIEngine("http://x", "m").writes_tool_call_format() == HERMES
    assert OpenAIEngine("http://x", "m", chat_endpoint=False).writes_tool_call_format() is None


def test_a_new_call_at_an_index_already_used_is_another_call() -> None:
    """A server that numbers each chunk's calls from 0 (Ollama's compat layer) sends a
    second call at index 0 again; its id says it is a new call, not more of the first."""
    deltas = ChatDeltas(HERMES)
    text = deltas.event(tool_delta(0, call_id="a", name="track", arguments='{"id": "T"}'))
    text += deltas.event(tool_delta(0, call_id="b", name="lookup", arguments='{"order": 7}'))
    text += deltas.event(tool_delta(0, arguments=""))  # no id: more of the same call
    text += deltas.event(tool_delta(0, call_id="b", name="", arguments=""))  # its id again: the same
    content, calls = split_tool_calls(text + deltas.finish(), format_=HERMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("track", {"id": "T"}),
        ("lookup", {"order": 7}),
    ]


def test_bad_arguments_from_the_server_stay_text() -> None:
    broken = ChatDeltas(HERMES)
    written = broken.event(tool_delta(0, call_id="a", name="track", arguments="{not json")) + broken.finish()
    content, calls = split_tool_calls(written, format_=HERMES)
    assert calls == [] and content is not None and "{not json" in content  # never a made-up call


def test_server_messages_give_arguments_as_text_and_leave_the_rest() -> None:
    sent = server_messages(MESSAGES)
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == '{"id": "T"}'
    assert MESSAGES[1]["tool_calls"][0]["function"]["arguments"] == {"id": "T"}  # not changed in place
    text = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]
    assert server_messages(text) == text


# ----- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error", "status_type", "words"),
    [
        (
            400,
            json.dumps(
                {"object": "error", "message": '"auto" tool choice requires --enable-auto-tool-choice'}
            ),
            InvalidArgument,
            '/v1/chat/completions answered 400: "auto" tool choice requires --enable-auto-tool-choice',
        ),
        (404, json.dumps({"detail": "Not Found"}), InvalidArgument, "--openai-chat-endpoint off"),
        (
            500,
            json.dumps({"error": {"message": "engine died", "type": "InternalServerError"}}),
            Internal,
            "answered 500: engine died",
        ),
        (503, "upstream unavailable", Internal, "answered 503: upstream unavailable"),
    ],
)
async def test_a_server_error_is_a_clear_engine_error(
    server: FakeServer, status: int, error: str, status_type: type, words: str
) -> None:
    server.status, server.error = status, error
    engine = await engine_for(server)
    with pytest.raises(EngineError) as caught:
        await run(engine, chat_request(Chat(MESSAGES[:1], TOOLS)))
    assert words in str(caught.value) and server.http.address in str(caught.value)
    # As the worker answers it: a refusal is the caller's (INVALID_ARGUMENT), a failure INTERNAL.
    assert isinstance(engine_failure(engine, caught.value), status_type)


async def test_an_error_event_mid_stream_and_a_line_that_is_not_json_are_engine_errors(
    server: FakeServer,
) -> None:
    server.events = [chat_chunk({"content": "par"}), {"error": {"message": "out of KV blocks", "code": 500}}]
    with pytest.raises(EngineError, match="failed mid-stream: out of KV blocks"):
        await run(await engine_for(server), chat_request(Chat(MESSAGES[:1])))
    server.events = [chat_chunk({"content": "par"}), "{truncated"]
    with pytest.raises(EngineError, match="streamed a line that is not JSON: {truncated"):
        await run(await engine_for(server), chat_request(Chat(MESSAGES[:1])))


@pytest.mark.parametrize(
    "event",
    [
        # arguments as an object, not OpenAI's JSON text
        chat_chunk({"tool_calls": [{"index": 0, "function": {"name": "track", "arguments": {"id": "T"}}}]}),
        chat_chunk({"tool_calls": [{"index": None, "function": {"name": "track", "arguments": "{}"}}]}),
        chat_chunk({"tool_calls": [{"index": "0", "function": {"name": "track", "arguments": "{}"}}]}),
        chat_chunk({"content": 5}),
        {"choices": ["not an object"]},
    ],
)
async def test_an_event_not_in_openais_shape_is_a_clear_engine_error(
    server: FakeServer, event: dict[str, Any]
) -> None:
    """A server that streams something else than OpenAI's deltas gets an error naming it,
    not a TypeError from deep in the reader (an UNKNOWN status with a traceback)."""
    server.events = [event, tool_delta(1, call_id="b", name="lookup", arguments="{}")]
    engine = await engine_for(server)
    with pytest.raises(EngineError, match="streamed an event this engine cannot read") as caught:
        await run(engine, chat_request(Chat(MESSAGES[:1], TOOLS)))
    assert server.http.address in str(caught.value)
    assert isinstance(engine_failure(engine, caught.value), Internal)  # the server's fault, not the caller's


@pytest.mark.parametrize(
    "usage", ["lots", {"prompt_tokens": "7"}, {"prompt_tokens": 3, "prompt_tokens_details": [1]}]
)
async def test_a_usage_not_in_openais_shape_is_a_clear_engine_error(server: FakeServer, usage: Any) -> None:
    server.events = [chat_chunk({"content": "ok"}), {**chat_chunk(reason="stop"), "usage": usage}]
    engine = await engine_for(server)
    with pytest.raises(EngineError, match="sent a usage this engine cannot read") as caught:
        await run(engine, chat_request(Chat(MESSAGES[:1], TOOLS)))
    assert server.http.address in str(caught.value)


# ----- through the worker's servicer; the flag ---------------------------------------------------


def generate_request(chat: dict[str, Any], **sampling) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        context=common_pb2.HopContext(run_id="r", hop_id="h"),
        prompt="<|user|>\n" + "generic rendering " * 20 + "\n<|assistant|>\n",
        sampling=common_pb2.SamplingOptions(max_tokens=8, **sampling),
        chat_json=json.dumps(chat),
    )


async def test_the_worker_sends_a_front_chat_whole_and_counts_it_as_the_servers_rendering(
    server: FakeServer,
) -> None:
    server.events = [chat_chunk({"content": "ok"}), chat_chunk(reason="stop")]
    engine = await engine_for(server)
    before = metrics.CHAT_RENDERS.labels("server")._value.get()
    chat = {
        "messages": MESSAGES[:1],
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "track"}},
    }
    try:
        servicer = ModelWorkerServicer(engine, "w1")
        chunks = [c async for c in servicer.Generate(generate_request(chat), None)]
        # A chat the context guard cut runs as its cut prompt: the chat is not whole any more.
        cut = generate_request(chat, max_context_tokens=20, truncate_context=True)
        [c async for c in servicer.Generate(cut, None)]
    finally:
        await engine.stop()
    assert "".join(c.text for c in chunks) == "ok"
    (path, body), (cut_path, cut_body) = server.received
    assert path == "/v1/chat/completions" and body["tool_choice"] == chat["tool_choice"]
    assert cut_path == "/v1/completions" and len(cut_body["prompt"]) < len(generate_request(chat).prompt)
    assert metrics.CHAT_RENDERS.labels("server")._value.get() == before + 1


def test_the_chat_endpoint_flag_is_on_or_off_and_nothing_else(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "m", "--engine", "openai", "--insecure"]
    assert load_settings(WorkerSettings, "inferx-worker", base).openai_chat_endpoint == "on"
    off = load_settings(WorkerSettings, "inferx-worker", [*base, "--openai-chat-endpoint", "off"])
    assert from_settings(off).sends_chats() is False
    assert from_settings(load_settings(WorkerSettings, "inferx-worker", base)).sends_chats() is True
    with pytest.raises(SystemExit) as exited:
        load_settings(WorkerSettings, "inferx-worker", [*base, "--openai-chat-endpoint", "maybe"])
    assert exited.value.code == 2
    assert "--openai-chat-endpoint: Input should be 'on' or 'off'" in capsys.readouterr().err


def test_the_engine_writes_calls_in_the_format_the_worker_registers() -> None:
    base = ["--model", "m", "--engine", "openai", "--insecure"]
    formats = []
    for extra in (["--tool-call-format", "mistral"], []):
        engine = from_settings(load_settings(WorkerSettings, "inferx-worker", [*base, *extra]))
        assert isinstance(engine, OpenAIEngine)
        formats.append(engine.tool_call_format)
    assert formats == [MISTRAL, HERMES]  # auto: hermes, what the routers read when workers name none
