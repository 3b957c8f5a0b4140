"""The Responses API read as a chat call, and its replies in OpenAI's shapes (checked
against the `openai` SDK's own types)."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from inferx.openai_compat.errors import InvalidField
from inferx.openai_compat.reasoning import Reasoning
from inferx.openai_compat.responses import ResponsesRequest, ResponseWriter, response_usage
from inferx.openai_compat.schema import ReplyReader, validate_body
from inferx.openai_compat.toolcalls import Content, ToolCall

EVENT = TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "lookup", "parameters": {"type": "object"}, "strict": True}


def ask(**fields: Any) -> ResponsesRequest:
    return validate_body(ResponsesRequest, {"model": "m", "input": "hi", **fields})


def chat(**fields: Any) -> dict[str, Any]:
    return ask(**fields).chat_request().model_dump(exclude_none=True)


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    body = chat(instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9)
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (7, 0.5, 0.9)


def test_an_agent_loops_items_become_the_chat_it_would_have_sent() -> None:
    """A model's function calls join its assistant turn (as chat templates render them);
    their outputs are tool messages; earlier reasoning is left out."""
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user", "content": "Where is order 7?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
        },
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "lookup",
            "arguments": '{"id": "7"}',
            "id": "fc_1",
        },
        {"type": "function_call", "call_id": "c2", "name": "lookup", "arguments": '{"id": "8"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "shipped"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "late"}]},
    ]
    messages = chat(input=items, tools=[TOOL])["messages"]
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool", "tool"]
    assert messages[2]["content"] == "Looking."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"id": "7"}'}
    assert messages[4] == {"role": "tool", "tool_call_id": "c2", "content": "late"}


def test_a_function_call_without_a_text_turn_is_an_assistant_turn_of_its_own() -> None:
    items = [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
    ]
    assert chat(input=items, tools=[TOOL])["messages"][1]["role"] == "assistant"


def test_tools_choices_and_formats_are_the_chat_ones() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = chat(
        tools=[TOOL],
        tool_choice={"type": "function", "name": "lookup"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
    )
    assert body["tools"] == [
        {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}, "strict": True}}
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema, "strict": True},
    }
    free = ask(text={"format": {"type": "text"}, "verbosity": "low"}).chat_request()
    assert free.structured_output is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"include": ["reasoning.encrypted_content", "everything"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream": 1}, "stream"),
        ({"temperature": True}, "temperature"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "user", "content": {"text": "x"}}]}, "input[0].content"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
        ({"input": [{"type": "computer_call_output"}]}, "input[0].type"),
        ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tool_choice": "sometimes", "tools": [TOOL]}, "tool_choice"),
        ({"tool_choice": {"type": "function", "name": "other"}, "tools": [TOOL]}, "tool_choice"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidField) as caught:
        ask(**fields).chat_request()
    assert caught.value.param == param, caught.value.message


def test_accepted_fields_that_change_nothing() -> None:
    body = chat(
        store=True,
        metadata={"k": "v"},
        user="u",
        reasoning={"effort": "low"},
        truncation="disabled",
        include=["reasoning.encrypted_content", "file_search_call.results"],
        stream_options={"include_obfuscation": False},
    )
    assert body["messages"] == [{"role": "user", "content": "hi"}]


def writer(**fields: Any) -> ResponseWriter:
    return ResponseWriter("resp_1", 1700000000, ask(**fields))


USAGE = response_usage(10, 4, 6)


def test_a_streamed_reply_is_openais_event_sequence() -> None:
    out = writer(tools=[TOOL])
    call = ToolCall(index=0, id="call_1", name="lookup", arguments='{"id": "7"}')
    events = [
        *out.start(),
        *out.events([Reasoning("Let me think."), Content("Look"), Content("ing.")]),
        *out.events([call]),
        *out.end("stop", USAGE),
    ]
    for event in events:
        EVENT.validate_python(event)  # every event is one of the SDK's types
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # the reasoning item
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the function call
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = Response.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Looking." and final.status == "completed"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens == 6


def test_a_whole_reply_is_the_streams_final_object() -> None:
    reader = ReplyReader(parse_tool_calls=True)
    reader.feed('Sure.<tool_call>\n{"name": "lookup", "arguments": {"id": "7"}}\n</tool_call>')
    reader.finish()
    body = writer(tools=[TOOL], max_output_tokens=50, metadata={"k": "v"}).whole(reader, "stop", USAGE)
    reply = Response.model_validate(body)
    assert reply.status == "completed" and reply.output_text == "Sure."
    call = reply.output[1]
    assert call.type == "function_call" and call.name == "lookup" and call.arguments == '{"id": "7"}'
    assert (reply.max_output_tokens, reply.metadata, body["store"]) == (50, {"k": "v"}, False)


def test_a_reply_cut_at_max_output_tokens_is_incomplete() -> None:
    reader = ReplyReader()
    reader.feed("Hel")
    reply = Response.model_validate(writer().whole(reader, "length", USAGE))
    assert reply.status == "incomplete"
    assert reply.incomplete_details is not None and reply.incomplete_details.reason == "max_output_tokens"


def test_a_failure_after_the_stream_started_is_an_error_event() -> None:
    out = writer()
    out.start()
    (event,) = out.failed(
        {"error": {"message": "worker lost", "type": "server_error", "param": None, "code": "unavailable"}}
    )
    parsed = EVENT.validate_python(event)
    assert parsed.type == "error" and parsed.message == "worker lost" and parsed.sequence_number == 2


def test_a_limit_on_the_output_names_max_output_tokens() -> None:
    assert ask(max_output_tokens=9).chat_request().output_tokens_param() == "max_output_tokens"
