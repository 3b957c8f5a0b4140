"""`--engine openai`: a worker in front of a real OpenAI-compatible server (vLLM's own
`api_server`, CPU build, on the tiny dummy-weight model, with vLLM's Hermes tool parser):
prompts go to its /v1/completions, chats to its /v1/chat/completions (vLLM renders them
with the model's template and enforces a named tool_choice by structured decoding, so
even random weights make the call)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from inferx.client import InferxClient
from inferx.devstack import LocalStack, ManagedProcess, free_port, read_models_file
from inferx.errors import InvalidArgument
from inferx.tinymodel import make_tiny_model
from tests.conftest import E2E_LEASE_TTL_S, EXAMPLES, make_stack, started

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def openai_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    root = tmp_path_factory.mktemp("openai-stack")
    model_dir = make_tiny_model(root / "tiny-llama")
    port = free_port()
    server = ManagedProcess(
        "vllm-api-server",
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            "tiny",
            "--load-format",
            "dummy",
            "--port",
            str(port),
            "--max-model-len",
            "2048",
            "--block-size",
            "32",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--scheduling-policy",
            "priority",
            "--gpu-memory-utilization",
            "0.1",
            "--enforce-eager",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            # Compact JSON under structured decoding: random weights would pad it with whitespace.
            "--structured-outputs-config",
            '{"backend": "xgrammar", "disable_any_whitespace": true}',
        ],
        root / "vllm-server.log",
        # Named tool_choice as JSON-schema decoding of the arguments (vLLM's strict mode
        # uses a structural tag for Hermes, which leaves random weights' arguments free).
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"},
    )
    server.start()

    def start(stack: LocalStack) -> None:
        stack.start_core()  # while vLLM loads
        stack.load_models(read_models_file(EXAMPLES / "models.yaml"))
        deadline = time.monotonic() + 300
        while True:
            assert server.alive(), server.log_tail()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vLLM's API server did not start"
            time.sleep(1)
        stack.start_worker(
            "tiny-llama",
            "openai",
            ["--openai-base-url", f"http://127.0.0.1:{port}", "--model-path", "tiny", "--no-warm-up"],
        )
        stack.put_chains([EXAMPLES / "chains" / "customer_service_agent.yaml"])

    try:
        # Guarded: each test starts once the worker is routed (as in test_vllm_chain.py).
        with started(make_stack(root, lease_ttl_s=E2E_LEASE_TTL_S), start, guard=True) as stack:
            yield stack
    except BaseException:
        print(server.log_tail(40))
        raise
    finally:
        server.stop()


async def test_example_chain_through_an_openai_compatible_server(openai_stack: LocalStack) -> None:
    async with InferxClient(openai_stack.router_address) as client:
        runs = []
        for _ in range(2):
            events = [
                e async for e in client.run_chain("customer_service_agent", {"query": "Where is my order?"})
            ]
            runs.append(events[-1].chain_finished)
        status = await client.status()
    assert all(run.status == "ok" for run in runs), [run.error for run in runs]
    generation = {h.node_id: h for h in runs[1].hops}["response_generation"]
    assert generation.usage.prompt_tokens > 64 and generation.usage.completion_tokens >= 1
    assert generation.usage.cached_prompt_tokens >= 32  # reported by the server's prefix cache
    assert status.workers[0].engine == "openai"


TRACK = {
    "type": "function",
    "function": {
        "name": "track",
        "parameters": {
            "type": "object",
            "properties": {"id": {"type": "string", "enum": ["TRK-42"]}},
            "required": ["id"],
            "additionalProperties": False,
        },
    },
}


async def test_a_chat_goes_to_the_servers_chat_endpoint_which_makes_a_named_tool_call(
    openai_stack: LocalStack,
) -> None:
    """vLLM's chat server renders the chat (an earlier call and its result in it, the
    arguments sent as JSON text as its API wants them), enforces the named tool_choice,
    and sends the call apart; the worker writes it back in Hermes's format, and the
    router streams it as a tool_call event."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Where is my parcel?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "track", "arguments": '{"id": "TRK-42"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "out for delivery"},
        {"role": "user", "content": "Check again."},
    ]
    async with InferxClient(openai_stack.router_address, timeout_s=120) as client:
        events = [
            e
            async for e in client.call_model(
                "qwen-7b",
                messages=messages,
                tools=[TRACK],
                tool_choice={"type": "function", "function": {"name": "track"}},
                max_tokens=48,
                temperature=0.0,
            )
        ]
    calls = [e.tool_call for e in events if e.WhichOneof("event") == "tool_call"]
    assert [(c.name, json.loads(c.arguments_json)) for c in calls] == [("track", {"id": "TRK-42"})]
    finished = events[-1].finished
    assert finished.finish_reason == "stop" and list(finished.tool_calls) == calls  # named: "stop"
    assert finished.usage.prompt_tokens > 0 and finished.usage.completion_tokens > 0


async def test_a_chat_the_server_refuses_is_invalid_argument_with_its_message(
    openai_stack: LocalStack,
) -> None:
    async with InferxClient(openai_stack.router_address, timeout_s=120) as client:
        with pytest.raises(InvalidArgument) as caught:
            async for _ in client.call_model(
                "qwen-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=4000
            ):
                pass
    assert "/v1/chat/completions answered 400" in str(caught.value)
    assert "max_model_len=2048" in str(caught.value)  # vLLM's own words


def test_worker_refuses_a_model_the_server_does_not_serve(openai_stack: LocalStack) -> None:
    server_url = next(a for a in openai_stack.workers[0].argv if a.startswith("http://"))
    bad = openai_stack.start_worker(
        "other", "openai", ["--openai-base-url", server_url, "--model-path", "nope"]
    )
    assert bad.wait(60) != 0
    assert "not 'nope'" in bad.log_tail()
    openai_stack.workers.remove(bad)
