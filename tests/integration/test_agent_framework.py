"""Tool-calling agents through the router's OpenAI-compatible front: a real agent
framework (the OpenAI Agents SDK, `openai-agents`) runs a multi-step tool-calling loop,
and the plain `openai` SDK gets `tool_calls` whole and streamed, in the tiny template's
Hermes format and, for models mapped with another `tool_call_format`, in Mistral's,
Llama 3's, pythonic, DeepSeek-V3's and Granite's; tool_choice "required" and named are
checked on the reply.

The workers are SIMULATED sim workers with a script (`--sim-script`: when the rendered
prompt holds X, reply Y, where Y may be a tool call in the chat template's format) and
the generated tiny model's chat template (`--model-path`): the rules match text only the
template writes (`<tool_response>`), so a reply proves the worker rendered the chat with
it. The tool calls are the script's; what the test checks is InferX's part: the
template, the parsing into OpenAI's shapes, one program on one worker, the prefix cache.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import yaml
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

from inferx import etcd
from inferx.devstack import LocalStack
from inferx.openai_compat.toolcalls import DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP
from inferx.tinymodel import make_tiny_model
from inferx_router.http_front import WORKER_HEADER
from tests.conftest import running_sim_stack

pytestmark = pytest.mark.integration

MODEL = "qwen-7b"  # examples/models.yaml: served by the sim workers' pool
PROGRAM_HEADER = "X-InferX-Program"


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# Later steps first: an agent loop's prompt still holds what earlier steps matched.
SCRIPT = [
    # The agent loop (Agents SDK): order -> tracking number -> parcel -> answer.
    {
        "when": "<tool_response>\nParcel TRK-42 is out for delivery",
        "reply": "Order 7 is out for delivery and arrives today.",
    },
    {
        "when": "<tool_response>\nOrder 7 was shipped with tracking number TRK-42",
        "reply": call("track_parcel", tracking_number="TRK-42"),
    },
    {"when": "Where is order 7?", "reply": "Let me look that up.\n" + call("lookup_order", order_id="7")},
    # The plain SDK's calls: two tool calls in one reply.
    {
        "when": "Compare orders 8 and 9",
        "reply": call("lookup_order", order_id="8") + call("lookup_order", order_id="9"),
    },
    # Other formats, for the models mapped to them (MAPPED below): Mistral's, Llama 3's.
    {
        "when": "Mistral: where are orders 3 and 4?",
        "reply": 'Checking.[TOOL_CALLS]lookup_order[ARGS]{"order_id": "3"}'
        '[TOOL_CALLS]lookup_order[ARGS]{"order_id": "4"}',
    },
    {
        "when": "Llama: where is order 5?",
        "reply": '<|python_tag|>{"name": "lookup_order", "parameters": {"order_id": "5"}}',
    },
    {"when": "Pythonic: where is order 6?", "reply": '[lookup_order(order_id="6")]'},
    {
        "when": "DeepSeek: where is order 6?",
        "reply": f"Checking.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}lookup_order\n```json\n"
        f'{{"order_id": "6"}}\n```{DS_CALL_END}{DS_CALLS_END}',
    },
    {
        "when": "Granite: where is order 6?",
        "reply": 'Checking.<|tool_call|>[{"name": "lookup_order", "arguments": {"order_id": "6"}}]',
    },
    {"when": "Just say hello", "reply": "Hello!"},
]

# Models served by the same workers (pool tiny-llama, whose template is Hermes's) whose
# mappings say how their replies are read: the mapping wins over the workers' format.
MAPPED = {
    "mistral-7b": {"pool": "tiny-llama", "tool_call_format": "mistral"},
    "llama-8b": {"pool": "tiny-llama", "tool_call_format": "llama3_json"},
    "llama-3b": {"pool": "tiny-llama", "tool_call_format": "pythonic"},
    "deepseek-v3": {"pool": "tiny-llama", "tool_call_format": "deepseek_v3"},
    "granite-8b": {"pool": "tiny-llama", "tool_call_format": "granite"},
}

TOOL_SPEC: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "lookup_order",
        "description": "Look an order up by its number",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string"}},
            "required": ["order_id"],
        },
    },
}


@pytest.fixture(scope="module")
def agent_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    root = tmp_path_factory.mktemp("agent-stack")
    model_dir = make_tiny_model(root / "tiny-llama")
    script = root / "script.yaml"
    script.write_text(yaml.safe_dump(SCRIPT, sort_keys=False))
    args = ["--model-path", str(model_dir), "--sim-script", str(script)]
    with running_sim_stack(root / "stack", workers=2, sim_speed=20, worker_args=args) as stack:
        stack.load_models(MAPPED)
        wait_for_models(stack, set(MAPPED))
        yield stack


def wait_for_models(stack: LocalStack, names: set[str]) -> None:
    """Until the router's mirror of the model mappings has `names`."""
    deadline = time.monotonic() + 10
    while not names <= {m.id for m in sdk(stack).models.list()}:
        assert time.monotonic() < deadline, "the router did not see the model mappings"
        time.sleep(0.05)


class Recorder:
    """Every call's program header, worker and usage, seen from the client's HTTP."""

    def __init__(self) -> None:
        self.programs: list[str | None] = []
        self.workers: list[str] = []
        self.cached: list[int] = []

    async def on_response(self, response: httpx.Response) -> None:
        path = response.request.url.path
        if path.endswith(("/chat/completions", "/responses")):
            self.programs.append(response.request.headers.get(PROGRAM_HEADER))
            self.workers.append(response.headers.get(WORKER_HEADER, ""))
        if path.endswith("/chat/completions"):
            await response.aread()
            usage = response.json().get("usage") or {}
            self.cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        elif path.endswith("/responses") and not response.headers["content-type"].startswith(
            "text/event-stream"
        ):
            await response.aread()
            usage = response.json().get("usage") or {}
            self.cached.append((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)


@pytest.mark.parametrize("api", ["chat", "responses", "responses-streamed"])
async def test_an_agent_framework_runs_a_tool_calling_loop_as_one_program(
    agent_stack: LocalStack, api: str
) -> None:
    """The Agents SDK over chat completions, and over the Responses API (its default
    model class), whole and streamed."""
    set_tracing_disabled(True)  # the SDK would export traces to OpenAI
    called: list[tuple[str, str]] = []

    @function_tool
    def lookup_order(order_id: str) -> str:
        """Look an order up by its number."""
        called.append(("lookup_order", order_id))
        return f"Order {order_id} was shipped with tracking number TRK-42."

    @function_tool
    def track_parcel(tracking_number: str) -> str:
        """Find a parcel by its tracking number."""
        called.append(("track_parcel", tracking_number))
        return f"Parcel {tracking_number} is out for delivery."

    program = f"agent-{uuid.uuid4().hex[:8]}"
    recorder = Recorder()
    async with httpx.AsyncClient(event_hooks={"response": [recorder.on_response]}) as http:
        client = openai.AsyncOpenAI(
            base_url=agent_stack.router_http_url,
            api_key="unused",
            max_retries=0,
            http_client=http,  # type: ignore[arg-type]  # openai takes httpx clients too (typed as httpx2's)
            default_headers={PROGRAM_HEADER: program, "X-InferX-Tier": "realtime"},
        )
        agent = Agent(
            name="support",
            instructions="You are a support agent. Use the tools to answer.",
            tools=[lookup_order, track_parcel],
            model=(
                OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
                if api == "chat"
                else OpenAIResponsesModel(model=MODEL, openai_client=client)
            ),
            model_settings=ModelSettings(max_tokens=96),
        )
        run_config = RunConfig(tracing_disabled=True)
        if api == "responses-streamed":
            streamed = Runner.run_streamed(agent, "Where is order 7?", max_turns=6, run_config=run_config)
            usages = [
                event.data.response.usage
                async for event in streamed.stream_events()
                if event.type == "raw_response_event" and event.data.type == "response.completed"
            ]
            recorder.cached = [u.input_tokens_details.cached_tokens for u in usages if u is not None]
            final_output = streamed.final_output
        else:
            final_output = (
                await Runner.run(agent, "Where is order 7?", max_turns=6, run_config=run_config)
            ).final_output

    assert called == [("lookup_order", "7"), ("track_parcel", "TRK-42")]  # the scripted arguments
    assert final_output == "Order 7 is out for delivery and arrives today."
    assert recorder.programs == [program] * 3  # three model calls, one program
    if api != "responses-streamed":  # (a stream has no headers to name its worker by)
        assert len(set(recorder.workers)) == 1 and recorder.workers[0], recorder.workers
    assert len(recorder.cached) == 3, recorder.cached
    assert recorder.cached[0] < recorder.cached[1] < recorder.cached[2], recorder.cached


def sdk(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.router_http_url, api_key="unused", max_retries=0)


def test_the_openai_sdk_gets_tool_calls(agent_stack: LocalStack) -> None:
    reply = sdk(agent_stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Compare orders 8 and 9"}],
        tools=[TOOL_SPEC],
        max_tokens=96,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
        ("function", "lookup_order", {"order_id": "8"}),
        ("function", "lookup_order", {"order_id": "9"}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)

    # The same reply with tool_choice "none" (or no tools): the text, as the model wrote it.
    plain = sdk(agent_stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Compare orders 8 and 9"}],
        tools=[TOOL_SPEC],
        tool_choice="none",
        max_tokens=96,
    )
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls
    assert plain.choices[0].message.content == SCRIPT[3]["reply"]


async def test_the_openai_sdk_gets_tool_calls_streamed(agent_stack: LocalStack) -> None:
    async with openai.AsyncOpenAI(
        base_url=agent_stack.router_http_url, api_key="unused", max_retries=0
    ) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Where is order 7?"}],
            tools=[TOOL_SPEC],
            max_tokens=96,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me look that up."
    pieces = [tc for d in deltas for tc in d.tool_calls or []]
    assert pieces[0].id and pieces[0].type == "function" and pieces[0].function.name == "lookup_order"  # type: ignore[union-attr]
    arguments = "".join(tc.function.arguments or "" for tc in pieces if tc.function)
    assert json.loads(arguments) == {"order_id": "7"} and {tc.index for tc in pieces} == {0}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_the_stream_helper_of_the_sdk_assembles_the_calls(agent_stack: LocalStack) -> None:
    with sdk(agent_stack).chat.completions.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "Compare orders 8 and 9"}],
        tools=[TOOL_SPEC],
        max_tokens=96,
    ) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    assert [json.loads(c.function.arguments) for c in calls] == [{"order_id": "8"}, {"order_id": "9"}]
    assert final.choices[0].finish_reason == "tool_calls"


def test_the_script_is_matched_against_the_templates_rendering(tmp_path: Path) -> None:
    """What the rules above rely on: the tool results reach the prompt inside the tiny
    template's <tool_response> (InferX's generic rendering has no such mark)."""
    from inferx.chat_template import Chat, ChatTemplate
    from inferx.openai_compat.render import chat_json, render_chat
    from inferx.openai_compat.schema import ChatMessage

    template = ChatTemplate.from_model_dir(make_tiny_model(tmp_path / "m"))
    assert template is not None
    history = [
        ChatMessage(role="user", content="Where is order 7?"),
        ChatMessage(
            role="tool", tool_call_id="c", content="Order 7 was shipped with tracking number TRK-42."
        ),
    ]
    chat = Chat.from_json(chat_json(history))
    assert str(SCRIPT[1]["when"]) in template.render(chat.messages)
    assert str(SCRIPT[1]["when"]) not in render_chat(history)


# ----- other formats, format selection, tool_choice --------------------------------------


async def registered_formats(stack: LocalStack) -> list[str]:
    async with stack.etcd_client() as client:
        listing = await client.get_prefix(etcd.WORKERS.encode())
    return [json.loads(kv.value).get("toolCallFormat", "") for kv in listing]


def test_workers_register_the_format_their_chat_template_asks_for(agent_stack: LocalStack) -> None:
    assert asyncio.run(registered_formats(agent_stack)) == ["hermes", "hermes"]  # the tiny template


def test_a_model_mapped_to_mistrals_format_gets_its_tool_calls(agent_stack: LocalStack) -> None:
    reply = sdk(agent_stack).chat.completions.create(
        model="mistral-7b",
        messages=[{"role": "user", "content": "Mistral: where are orders 3 and 4?"}],
        tools=[TOOL_SPEC],
        max_tokens=96,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
        ("lookup_order", {"order_id": "3"}),
        ("lookup_order", {"order_id": "4"}),
    ]
    # The Hermes model on the same workers reads the same reply as text.
    hermes = sdk(agent_stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Mistral: where are orders 3 and 4?"}],
        tools=[TOOL_SPEC],
        max_tokens=96,
    )
    assert not hermes.choices[0].message.tool_calls and "[TOOL_CALLS]" in str(
        hermes.choices[0].message.content
    )


def test_a_llama_model_streams_its_json_tool_call(agent_stack: LocalStack) -> None:
    with sdk(agent_stack).chat.completions.stream(
        model="llama-8b",
        messages=[{"role": "user", "content": "Llama: where is order 5?"}],
        tools=[TOOL_SPEC],
        tool_choice={"type": "function", "function": {"name": "lookup_order"}},
        max_tokens=96,
    ) as stream:
        final = stream.get_final_completion()
    (tool_call,) = final.choices[0].message.tool_calls or []
    assert tool_call.function.name == "lookup_order"
    assert json.loads(tool_call.function.arguments) == {"order_id": "5"}
    assert not final.choices[0].message.content


@pytest.mark.parametrize(
    ("model", "prompt", "content"),
    [
        ("llama-3b", "Pythonic: where is order 6?", None),
        ("deepseek-v3", "DeepSeek: where is order 6?", "Checking."),
        ("granite-8b", "Granite: where is order 6?", "Checking."),
    ],
)
def test_models_mapped_to_the_later_formats_get_their_tool_calls(
    agent_stack: LocalStack, model: str, prompt: str, content: str | None
) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
    client = sdk(agent_stack)
    reply = client.chat.completions.create(model=model, messages=messages, tools=[TOOL_SPEC], max_tokens=96)
    with client.chat.completions.stream(
        model=model, messages=messages, tools=[TOOL_SPEC], max_tokens=96
    ) as stream:
        streamed = stream.get_final_completion()
    for choice in (reply.choices[0], streamed.choices[0]):
        assert choice.finish_reason == "tool_calls" and (choice.message.content or None) == content
        (tool_call,) = choice.message.tool_calls or []
        assert tool_call.function.name == "lookup_order"  # type: ignore[union-attr]
        assert json.loads(tool_call.function.arguments) == {"order_id": "6"}  # type: ignore[union-attr]


def test_required_tool_choice_without_a_call_in_the_reply_is_an_error(agent_stack: LocalStack) -> None:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Just say hello"}],
        "tools": [TOOL_SPEC],
        "tool_choice": "required",
        "max_tokens": 32,
    }
    with pytest.raises(openai.InternalServerError) as raised:
        sdk(agent_stack).chat.completions.create(**request)  # type: ignore[call-overload]
    assert raised.value.status_code == 500
    assert raised.value.code == "tool_choice_not_followed" and "Hello!" in raised.value.message
    # Streamed: the reply is held until it ends, so nothing of it has been sent when it
    # fails: the stream never starts, and the call gets the same 500 as unstreamed.
    with httpx.stream(
        "POST",
        f"{agent_stack.router_http_url}/chat/completions",
        json={**request, "stream": True},
        timeout=30,
    ) as response:
        body = response.read()
    assert response.status_code == 500 and b"data:" not in body
    assert json.loads(body)["error"]["code"] == "tool_choice_not_followed"


def test_a_named_function_not_among_the_tools_is_a_400(agent_stack: LocalStack) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        sdk(agent_stack).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Where is order 7?"}],
            tools=[TOOL_SPEC],
            tool_choice={"type": "function", "function": {"name": "refund"}},
            max_tokens=32,
        )
    assert raised.value.param == "tool_choice" and "'refund' is not among" in raised.value.message


async def put_mapping(stack: LocalStack, model: str, value: dict) -> None:
    async with stack.etcd_client() as client:
        await client.put(etcd.model_key(model).encode(), json.dumps(value).encode())


def test_a_mapping_with_an_unknown_format_refuses_tool_calls_naming_it(agent_stack: LocalStack) -> None:
    # Written around inferx's checks (load_models refuses it), as a hand-edited etcd would.
    asyncio.run(put_mapping(agent_stack, "odd-model", {"pool": "tiny-llama", "tool_call_format": "xlam"}))
    wait_for_models(agent_stack, {"odd-model"})
    with pytest.raises(openai.BadRequestError) as raised:
        sdk(agent_stack).chat.completions.create(
            model="odd-model",
            messages=[{"role": "user", "content": "Where is order 7?"}],
            tools=[TOOL_SPEC],
            max_tokens=32,
        )
    assert "unknown tool-call format 'xlam'" in raised.value.message
    assert raised.value.code == "failed_precondition"
    plain = sdk(agent_stack).chat.completions.create(  # without tools it serves as ever
        model="odd-model", messages=[{"role": "user", "content": "Just say hello"}], max_tokens=32
    )
    assert plain.choices[0].message.content == "Hello!"
    with pytest.raises(ValueError, match="unknown tool-call format 'xlam'"):
        agent_stack.load_models({"odd-model": {"pool": "tiny-llama", "tool_call_format": "xlam"}})


# ----- the Responses API ------------------------------------------------------------------

RESPONSES_TOOL = {
    "type": "function",
    "name": "lookup_order",
    "description": "Look an order up by its number",
    "parameters": TOOL_SPEC["function"].get("parameters"),
}


def test_the_responses_api_gives_function_calls(agent_stack: LocalStack) -> None:
    reply = sdk(agent_stack).responses.create(
        model=MODEL,
        instructions="Answer with the tools.",
        input="Compare orders 8 and 9",
        tools=[RESPONSES_TOOL],  # type: ignore[list-item]
        max_output_tokens=96,
    )
    assert reply.status == "completed" and reply.id.startswith("resp_")
    calls = [item for item in reply.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("lookup_order", {"order_id": "8"}),
        ("lookup_order", {"order_id": "9"}),
    ]
    assert len({c.call_id for c in calls}) == 2 and not reply.output_text
    assert reply.usage is not None and reply.usage.output_tokens > 0


def test_the_responses_stream_helper_assembles_text_and_calls(agent_stack: LocalStack) -> None:
    with sdk(agent_stack).responses.stream(
        model=MODEL,
        input=[{"role": "user", "content": "Where is order 7?"}],
        tools=[RESPONSES_TOOL],  # type: ignore[list-item]
        max_output_tokens=96,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert final.output_text.strip() == "Let me look that up."
    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("lookup_order", {"order_id": "7"})]


def test_a_response_cut_by_max_output_tokens_is_incomplete(agent_stack: LocalStack) -> None:
    reply = sdk(agent_stack).responses.create(model=MODEL, input="Just say hello", max_output_tokens=1)
    assert reply.status == "incomplete"
    assert reply.incomplete_details is not None and reply.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"truncation": "auto"}, "truncation"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_a_responses_call_inferx_cannot_serve_is_a_400_naming_the_field(
    agent_stack: LocalStack, fields: dict, param: str
) -> None:
    body = {"model": MODEL, "input": "Just say hello", **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(agent_stack).responses.create(**body)
    assert caught.value.status_code == 400
    assert isinstance(caught.value.body, dict) and caught.value.body.get("param") == param, caught.value.body


def test_a_responses_call_to_an_unknown_model_is_a_404(agent_stack: LocalStack) -> None:
    with pytest.raises(openai.NotFoundError):
        sdk(agent_stack).responses.create(model="no-such-model", input="Just say hello")


def test_a_stored_response_asked_for_is_a_404_that_says_none_are_kept(agent_stack: LocalStack) -> None:
    client = sdk(agent_stack)
    for ask in (
        lambda: client.responses.retrieve("resp_1"),
        lambda: client.responses.delete("resp_1"),
        lambda: client.responses.cancel("resp_1"),
        lambda: client.responses.input_items.list("resp_1"),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            ask()
        assert "keeps no responses" in caught.value.message and "resp_1" in caught.value.message


# ----- Anthropic's Messages API -------------------------------------------------------------

ANTHROPIC_TOOL = {
    "name": "lookup_order",
    "description": "Look an order up by its number",
    "input_schema": TOOL_SPEC["function"].get("parameters"),
}


def claude(stack: LocalStack, **headers: str) -> anthropic.Anthropic:
    base = stack.router_http_url.removesuffix("/v1")  # the SDK adds /v1/messages
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, default_headers=headers)


def test_an_anthropic_sdk_loop_runs_as_one_program_with_a_growing_cache(agent_stack: LocalStack) -> None:
    """A hand-written Claude-style loop (tool_use -> tool_result -> ...) through the
    `anthropic` SDK: the scripted tool calls come back as tool_use blocks, the calls are
    one program on one worker, and each call reads more of its prompt from the cache."""
    client = claude(agent_stack, **{PROGRAM_HEADER: f"claude-{uuid.uuid4().hex[:8]}"})
    system: list[Any] = [
        {"type": "text", "text": "x-anthropic-billing-header: cch=1234;"},
        {"type": "text", "text": "Help."},
    ]
    messages: list[Any] = [{"role": "user", "content": "Where is order 7?"}]
    results = {
        "lookup_order": "Order 7 was shipped with tracking number TRK-42.",
        "track_parcel": "Parcel TRK-42 is out for delivery.",
    }
    tools: list[Any] = [ANTHROPIC_TOOL, {**ANTHROPIC_TOOL, "name": "track_parcel"}]
    replies, workers = [], []
    for _ in range(3):
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=96, system=system, messages=messages, tools=tools
        )
        reply = raw.parse()
        replies.append(reply)
        workers.append(raw.headers.get(WORKER_HEADER))
        uses = [block for block in reply.content if block.type == "tool_use"]
        if not uses:
            break
        messages.append({"role": "assistant", "content": [block.model_dump() for block in reply.content]})
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": results[use.name]}
                    for use in uses
                ],
            }
        )
    assert [r.stop_reason for r in replies] == ["tool_use", "tool_use", "end_turn"]
    first_use = next(block for block in replies[0].content if block.type == "tool_use")
    assert (first_use.name, first_use.input) == ("lookup_order", {"order_id": "7"})
    assert (
        replies[0].content[0].type == "text" and replies[0].content[0].text.strip() == "Let me look that up."
    )
    assert replies[-1].content[0].type == "text"
    assert replies[-1].content[0].text == "Order 7 is out for delivery and arrives today."
    assert len(set(workers)) == 1 and workers[0], workers
    cached = [r.usage.cache_read_input_tokens or 0 for r in replies]
    assert cached[0] < cached[1] < cached[2], cached


def test_the_anthropic_stream_helper_assembles_text_and_tool_use(agent_stack: LocalStack) -> None:
    with claude(agent_stack).messages.stream(
        model=MODEL,
        max_tokens=96,
        messages=[{"role": "user", "content": "Where is order 7?"}],
        tools=[ANTHROPIC_TOOL],  # type: ignore[list-item]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"order_id": "7"}  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens > 0


def test_an_anthropic_reply_cut_at_max_tokens_says_so(agent_stack: LocalStack) -> None:
    reply = claude(agent_stack).messages.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Just say hello"}]
    )
    assert reply.stop_reason == "max_tokens"


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"top_k": 5}, "top_k"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ],
)
def test_an_anthropic_call_inferx_cannot_serve_is_a_400_in_anthropics_shape(
    agent_stack: LocalStack, fields: dict, error: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude(agent_stack).messages.create(  # the fields over the body (the SDK would refuse some)
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}], extra_body=fields
        )
    assert isinstance(caught.value.body, dict) and caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert caught.value.body["error"]["message"].startswith(f"{error}: "), caught.value.body


def test_an_anthropic_call_to_an_unknown_model_is_a_404(agent_stack: LocalStack) -> None:
    with pytest.raises(anthropic.NotFoundError):
        claude(agent_stack).messages.create(
            model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )


def test_count_tokens_is_a_404_in_anthropics_shape(agent_stack: LocalStack) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude(agent_stack).messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert isinstance(caught.value.body, dict) and caught.value.body["error"]["type"] == "not_found_error"
