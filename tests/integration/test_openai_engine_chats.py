"""`--engine openai` workers in front of a real OpenAI-compatible server, all real
processes: the server is a SIMULATED sim worker's own HTTP API (`--openai-http-port`,
the tiny model's chat template, a `--sim-script`), and `Router.CallModel` reaches it
through the router, the scheduler and an `openai` worker.

The script's rule matches text only the model's template writes (`<|im_start|>user`),
so a scripted reply proves the chat went to the server's /v1/chat/completions and was
rendered there; a worker with `--openai-chat-endpoint off` sends InferX's generic
rendering to /v1/completions instead, which the rule does not match. The reply is a
Hermes tool call, which the server reads out of its text and streams apart (OpenAI's
tool-call deltas); the `openai` worker writes it back into the text in its format, and
the router reads it and streams it as a `tool_call` event. A server refusal (a context
longer than the server's) comes back as INVALID_ARGUMENT naming the server's answer."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferx.devstack import LocalStack, free_port, read_models_file, wait_serving
from inferx.errors import InvalidArgument
from inferx.tinymodel import make_tiny_model
from inferx.v1 import router_pb2, router_pb2_grpc
from tests.conftest import EXAMPLES, make_stack, started

pytestmark = pytest.mark.integration

MODEL = "qwen-7b"  # examples/models.yaml: pool tiny-llama, the chat-endpoint openai worker
GENERIC_POOL = "generic-openai"  # an openai worker with --openai-chat-endpoint off
SERVER_POOL = "sim-server"  # the server's own pool (its HTTP API serves it by this name)
ASK = "Track TRK-42 for me."
CALL = '<tool_call>\n{"name": "track", "arguments": {"id": "TRK-42"}}\n</tool_call>'
THINK_ASK = "Think first, then track TRK-42."
THOUGHT = "The user wants TRK-42; the track tool does that."
SCRIPT = [
    {"when": f"<|im_start|>user\n{ASK}", "reply": "On it.\n" + CALL},
    # A reasoning model's reply: the server (--reasoning-parser qwen3) sends the thinking
    # apart as reasoning_content, and the tool call apart.
    {"when": f"<|im_start|>user\n{THINK_ASK}", "reply": f"<think>{THOUGHT}</think>On it.\n" + CALL},
]
TOOL: Any = {"type": "function", "function": {"name": "track", "parameters": {"type": "object"}}}
INFERX = str(Path(sys.executable).with_name("inferx"))
SERVER_KV_TOKENS = 4000  # the server's context limit (the sim's KV pool)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    root = tmp_path_factory.mktemp("openai-chats")
    model_dir = make_tiny_model(root / "tiny-llama")
    script = root / "script.json"
    script.write_text(json.dumps(SCRIPT))
    port = free_port()

    def start(stack: LocalStack) -> None:
        stack.start_core()
        stack.load_models(read_models_file(EXAMPLES / "models.yaml"))
        server = stack.start_worker(
            SERVER_POOL,
            "sim",
            [
                *("--openai-http-port", str(port), "--model-path", str(model_dir)),
                *("--sim-script", str(script), "--sim-speed", "20"),
                *("--sim-kv-capacity-tokens", str(SERVER_KV_TOKENS)),
                *("--reasoning-parser", "qwen3"),
            ],
        )
        wait_serving(server, 60)
        url = ["--openai-base-url", f"http://127.0.0.1:{port}", "--model-path", SERVER_POOL]
        stack.start_worker("tiny-llama", "openai", url)
        stack.start_worker(GENERIC_POOL, "openai", [*url, "--openai-chat-endpoint", "off"])

    with started(make_stack(root / "stack"), start, guard=True) as running:
        yield running


async def chat_renders(stack: LocalStack, pool: str) -> dict[str, float]:
    """inferx_worker_chat_renders_total by whose rendering ran, from the /metrics of the
    pool's (one) worker."""
    async with stack.client() as client:
        status = await client.status()
    (worker_id,) = [w.worker_id for w in status.workers if w.pool == pool]
    (address,) = [s.metrics_address for s in status.services if s.instance_id == worker_id]
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {
        sample.labels["template"]: sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == "inferx_worker_chat_renders_total"
    }


async def call(stack: LocalStack, model: str, ask: str = ASK, **kw) -> list[router_pb2.ProgramCallEvent]:
    program = f"p-{uuid.uuid4().hex[:8]}"
    messages = [
        {"role": "system", "content": f"[{program}] You track parcels."},
        {"role": "user", "content": ask},
    ]
    async with stack.client(timeout_s=30) as client:
        return [e async for e in client.call_model(model, messages=messages, tools=[TOOL], **kw)]


async def test_a_chat_reaches_the_servers_chat_endpoint_and_its_tool_call_streams_back(
    stack: LocalStack,
) -> None:
    before = (await chat_renders(stack, SERVER_POOL)).get("model", 0.0)
    before_front = (await chat_renders(stack, "tiny-llama")).get("server", 0.0)
    events = await call(stack, MODEL, max_tokens=64)
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[-2:] == ["tool_call", "finished"] and set(kinds[:-2]) == {"text"}
    assert "".join(e.text for e in events if e.WhichOneof("event") == "text") == "On it."
    tool_call = events[-2].tool_call
    assert (tool_call.index, tool_call.name, json.loads(tool_call.arguments_json)) == (
        0,
        "track",
        {"id": "TRK-42"},
    )
    finished = events[-1].finished
    assert finished.finish_reason == "tool_calls" and list(finished.tool_calls) == [tool_call]
    assert finished.usage.prompt_tokens > 0 and finished.usage.completion_tokens > 0  # the server's usage
    # Rendered once, by the server with the model's template; the front worker sent it whole.
    assert (await chat_renders(stack, SERVER_POOL)).get("model", 0.0) == before + 1
    assert (await chat_renders(stack, "tiny-llama")).get("server", 0.0) == before_front + 1


async def test_a_servers_reasoning_comes_back_apart_and_its_tool_call_is_still_read(
    stack: LocalStack,
) -> None:
    """The server splits the thinking out (reasoning_content deltas); the `openai` worker
    writes it back between <think> tags and registers qwen3 (auto), so the router gives
    it as `reasoning` events before the answer -- not as content, not read for calls."""
    events = await call(stack, MODEL, ask=THINK_ASK, max_tokens=64)
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "reasoning" and kinds[-2:] == ["tool_call", "finished"]
    assert "".join(e.reasoning for e in events if e.WhichOneof("event") == "reasoning") == THOUGHT
    assert "".join(e.text for e in events if e.WhichOneof("event") == "text") == "On it."
    assert events[-2].tool_call.name == "track" and events[-1].finished.finish_reason == "tool_calls"
    assert events[-1].finished.reasoning == THOUGHT
    async with grpc.aio.insecure_channel(stack.router_address) as channel:  # the record keeps it apart
        request = router_pb2.GetRunRequest(run_id=events[-1].finished.run_id)
        record = await router_pb2_grpc.RouterStub(channel).GetRun(request, timeout=10)
    assert [hop.reasoning for hop in record.finished.hops] == [THOUGHT]
    # A reply without thinking gets no reasoning event (the worker writes no tags for it).
    plain = await call(stack, MODEL, max_tokens=64)
    assert "reasoning" not in [e.WhichOneof("event") for e in plain]
    # The router's OpenAI front, with the official SDK: reasoning_content, whole and streamed.
    sdk = openai.OpenAI(base_url=stack.router_http_url, api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": THINK_ASK}]
    reply = sdk.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], max_tokens=64)
    message = reply.choices[0].message
    assert getattr(message, "reasoning_content", None) == THOUGHT and message.content == "On it."
    assert [c.model_dump()["function"]["name"] for c in message.tool_calls or []] == ["track"]
    stream = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, stream=True)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT
    assert "<think>" not in "".join(d.content or "" for d in deltas)
    # `inferx call` prints the thinking on stderr, the answer on stdout.
    called = subprocess.run(
        [
            INFERX,
            "call",
            MODEL,
            THINK_ASK,
            "--system",
            "You track parcels.",
            "--router",
            stack.router_address,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert called.returncode == 0, called.stderr
    assert called.stdout.startswith("On it.") and THOUGHT not in called.stdout and THOUGHT in called.stderr
    async with stack.client() as client:
        status = await client.status()
    registered = {w.pool: w.reasoning_parser for w in status.workers}
    assert registered["tiny-llama"] == "qwen3" and registered[SERVER_POOL] == "qwen3"
    assert registered[GENERIC_POOL] == ""  # on /v1/completions the model's own text is all there is


async def test_with_the_chat_endpoint_off_the_generic_rendering_goes_to_completions(
    stack: LocalStack,
) -> None:
    before = (await chat_renders(stack, GENERIC_POOL)).get("generic", 0.0)
    events = await call(stack, GENERIC_POOL, max_tokens=16)
    text = "".join(e.text for e in events if e.WhichOneof("event") == "text")
    assert "tool_call" not in [e.WhichOneof("event") for e in events]
    assert text and "On it." not in text  # the sim's synthetic text: the template-only rule did not match
    assert not events[-1].finished.tool_calls
    assert (await chat_renders(stack, GENERIC_POOL)).get("generic", 0.0) == before + 1


async def test_a_server_refusal_is_invalid_argument_naming_the_servers_answer(stack: LocalStack) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await call(stack, MODEL, max_tokens=SERVER_KV_TOKENS + 100)
    message = str(caught.value)
    assert "/v1/chat/completions answered 400" in message and "maximum context length" in message
