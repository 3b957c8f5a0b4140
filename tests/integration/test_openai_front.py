"""The router's OpenAI-compatible HTTP front, called with the official `openai` SDK
(sync, async, streaming) against SIMULATED sim workers: completions, an agent loop as
one program (one worker, cached tokens growing), and OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

from inferx.devstack import LocalStack
from inferx.v1 import router_pb2, router_pb2_grpc
from inferx_router.http_front import WORKER_HEADER
from inferx_worker.engines.sim_engine import eos_directive

pytestmark = pytest.mark.integration

MODEL = "qwen-7b"  # examples/models.yaml: served by the sim workers' pool


def sync_client(stack: LocalStack, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.router_http_url, api_key="unused", max_retries=0, **kw)


def async_client(stack: LocalStack, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.router_http_url, api_key="unused", max_retries=0, **kw)


def test_models_lists_the_models_from_etcd(sim_stack: LocalStack) -> None:
    names = {model.id for model in sync_client(sim_stack).models.list()}
    assert {"qwen-7b", "qwen-72b"} <= names
    assert sync_client(sim_stack).models.retrieve(MODEL).id == MODEL  # GET /v1/models/{model}


def test_sync_chat_completion_reports_text_and_usage(sim_stack: LocalStack) -> None:
    reply = sync_client(sim_stack).chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Where is my order?"},
        ],
        max_tokens=12,
    )
    assert reply.object == "chat.completion" and reply.model == MODEL
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in {"stop", "length"}
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None


def test_a_call_without_max_tokens_runs_until_the_model_stops(sim_stack: LocalStack) -> None:
    """An unset max_tokens means what it means on OpenAI and vLLM (up to the context
    room), not a short default cap: the (SIMULATED) model stops after 150 tokens by
    itself, through the router, the scheduler and the worker; streamed too."""
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": f"{eos_directive(150)} Write the whole report."}
    ]
    client = sync_client(sim_stack)
    reply = client.chat.completions.create(model=MODEL, messages=messages)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == 150
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 150


def test_tools_are_accepted_and_rendered_into_the_prompt(sim_stack: LocalStack) -> None:
    tool: ChatCompletionFunctionToolParam = {
        "type": "function",
        "function": {
            "name": "track",
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
        },
    }
    plain = sync_client(sim_stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Track order 7"}], max_tokens=4
    )
    with_tools = sync_client(sim_stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Track order 7"}],
        tools=[tool],
        tool_choice="auto",
        max_tokens=4,
    )
    assert plain.usage is not None and with_tools.usage is not None
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens  # the specs are in the prompt


async def test_async_chat_and_text_completions(sim_stack: LocalStack) -> None:
    async with async_client(sim_stack) as client:
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5
        )
        text = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
    assert chat.choices[0].message.content and chat.usage is not None and chat.usage.completion_tokens == 5
    assert text.object == "text_completion" and text.choices[0].text
    assert text.usage is not None and text.usage.completion_tokens == 6


def test_streamed_chat_sends_chunks_then_usage(sim_stack: LocalStack) -> None:
    stream = sync_client(sim_stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 2  # 40 tokens arrive in several pieces, not in one at the end
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 40


async def test_async_streamed_completion(sim_stack: LocalStack) -> None:
    async with async_client(sim_stack) as client:
        stream = await client.completions.create(model=MODEL, prompt="Count:", max_tokens=20, stream=True)
        text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert len(text) > 0


def test_an_agent_loop_is_one_program_on_one_worker_with_growing_cached_tokens(sim_stack: LocalStack) -> None:
    program = f"agent-{uuid.uuid4().hex[:8]}"
    client = sync_client(
        sim_stack, default_headers={"X-InferX-Program": program, "X-InferX-Tier": "realtime"}
    )
    messages: list = [
        {"role": "system", "content": f"[{program}] You are a support agent. " + "Policy text. " * 60},
        {"role": "user", "content": "Where is order 7?"},
    ]
    cached, workers = [], set()
    for step in range(3):
        last = step == 2
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            extra_headers={"X-InferX-Program-End": "true"} if last else None,
        )
        reply = raw.parse()
        workers.add(raw.headers[WORKER_HEADER])
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        cached.append(reply.usage.prompt_tokens_details.cached_tokens or 0)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "tool", "tool_call_id": f"call_{step}", "content": '{"status": "shipped"}' * 4},
        ]
    assert len(workers) == 1, workers
    assert cached[0] < cached[1] < cached[2], cached


def test_unknown_model_is_a_404_through_the_sdk(sim_stack: LocalStack) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        sync_client(sim_stack).chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == 404
    assert caught.value.code == "model_not_found" and "no-such-model" in caught.value.message


async def test_a_streamed_call_to_an_unknown_model_is_a_404_too(sim_stack: LocalStack) -> None:
    async with async_client(sim_stack) as client:
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}], stream=True
            )


def test_a_bad_identity_header_is_a_400_naming_it(sim_stack: LocalStack) -> None:
    client = sync_client(sim_stack, default_headers={"X-InferX-Tier": "urgent"})
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.param == "X-InferX-Tier" and "urgent" in caught.value.message


def test_malformed_bodies_and_unknown_paths_get_openai_shaped_errors(sim_stack: LocalStack) -> None:
    base = sim_stack.router_http_url
    with httpx.Client() as http:
        cases = [
            (http.post(f"{base}/chat/completions", content=b"{oops"), 400, "body"),
            (http.post(f"{base}/chat/completions", json={"model": MODEL, "messages": "hi"}), 400, "messages"),
            (http.post(f"{base}/completions", json={"model": MODEL, "prompt": [1, 2]}), 400, "prompt"),
            (http.get(f"{base}/nowhere"), 404, None),
            (http.post(f"{base}/embeddings", json={"model": MODEL, "input": "hi"}), 404, None),
            (http.get(f"{base}/chat/completions"), 405, None),
            (http.get(f"{base}/models/no-such-model"), 404, "model"),
        ]
    for reply, status, param in cases:
        assert reply.status_code == status, reply.text
        assert reply.headers["content-type"].startswith("application/json")
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param


def test_fields_inferx_cannot_serve_are_refused_not_ignored(sim_stack: LocalStack) -> None:
    """n > 1, logprobs, echo, the legacy functions: a 400 naming the field, never a reply
    that silently lacks what was asked for; OpenAI's nulls are its defaults."""
    client = sync_client(sim_stack)
    refused: list[tuple[str, dict[str, object], str]] = [
        ("n", {"n": 3}, "n must be 1"),
        ("logprobs", {"logprobs": True, "top_logprobs": 2}, "log probabilities"),
        ("functions", {"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "send tools"),
        ("tools", {"tools": [{"type": "function"}]}, "tool 0"),
    ]
    for param, fields, words in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=fields
            )
        assert caught.value.param == param and words in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, echo=True)
    assert caught.value.param == "echo"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "n": None,
        "stream": None,
        "logprobs": False,
    }
    reply = httpx.post(f"{sim_stack.router_http_url}/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 1


async def test_a_non_streamed_call_whose_client_leaves_stops_using_the_engine(sim_stack: LocalStack) -> None:
    """As a streamed one does: the router cancels the call when its HTTP client
    disconnects, and the worker's engine aborts the request, rather than generating
    2,000 tokens for nobody."""
    from tests.integration.test_faults import running_hops
    from tests.polling import poll_until

    body = {"model": MODEL, "messages": [{"role": "user", "content": "talk at length"}], "max_tokens": 2000}
    patience = httpx.Timeout(30, read=1.0)
    async with httpx.AsyncClient(base_url=sim_stack.router_http_url, timeout=patience) as c:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            await c.post("/chat/completions", json=body)

    async def engines_idle() -> bool:
        return all([await running_hops(worker) == 0 for worker in sim_stack.workers])

    # Left alone, 2,000 tokens take the sim engine many seconds more.
    await poll_until(engines_idle, timeout_s=2.0, interval_s=0.05, what="the engines to drop the call")


async def test_a_non_streamed_call_to_a_workers_own_http_api_whose_client_leaves_is_aborted(
    sim_stack: LocalStack,
) -> None:
    """The same on a (sim) worker's own OpenAI HTTP API (`--openai-http-port`)."""
    from inferx.devstack import free_port, wait_serving
    from tests.integration.test_faults import running_hops
    from tests.polling import poll_until

    port = free_port()
    worker = sim_stack.start_worker("http-only", "sim", ["--openai-http-port", str(port), "--sim-speed", "1"])
    try:
        wait_serving(worker, 60)  # called on its own port: its being routed is not needed
        body = {"model": "http-only", "prompt": "talk at length", "max_tokens": 2000}
        patience = httpx.Timeout(30, read=1.0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1", timeout=patience) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/completions", json=body)

        async def idle() -> bool:
            return await running_hops(worker) == 0

        await poll_until(idle, timeout_s=2.0, interval_s=0.05, what="the engine to drop the call")
    finally:
        sim_stack.workers.remove(worker)
        worker.stop()


async def test_a_streamed_call_whose_client_leaves_while_it_is_queued_never_runs(
    sim_stack: LocalStack,
) -> None:
    """A client tired of waiting for its first token (its call queued behind others)
    leaves: the call leaves the queue, and is not run for nobody once a slot frees."""
    from tests.conftest import wait_workers_routed
    from tests.integration.test_faults import running_hops
    from tests.polling import poll_until

    worker = sim_stack.start_worker("narrow", "sim", ["--max-num-seqs", "1", "--sim-speed", "1"])
    try:
        wait_workers_routed(sim_stack, workers=[worker])
        long = {"model": "narrow", "messages": [{"role": "user", "content": "talk"}], "max_tokens": 2000}
        async with httpx.AsyncClient(base_url=sim_stack.router_http_url, timeout=30) as c:

            async def listed() -> bool:
                return "narrow" in (await c.get("/models")).text

            await poll_until(listed, timeout_s=20, what="the router to see the narrow pool")
            ahead = asyncio.create_task(c.post("/chat/completions", json=long))  # takes the only slot

            async def running() -> bool:
                return await running_hops(worker) == 1

            await poll_until(running, timeout_s=10, what="the first call to run")
            patience = httpx.Timeout(30, read=1.0)
            left = {"X-InferX-Program": f"left-{uuid.uuid4().hex[:8]}"}
            with pytest.raises(httpx.ReadTimeout):  # queued: no first token within its patience
                async with c.stream(
                    "POST", "/chat/completions", json={**long, "stream": True}, headers=left, timeout=patience
                ):
                    pass
            ahead.cancel()  # the first call's client leaves too: its slot frees

        async def idle() -> bool:
            return await running_hops(worker) == 0

        # The queued call, still queued, would take the freed slot and run 2,000 tokens.
        await asyncio.sleep(1.0)
        await poll_until(idle, timeout_s=2.0, interval_s=0.05, what="the engine to stay idle")
        async with grpc.aio.insecure_channel(sim_stack.router_address) as channel:
            record = await router_pb2_grpc.RouterStub(channel).GetRun(
                router_pb2.GetRunRequest(run_id=left["X-InferX-Program"]), timeout=10
            )
        (call,) = record.finished.hops
        assert call.status == "cancelled" and not call.worker_id  # never dispatched
    finally:
        sim_stack.workers.remove(worker)
        worker.stop()
