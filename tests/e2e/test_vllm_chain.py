"""The example chain end to end through a real vLLM worker (CPU build on machines
without a GPU) on the generated tiny dummy-weight model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inferx.client import InferxClient
from inferx.devstack import LocalStack, read_models_file
from inferx.tinymodel import make_tiny_model
from tests.conftest import E2E_LEASE_TTL_S, EXAMPLES, make_stack, started

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """Shared by the module's tests, each of which starts once the router, the scheduler
    and the memory-pool see the worker (`started`'s guard)."""
    root = tmp_path_factory.mktemp("vllm-stack")
    model_dir = make_tiny_model(root / "tiny-llama")

    def start(stack: LocalStack) -> None:
        stack.start_core()
        stack.load_models(read_models_file(EXAMPLES / "models.yaml"))
        stack.start_worker(
            "tiny-llama",
            "vllm",
            ["--model-path", str(model_dir), "--max-model-len", "2048", "--max-num-seqs", "8"],
        )
        stack.wait_workers(300)  # vLLM loads the model: about 40 s on a quiet CPU
        stack.put_chains([EXAMPLES / "chains" / "customer_service_agent.yaml"])

    with started(make_stack(root, lease_ttl_s=E2E_LEASE_TTL_S), start, guard=True) as stack:
        yield stack


async def _run(stack: LocalStack, query: str):
    async with InferxClient(stack.router_address) as client:
        events = [e async for e in client.run_chain("customer_service_agent", {"query": query})]
    return events[-1].chain_finished


async def test_example_chain_runs_on_vllm_and_reuses_the_prefix(vllm_stack: LocalStack) -> None:
    first = await _run(vllm_stack, "Where is my order?")
    assert first.status == "ok", first.error
    hops = {h.node_id: h for h in first.hops}
    generation = hops["response_generation"]
    assert generation.usage.prompt_tokens > 64
    assert 1 <= generation.usage.completion_tokens <= 32
    assert generation.worker_id == hops["intent_recognition"].worker_id

    # The same question again: the long prompt of response_generation is now in
    # vLLM's prefix cache (whole 32-token blocks), and the tool result in ours.
    second = await _run(vllm_stack, "Where is my order?")
    assert second.status == "ok", second.error
    hops = {h.node_id: h for h in second.hops}
    assert hops["response_generation"].usage.cached_prompt_tokens >= 32
    assert hops["knowledge_retrieval"].cache_hit


async def test_worker_registered_what_vllm_reports(vllm_stack: LocalStack) -> None:
    async with InferxClient(vllm_stack.router_address) as client:
        status = await client.status()
    (worker,) = status.workers
    assert worker.engine == "vllm"
    # 16 on a GPU (vLLM's default), a multiple of 32 on the CPU backend; 0 (not reported,
    # which `0 % 32 == 0` alone would accept) is a failure.
    size = worker.block_size
    assert size > 0 and (size % 32 == 0 or size == 16), size
    assert worker.kv_capacity_tokens > 1000
    assert Path(worker.model_path).name == "tiny-llama"


async def test_prompt_longer_than_the_model_allows_fails_the_hop_clearly(
    vllm_stack: LocalStack,
) -> None:
    finished = await _run(vllm_stack, "order " * 3000)
    assert finished.status == "error"
    intent = next(h for h in finished.hops if h.node_id == "intent_recognition")
    assert intent.status == "error"
    assert "INVALID_ARGUMENT" in intent.error or "maximum" in intent.error.lower()
    generation = next(h for h in finished.hops if h.node_id == "response_generation")
    assert generation.status == "skipped"


GUARDED = """
agent_chain:
  name: guarded_vllm
  slo: {end_to_end_latency_p99: 10s}
  inputs: [history]
  nodes:
    - id: reply
      type: model_inference
      model: qwen-7b
      timeout: 5s
      max_tokens: 8
      max_context_tokens: 128
      context_overflow: truncate
      prompt: "SYSTEM: be brief\\n{{ inputs.history }}\\nUSER: and now?"
"""


async def test_context_guard_truncates_with_the_models_tokenizer(vllm_stack: LocalStack) -> None:
    history = "\n".join(f"turn {i}: the customer asked about order {i} and its refund" for i in range(40))
    async with InferxClient(vllm_stack.router_address) as client:
        await client.put_chain(GUARDED)
        events = [e async for e in client.run_chain("guarded_vllm", {"history": history})]
    hop = events[-1].chain_finished.hops[0]
    assert hop.status == "ok", hop.error
    assert 0 < hop.usage.prompt_tokens <= 128 - 8


def test_a_chat_with_tools_renders_through_the_models_chat_template(
    vllm_stack: LocalStack, tmp_path: Path
) -> None:
    """The OpenAI front's chat reaches the vLLM worker as a chat and is rendered by the
    tiny model's own template (tools included), tokenized as vLLM's chat server does it
    (the template writes the BOS): the prompt has exactly the template's tokens. The
    weights are random, so the reply's text is not checked, only its shape; the next
    call of the loop starts with this one and hits vLLM's prefix cache."""
    import json

    import openai
    import transformers

    tool = {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Look an order up by its number",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
        },
    }
    messages: list = [
        {"role": "system", "content": "You are a support agent."},
        {"role": "user", "content": "Where is order 7?"},
    ]
    client = openai.OpenAI(base_url=vllm_stack.router_http_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="qwen-7b",
        messages=messages,
        tools=[tool],  # type: ignore[list-item]
        max_tokens=8,
        extra_headers={"X-InferX-Program": "e2e-tools"},
    )
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in {"stop", "length", "tool_calls"}
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 8

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(make_tiny_model(tmp_path / "tiny-llama")))
    rendered = tokenizer.apply_chat_template(
        messages, tools=[tool], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(rendered, str) and rendered.startswith("<s>") and "<tools>" in rendered
    assert reply.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))

    messages += [
        {"role": "assistant", "content": choice.message.content or ""},
        {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"status": "shipped"})},
    ]
    again = client.chat.completions.create(
        model="qwen-7b",
        messages=messages,
        tools=[tool],  # type: ignore[list-item]
        max_tokens=4,
        extra_headers={"X-InferX-Program": "e2e-tools", "X-InferX-Program-End": "true"},
    )
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) >= 32  # whole 32-token blocks


def test_a_call_without_max_tokens_is_not_cut_at_a_default(vllm_stack: LocalStack) -> None:
    """No max_tokens is vLLM's "up to the context room", through the router, the
    scheduler and the worker: the random-weight model, which does not stop on this
    prompt, is still writing past 64 tokens (the cap InferX used to put there). Each
    streamed piece with text holds at least one token; the client leaves after 80."""
    import openai

    client = openai.OpenAI(base_url=vllm_stack.router_http_url, api_key="unused", max_retries=0)
    stream = client.completions.create(  # greedy: the tiny model loops on this prompt without EOS
        model="qwen-7b", prompt="The customer placed an order for shoes", temperature=0, stream=True
    )
    pieces, finished = 0, None
    with stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                pieces += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                finished = chunk.choices[0].finish_reason
                break
            if pieces >= 80:
                break
    assert (pieces, finished) == (80, None), f"the reply ended ({finished}) after {pieces} pieces"


def test_a_responses_api_loop_runs_on_vllm_through_the_template(
    vllm_stack: LocalStack, tmp_path: Path
) -> None:
    """The Responses API (the Agents SDK's default) on a real vLLM worker: `instructions`
    and `input` reach the model as the chat they mean, rendered by its own template (the
    prompt has exactly the template's tokens for the same chat), and the loop's next
    call -- the first reply's output items sent back with a function result -- extends
    the first prompt and hits vLLM's prefix cache. Streamed, the events end with
    `response.completed` (or `.incomplete` at max_output_tokens) carrying the usage."""
    import openai
    import transformers

    tool = {
        "type": "function",
        "name": "lookup_order",
        "description": "Look an order up by its number",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
    }
    client = openai.OpenAI(base_url=vllm_stack.router_http_url, api_key="unused", max_retries=0)
    first = client.responses.create(
        model="qwen-7b",
        instructions="You are a support agent.",
        input="Where is order 7?",
        tools=[tool],  # type: ignore[list-item]
        max_output_tokens=8,
        extra_headers={"X-InferX-Program": "e2e-responses"},
    )
    assert first.object == "response" and first.status in {"completed", "incomplete"}
    assert first.usage is not None and 1 <= first.usage.output_tokens <= 8

    chat_tool = {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(make_tiny_model(tmp_path / "tiny-llama")))
    rendered = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "You are a support agent."},
            {"role": "user", "content": "Where is order 7?"},
        ],
        tools=[chat_tool],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert isinstance(rendered, str)
    assert first.usage.input_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))

    history: list = [{"role": "user", "content": "Where is order 7?"}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history += [
        {"type": "function_call", "call_id": "c1", "name": "lookup_order", "arguments": '{"order_id": "7"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "shipped"},
    ]
    events: list[Any] = list(  # the stream is read to its end (and closed there)
        client.responses.create(
            model="qwen-7b",
            instructions="You are a support agent.",
            input=history,
            tools=[tool],  # type: ignore[list-item]
            max_output_tokens=4,
            stream=True,
            extra_headers={"X-InferX-Program": "e2e-responses", "X-InferX-Program-End": "true"},
        )
    )
    kinds = [event.type for event in events]
    final = events[-1].response  # the terminal event's
    assert kinds[0] == "response.created" and kinds[-1] in {"response.completed", "response.incomplete"}
    assert final.usage is not None and final.usage.input_tokens > first.usage.input_tokens
    assert final.usage.input_tokens_details.cached_tokens >= 32  # whole 32-token blocks


def test_an_anthropic_messages_loop_runs_on_vllm_through_the_template(
    vllm_stack: LocalStack, tmp_path: Path
) -> None:
    """Anthropic's Messages API on a real vLLM worker: `system` and `messages` reach the
    model as the chat they mean, rendered by its own template (input plus cache-read
    tokens are exactly the template's tokens for the same chat), and the next call -- the
    reply's blocks sent back with a tool_result -- hits vLLM's prefix cache."""
    import anthropic
    import transformers

    tool: dict[str, Any] = {
        "name": "lookup_order",
        "description": "Look an order up by its number",
        "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}},
    }
    client = anthropic.Anthropic(
        base_url=vllm_stack.router_http_url.removesuffix("/v1"),
        api_key="unused",
        max_retries=0,
        default_headers={"X-InferX-Program": "e2e-anthropic"},
    )
    messages: list[Any] = [{"role": "user", "content": "Where is order 7?"}]
    first = client.messages.create(
        model="qwen-7b",
        system="You are a support agent.",
        messages=messages,
        tools=[tool],  # type: ignore[list-item]
        max_tokens=8,
    )
    assert first.type == "message" and first.stop_reason in {"end_turn", "max_tokens", "tool_use"}
    assert 1 <= first.usage.output_tokens <= 8

    chat_tool = {
        "type": "function",
        "function": {
            "name": tool["name"],
            "description": tool["description"],
            "parameters": tool["input_schema"],
        },
    }
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(make_tiny_model(tmp_path / "tiny-llama")))
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a support agent."}, *messages],
        tools=[chat_tool],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert isinstance(rendered, str)
    prompt_tokens = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))

    messages += [
        {
            "role": "assistant",
            "content": [
                *[block.model_dump() for block in first.content if block.type == "text"],
                {"type": "tool_use", "id": "toolu_1", "name": "lookup_order", "input": {"order_id": "7"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "shipped"}],
        },
    ]
    with client.messages.stream(
        model="qwen-7b",
        system="You are a support agent.",
        messages=messages,
        tools=[tool],  # type: ignore[list-item]
        max_tokens=4,
        extra_headers={"X-InferX-Program-End": "true"},
    ) as stream:
        final = stream.get_final_message()
    assert (final.usage.cache_read_input_tokens or 0) >= 32  # whole 32-token blocks
