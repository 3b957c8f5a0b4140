"""The sim worker's OpenAI-compatible HTTP (`--openai-http-port`), called with the
official `openai` SDK (sync and streaming), its router-facing endpoints (/health,
/metrics in vLLM's names, /get_load, ...), OpenAI-shaped errors, and one engine shared
with the gRPC `ModelWorker`: a prefix cached by one path is a cache hit for the other.

The worker's HTTP server and gRPC server run in-process, in one event loop on a
background thread (as in the worker process), so the sync SDK can call them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from typing import cast

import grpc
import httpx
import openai
import pytest

from inferx.devstack import free_port
from inferx.httpserve import EmbeddedHttpServer
from inferx.sim.profile import EngineProfile
from inferx.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from inferx_worker.engines.sim_engine import SimEngine, SimParams, eos_after, eos_directive
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
    from inferx.chat_template import ChatTemplate

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
