"""Anthropic's Messages API read as a chat call, and its replies in Anthropic's shapes
(checked against the `anthropic` SDK's own types)."""

from __future__ import annotations

from typing import Any

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from inferx.errors import DeadlineExceeded, Unavailable
from inferx.openai_compat.anthropic import MessagesRequest, MessageWriter, error_reply, message_usage
from inferx.openai_compat.errors import InvalidField
from inferx.openai_compat.errors import error_reply as openai_error_reply
from inferx.openai_compat.reasoning import Reasoning
from inferx.openai_compat.schema import ReplyReader, validate_body
from inferx.openai_compat.toolcalls import Content, ToolCall

EVENT = TypeAdapter(RawMessageStreamEvent)
TOOL = {"name": "lookup", "description": "Find it", "input_schema": {"type": "object"}, "cache_control": {}}


def ask(**fields: Any) -> MessagesRequest:
    return validate_body(
        MessagesRequest,
        {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}], **fields},
    )


def chat(**fields: Any) -> dict[str, Any]:
    return ask(**fields).chat_request().model_dump(exclude_none=True)


def test_the_system_blocks_are_the_system_message_without_claude_codes_billing_header() -> None:
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=8f3a;"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": " Be brief."},
    ]
    body = chat(system=system, temperature=0.2, top_p=0.5, stop_sequences=["END"])
    assert body["messages"][0] == {"role": "system", "content": "You are Claude Code. Be brief."}
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["stop"]) == (9, 0.2, 0.5, ["END"])


def test_a_loops_blocks_become_the_chat_it_would_have_sent() -> None:
    """tool_use blocks are the assistant turn's calls, tool_result blocks tool messages
    ahead of the user turn's text, thinking left out."""
    messages = [
        {"role": "user", "content": "Where is order 7?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should look.", "signature": ""},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"id": "7"}},
                {"type": "tool_use", "id": "toolu_2", "name": "lookup", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "shipped"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "late"}],
                },
                {"type": "text", "text": "And order 8?"},
            ],
        },
    ]
    out = chat(messages=messages, tools=[TOOL])["messages"]
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "tool", "user"]
    assert out[1]["content"] == "Looking."
    assert [c["id"] for c in out[1]["tool_calls"]] == ["toolu_1", "toolu_2"]
    assert out[1]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"id": "7"}'}
    assert out[3] == {"role": "tool", "tool_call_id": "toolu_2", "content": "late"}
    assert out[4] == {"role": "user", "content": "And order 8?"}


def test_tools_and_choices_are_the_chat_ones() -> None:
    body = chat(
        tools=[TOOL], tool_choice={"type": "tool", "name": "lookup", "disable_parallel_tool_use": True}
    )
    assert body["tools"] == [
        {
            "type": "function",
            "function": {"name": "lookup", "description": "Find it", "parameters": {"type": "object"}},
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    assert body["parallel_tool_calls"] is False
    assert chat(tools=[TOOL], tool_choice={"type": "any"})["tool_choice"] == "required"
    assert chat(tools=[TOOL], tool_choice={"type": "none"})["tool_choice"] == "none"
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = chat(output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"})
    assert fmt["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


def test_accepted_fields_that_change_nothing() -> None:
    body = chat(
        metadata={"user_id": "u"}, thinking={"type": "enabled", "budget_tokens": 2048}, service_tier="auto"
    )
    assert body["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_k": 3}, "top_k"),
        ({"stream": "yes"}, "stream"),
        ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
        ({"container": "c"}, "container"),
        ({"messages": []}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]},
            "messages[0].content[0].id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}],
                    }
                ]
            },
            "messages[0].content[0].input",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [{"type": "search_result"}],
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0].content[0].type",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
        ({"system": [{"type": "image"}]}, "system[0].type"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tools": [{"input_schema": {}}]}, "tools[0].name"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),  # (no tools: nothing to choose)
        ({"tool_choice": {"type": ["auto"]}}, "tool_choice.type"),  # (was a 500: unhashable)
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidField) as caught:
        ask(**fields).chat_request()
    assert caught.value.param == param, caught.value.message


USAGE = message_usage(10, 4, 6)


def test_usage_counts_the_cached_prompt_apart() -> None:
    assert USAGE == {
        "input_tokens": 4,
        "output_tokens": 4,
        "cache_read_input_tokens": 6,
        "cache_creation_input_tokens": 0,
    }


def test_a_streamed_reply_is_anthropics_event_sequence() -> None:
    out = MessageWriter("msg_1", "m")
    call = ToolCall(index=0, id="call_1", name="lookup", arguments='{"id": "7"}')
    events = [
        *out.start(),
        *out.events([Reasoning("Let me think."), Content("Look"), Content("ing.")]),
        *out.events([call]),
        *out.end("stop", USAGE),
    ]
    for event in events:
        EVENT.validate_python(event)  # every event is one of the SDK's types
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start",  # thinking
        "content_block_delta",
        "content_block_stop",
        "content_block_start",  # text
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",  # tool_use
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_a_whole_reply_is_a_message() -> None:
    reader = ReplyReader(parse_tool_calls=True)
    reader.feed('Sure.<tool_call>\n{"name": "lookup", "arguments": {"id": "7"}}\n</tool_call>')
    reader.finish()
    message = Message.model_validate(MessageWriter("msg_1", "m").whole(reader, "stop", USAGE))
    assert message.stop_reason == "tool_use" and message.content[0].type == "text"
    assert message.content[1].type == "tool_use" and message.content[1].input == {"id": "7"}
    assert message.usage.cache_read_input_tokens == 6


@pytest.mark.parametrize(
    ("reason", "called", "expected"), [("length", True, "max_tokens"), ("stop", False, "end_turn")]
)
def test_stop_reasons(reason: str, called: bool, expected: str) -> None:
    reader = ReplyReader()
    reader.feed("Hi")
    assert MessageWriter("msg_1", "m").whole(reader, reason, USAGE)["stop_reason"] == expected


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (InvalidField("max_tokens", "bad"), 400, "invalid_request_error"),
        (Unavailable("no worker"), 503, "overloaded_error"),
        (DeadlineExceeded("late"), 504, "timeout_error"),
        (RuntimeError("bug"), 500, "api_error"),
    ],
)
def test_errors_in_anthropics_shape_keep_their_status(error: Exception, status: int, kind: str) -> None:
    reply = error_reply(openai_error_reply(error))
    assert reply.status == status
    assert (
        reply.body["type"] == "error"
        and reply.body["error"]["type"] == kind
        and reply.body["error"]["message"]
    )


def test_a_tool_results_image_is_a_line_saying_it_was_left_out() -> None:
    """Claude Code's Read of a picture: the session goes on (the block stays in every
    later call), the model told the image is not shown."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "text", "text": "a.png:"}, image],
    }
    out = chat(messages=[{"role": "user", "content": [result]}])["messages"]
    assert out == [
        {
            "role": "tool",
            "tool_call_id": "t1",
            "content": "a.png:\n[image left out: this model reads text only]",
        }
    ]


def test_an_assistant_turn_that_only_thought_stays_a_turn() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""}]},
        {"role": "user", "content": "well?"},
    ]
    assert [m["role"] for m in chat(messages=messages)["messages"]] == ["user", "assistant", "user"]


def test_a_limit_on_the_output_names_max_tokens() -> None:
    assert ask().chat_request().output_tokens_param() == "max_tokens"
