"""The sim worker's OpenAI-compatible HTTP (`--openai-http-port`), called with the
official `openai` SDK (sync and streaming), its router-facing endpoints (/health,
/metrics in vLLM's names, /get_load, ...), OpenAI-shaped errors, and one engine shared
with the gRPC `ModelWorker`: a prefix cached by one path is a cache hit for the other.

The worker's HTTP server and gRPC server run in-process, in one event loop on a
background thread (as in the worker process), so the sync SDK can call them. Tool calls
a --sim-script reply writes come back as OpenAI's tool calls, whole and streamed, in
the worker's format (its flag, else its chat template's), as the router's front gives
them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass
from typing import cast

import grpc
import httpx
import openai
import pytest
from starlette.testclient import TestClient

from inferx.chat_template import ChatTemplate
from inferx.devstack import free_port
from inferx.httpserve import EmbeddedHttpServer
from inferx.openai_compat.toolcalls import DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP
from inferx.sim.profile import EngineProfile
from inferx.sim.script import SimScript
from inferx.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from inferx_worker.engines.sim_engine import (
    UNSET_REPLY_TOKENS,
    SimEngine,
    SimParams,
    eos_after,
    eos_directive,
)
from inferx_worker.http_api import WorkerHttpApi, vllm_metrics
from inferx_worker.servicer import ModelWorkerServicer

POOL = "sim-pool"


@dataclass
class Worker:
    engine: SimEngine
    api: WorkerHttpApi
    http_url: str
    grpc_address: str
    loop: asyncio.AbstractEventLoop

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.http_url}/v1", api_key="unused", max_retries=0)

    def grpc_generate(self, prompt: str, max_tokens: int = 4) -> worker_pb2.GenerateChunk:
        with grpc.insecure_channel(self.grpc_address) as channel:
            stub = worker_pb2_grpc.ModelWorkerStub(channel)
            request = worker_pb2.GenerateRequest(
                prompt=prompt, sampling=common_pb2.SamplingOptions(max_tokens=max_tokens)
            )
            return list(stub.Generate(request, timeout=30))[-1]


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    """A sim engine (fast: x50) behind the HTTP API and the gRPC servicer, one loop."""
    engine = SimEngine(SimParams(profile=EngineProfile(kv_capacity_tokens=200_000), speed=50))
    api = WorkerHttpApi(engine, POOL, "worker-test")
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()
    ports = {"http": free_port(), "grpc": free_port()}

    async def serve() -> None:
        await engine.start()
        http = EmbeddedHttpServer(api.app(), "127.0.0.1", ports["http"])
        await http.start()
        server = grpc.aio.server()
        worker_pb2_grpc.add_ModelWorkerServicer_to_server(ModelWorkerServicer(engine, "worker-test"), server)
        server.add_insecure_port(f"127.0.0.1:{ports['grpc']}")
        await server.start()
        api.serving = True
        ready.set()
        await stop.wait()
        await server.stop(0)
        await http.stop()
        await engine.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(20), "the in-process worker did not start"
    yield Worker(engine, api, f"http://127.0.0.1:{ports['http']}", f"127.0.0.1:{ports['grpc']}", loop)
    loop.call_soon_threadsafe(stop.set)
    thread.join(20)


def unique(tag: str, tokens: int = 64) -> str:
    """A prompt of `tokens` sim tokens (4 characters each) no other test shares."""
    text = f"[{tag} {threading.get_ident()} {id(tag)}] " + "the agent reads the file and runs the tests " * 50
    return text[: tokens * 4]


def test_models_lists_the_pool(worker: Worker) -> None:
    names = {model.id for model in worker.client().models.list()}
    assert POOL in names
    assert worker.client().models.retrieve(POOL).id == POOL  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError) as refused:
        worker.client().models.retrieve("no-such-model")
    assert refused.value.code == "model_not_found"


def test_sync_chat_completion_with_usage(worker: Worker) -> None:
    reply = worker.client().chat.completions.create(
        model=POOL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is it?"}],
        max_tokens=7,
    )
    assert reply.object == "chat.completion" and reply.model == POOL
    assert reply.choices[0].message.content and len(reply.choices[0].message.content) == 7 * 4
    assert reply.choices[0].finish_reason == "length"
    usage = reply.usage
    assert usage is not None and usage.completion_tokens == 7 and usage.prompt_tokens > 0
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_chat_and_text_completion(worker: Worker) -> None:
    client = worker.client()
    stream = client.chat.completions.create(
        model=POOL,
        messages=[{"role": "user", "content": unique("stream")}],
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 20 * 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    completion = client.completions.create(model=POOL, prompt=unique("text"), max_tokens=3)
    assert completion.object == "text_completion" and len(completion.choices[0].text) == 12
    streamed = list(client.completions.create(model=POOL, prompt=unique("text2"), max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in streamed) and streamed[-1].choices[0].finish_reason == "length"


def test_agent_loop_grows_cached_tokens(worker: Worker) -> None:
    """Each call sends the previous messages + the completion + a tool result: the
    engine's prefix cache serves everything before the new message."""
    client = worker.client()
    messages: list = [{"role": "system", "content": unique("agent", 128)}, {"role": "user", "content": "go"}]
    cached = []
    for step in range(3):
        reply = client.chat.completions.create(model=POOL, messages=messages, max_tokens=16)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        cached.append(reply.usage.prompt_tokens_details.cached_tokens or 0)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "tool", "tool_call_id": f"call_{step}", "content": "result " * 20},
        ]
    # (The sim engine's tokens are 4 characters: a rendering whose length is not a
    # multiple of 4 shifts the completion's tokens, so the hit can stop at the last whole
    # block before it; the benchmark's client pads messages to whole tokens.)
    assert cached[0] == 0 and cached[2] > cached[1] >= 128


def test_eos_directive_stops_the_completion(worker: Worker) -> None:
    assert eos_after("a <|sim-eos 5|> b <|sim-eos 9|> c") == 9
    assert eos_after("nothing") is None and eos_after("<|sim-eos x|>") is None
    reply = worker.client().chat.completions.create(
        model=POOL, messages=[{"role": "user", "content": f"{eos_directive(6)} hi"}], max_tokens=50
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 6
    assert reply.choices[0].finish_reason == "stop"


def test_a_call_without_max_tokens_runs_until_the_model_stops(worker: Worker) -> None:
    """Unset (HTTP: no field; gRPC: 0) is OpenAI's and vLLM's "up to the context room",
    not a default cap: the "model" stops by itself after 150 tokens, or, told nothing,
    after UNSET_REPLY_TOKENS."""
    told = unique("unset-max-tokens") + eos_directive(150)
    reply = worker.client().completions.create(model=POOL, prompt=told)
    assert reply.usage is not None and reply.usage.completion_tokens == 150
    assert reply.choices[0].finish_reason == "stop"
    final = worker.grpc_generate(told + " again", max_tokens=0)
    assert final.usage.completion_tokens == 150 and final.finish_reason == "stop"
    final = worker.grpc_generate(unique("unset, untold"), max_tokens=0)
    assert final.usage.completion_tokens == UNSET_REPLY_TOKENS and final.finish_reason == "stop"


def test_a_prompt_that_leaves_no_room_for_a_reply_is_a_400() -> None:
    """Without max_tokens the prompt alone must leave a token of room (OpenAI's 400)."""
    engine = SimEngine(SimParams(profile=EngineProfile(kv_capacity_tokens=64)))
    api = WorkerHttpApi(engine, POOL, "worker-test")
    api.serving = True
    refused = TestClient(api.app()).post("/v1/completions", json={"model": POOL, "prompt": "x" * 4 * 64})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "prompt" and "no room is left for a reply" in error["message"]


def test_http_and_grpc_share_the_engine_prefix_cache(worker: Worker) -> None:
    """A prefix prefilled over HTTP is a cache hit over gRPC, and the other way round."""
    client = worker.client()
    first = unique("http-then-grpc", 96)
    client.completions.create(model=POOL, prompt=first, max_tokens=2)
    hit = worker.grpc_generate(first + " and more")
    assert hit.usage.cached_prompt_tokens >= 80

    second = unique("grpc-then-http", 96)
    worker.grpc_generate(second)
    reply = client.completions.create(model=POOL, prompt=second + " and more", max_tokens=2)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert (reply.usage.prompt_tokens_details.cached_tokens or 0) >= 80


def test_router_facing_endpoints_report_the_engine_state(worker: Worker) -> None:
    with httpx.Client(base_url=worker.http_url) as http:
        assert http.get("/health").status_code == 200
        load = http.get("/get_load").json()
        assert set(load) >= {"load", "num_requests_running", "num_requests_waiting"}
        info = http.get("/get_server_info").json()
        assert info["engine"] == "sim" and info["simulated"] and info["kv_capacity_tokens"] == 200_000
        assert http.get("/get_model_info").json()["is_generation"]
        text = http.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f'{name}{{engine="0",model_name="{POOL}"}}' in text
    assert "vllm:prefix_cache_hits_total" in text


async def test_metrics_follow_requests_in_flight() -> None:
    engine = SimEngine(SimParams(profile=EngineProfile(decode_step_ms=50.0), speed=1))
    await engine.start()
    try:
        from inferx_worker.engines.base import EngineRequest

        agen = cast(AsyncGenerator, engine.generate(EngineRequest("m", "x" * 400, max_tokens=50)))
        await agen.__anext__()  # running now
        text = vllm_metrics(engine, "m")
        assert 'vllm:num_requests_running{engine="0",model_name="m"} 1.0' in text
        usage = next(line for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc{"))
        assert float(usage.split()[-1]) > 0
        await agen.aclose()
    finally:
        await engine.stop()
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 0.0' in vllm_metrics(engine, "m")


def test_errors_are_openai_shaped(worker: Worker) -> None:
    client = worker.client()
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=POOL, prompt="x" * 8, max_tokens=300_000)
    assert "maximum context length" in str(too_long.value)
    with httpx.Client(base_url=worker.http_url) as http:
        bad = http.post("/v1/chat/completions", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"
        role = http.post("/v1/chat/completions", json={"model": POOL, "messages": [{"role": "x"}]})
        assert role.status_code == 400 and role.json()["error"]["param"].startswith("messages[0]")
        assert http.get("/v1/nope").status_code == 404


def test_health_is_503_while_not_serving(worker: Worker) -> None:
    worker.api.serving = False
    try:
        with httpx.Client(base_url=worker.http_url) as http:
            assert http.get("/health").status_code == 503
            refused = http.post("/v1/completions", json={"model": POOL, "prompt": "x", "max_tokens": 1})
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    finally:
        worker.api.serving = True


async def test_chats_use_the_engines_chat_template_as_on_grpc() -> None:
    """With a model template the HTTP path renders as the gRPC path does (the template),
    without one InferX's generic rendering: the prompt's size says which."""
    template = ChatTemplate("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]")
    for engine_template, expected in ((template, len("[user]hello there[assistant]")), (None, None)):
        engine = SimEngine(SimParams(speed=50), chat_template=engine_template)
        api = WorkerHttpApi(engine, POOL, "w")
        api.serving = True
        await engine.start()
        try:
            transport = httpx.ASGITransport(app=api.app())
            async with httpx.AsyncClient(transport=transport, base_url="http://worker") as http:
                body = {
                    "model": POOL,
                    "messages": [{"role": "user", "content": "hello there"}],
                    "max_tokens": 2,
                }
                reply = (await http.post("/v1/chat/completions", json=body)).json()
        finally:
            await engine.stop()
        generic = len("<|user|>\nhello there\n<|assistant|>\n")
        assert reply["usage"]["prompt_tokens"] == -(-(expected or generic) // 4)


# ----- tool calls ---------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "lookup_order", "parameters": {"type": "object"}}},
]
# A scripted reply per format: content first where the format has it, then two calls.
SCRIPTED = {
    "hermes": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "7"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "lookup_order", "parameters": {"order_id": "7"}}',
    "mistral": 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    '[TOOL_CALLS]lookup_order[ARGS]{"order_id": "7"}',
    "pythonic": '[get_weather(city="Paris"), lookup_order(order_id="7")]',
    "deepseek_v3": f"Checking.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n"
    f'{{"city": "Paris"}}\n```{DS_CALL_END}\n{DS_CALL_BEGIN}function{DS_SEP}lookup_order\n```json\n'
    f'{{"order_id": "7"}}\n```{DS_CALL_END}{DS_CALLS_END}',
    "granite": 'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "lookup_order", "arguments": {"order_id": "7"}}]',
}
CONTENT = {"hermes": "Checking.", "mistral": "Checking.", "deepseek_v3": "Checking.", "granite": "Checking."}
EXPECTED = [("get_weather", {"city": "Paris"}), ("lookup_order", {"order_id": "7"})]


@contextlib.asynccontextmanager
async def scripted_client(reply: str, tool_call_format: str = "hermes") -> AsyncIterator[openai.AsyncOpenAI]:
    """The official SDK against a sim worker's HTTP API (in-process) whose every reply is `reply`."""
    engine = SimEngine(SimParams(speed=100), script=SimScript.from_data([{"reply": reply}]))
    api = WorkerHttpApi(engine, POOL, "w", tool_call_format)
    api.serving = True
    await engine.start()
    try:
        transport = httpx.ASGITransport(app=api.app())
        async with httpx.AsyncClient(transport=transport) as http:
            yield openai.AsyncOpenAI(
                base_url="http://worker/v1",
                api_key="unused",
                http_client=http,  # type: ignore[arg-type]  # openai takes httpx clients too (typed as httpx2's)
                max_retries=0,
            )
    finally:
        await engine.stop()


def _chat(**fields: object) -> dict:
    return {
        "model": POOL,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 200,
    } | fields


@pytest.mark.parametrize("format_", sorted(SCRIPTED))
async def test_scripted_tool_calls_come_back_as_openai_tool_calls(format_: str) -> None:
    async with scripted_client(SCRIPTED[format_], format_) as client:
        reply = await client.chat.completions.create(**_chat(tools=TOOLS))
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == CONTENT.get(format_)
        calls = choice.message.tool_calls or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED
        assert all(c.id.startswith("call_") and c.type == "function" for c in calls)

        stream = await client.chat.completions.create(**_chat(tools=TOOLS, stream=True))
        chunks = [chunk async for chunk in stream]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert deltas[0].role == "assistant"
        assert "".join(d.content or "" for d in deltas) == (CONTENT.get(format_) or "")
        parts = [tc for d in deltas for tc in d.tool_calls or []]
        names = [(tc.index, tc.function.name) for tc in parts if tc.id and tc.function]
        assert names == [(0, "get_weather"), (1, "lookup_order")]
        arguments = [
            "".join(tc.function.arguments or "" for tc in parts if tc.index == i and tc.function)
            for i in (0, 1)
        ]
        assert [json.loads(a) for a in arguments] == [args for _, args in EXPECTED]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
            "tool_calls"
        ]


async def test_without_tools_offered_or_with_tool_choice_none_the_reply_is_content() -> None:
    text = SCRIPTED["hermes"]
    async with scripted_client(text) as client:
        for fields in ({}, {"tools": TOOLS, "tool_choice": "none"}):
            reply = await client.chat.completions.create(**_chat(**fields))
            assert reply.choices[0].message.content == text and not reply.choices[0].message.tool_calls
            assert reply.choices[0].finish_reason == "stop"
            stream = await client.chat.completions.create(**_chat(stream=True, **fields))
            chunks = [chunk async for chunk in stream]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
            assert chunks[-1].choices[0].finish_reason == "stop"


async def test_a_reply_that_breaks_tool_choice_is_a_500_streamed_or_not() -> None:
    async with scripted_client("It is sunny in Paris.") as client:
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as failed:
                await client.chat.completions.create(
                    **_chat(tools=TOOLS, tool_choice="required", stream=stream)
                )
            assert failed.value.code == "tool_choice_not_followed"  # a stream: nothing was sent, so a 500
    async with scripted_client(SCRIPTED["hermes"]) as client:
        named = {"type": "function", "function": {"name": "get_weather"}}
        with pytest.raises(openai.InternalServerError):  # it also called lookup_order
            await client.chat.completions.create(**_chat(tools=TOOLS, tool_choice=named))


def test_the_worker_reads_tool_calls_in_the_format_it_registers() -> None:
    """--tool-call-format, else the chat template's, else the routers' default."""
    from types import SimpleNamespace

    from inferx.server import ServiceRuntime
    from inferx_worker.__main__ import WorkerComponent
    from inferx_worker.config import WorkerSettings

    runtime = cast(ServiceRuntime, SimpleNamespace(instance_id="w"))
    granite = ChatTemplate("{{ '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' }}")
    for flag, template, expected in (
        ("auto", granite, "granite"),
        ("pythonic", granite, "pythonic"),
        ("auto", None, "hermes"),
    ):
        settings = WorkerSettings(
            model=POOL, engine="sim", openai_http_port=free_port(), tool_call_format=flag
        )
        component = WorkerComponent(runtime, settings, SimEngine(chat_template=template))
        assert component._http_api is not None and component._http_api.tool_call_format == expected


def test_a_stream_the_client_abandons_aborts_its_engine_request(worker: Worker) -> None:
    """A client that reads one chunk and hangs up frees the engine at once: the request
    is aborted, not run to its max_tokens for nobody (a slot and KV held meanwhile)."""
    with httpx.Client(base_url=worker.http_url, timeout=30) as client:
        body = {"model": POOL, "prompt": unique("abandoned"), "max_tokens": 20_000, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            next(reply.iter_lines())
    hung_up = time.monotonic()
    while worker.engine.load().running and time.monotonic() < hung_up + 2:  # run out: ~8 s
        time.sleep(0.01)
    assert worker.engine.load().running == 0
