"""Tool calls read out of a model's text (inferx.openai_compat.toolcalls) and sent in
OpenAI's shapes, whole and streamed: well-formed Hermes/Qwen blocks become tool calls,
anything else stays content, never an error; a stream, however the text is cut, says
what the whole reply says. The bodies are checked against the `openai` SDK's types.
The other formats (Llama 3 JSON, Mistral) and tool_choice: test_tool_call_formats.py."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from inferx.openai_compat import schema
from inferx.openai_compat.toolcalls import ToolCall, parse_block, parser_for, split_tool_calls


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def block(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_a_reply_of_tool_calls_has_no_content() -> None:
    text = block("lookup_order", {"order_id": "7"}) + "\n" + block("track", {"id": "TRK-42", "n": 2})
    content, calls = split_tool_calls(text, ids())
    assert content is None
    assert calls == [
        ToolCall(0, "call_0", "lookup_order", '{"order_id": "7"}'),
        ToolCall(1, "call_1", "track", '{"id": "TRK-42", "n": 2}'),
    ]
    assert calls[0].as_openai() == {
        "id": "call_0",
        "type": "function",
        "function": {"name": "lookup_order", "arguments": '{"order_id": "7"}'},
    }


def test_text_around_calls_is_the_content_without_the_whitespace_beside_them() -> None:
    content, calls = split_tool_calls("Let me look.\n\n" + block("f", {}) + "\n", ids())
    assert content == "Let me look." and [c.name for c in calls] == ["f"]
    content, _ = split_tool_calls("A\n" + block("f", {}) + "\nB  ", ids())
    assert content == "A\nB  "  # whitespace after a call and before more text stays


@pytest.mark.parametrize(
    "inner",
    [
        "not json",
        '{"name": "f", "arguments": {"a": 1}',  # cut short
        '["f", {}]',
        '{"arguments": {}}',
        '{"name": "", "arguments": {}}',
        '{"name": 3, "arguments": {}}',
        '{"name": "f", "arguments": [1, 2]}',
        '{"name": "f", "arguments": "not json"}',
        '{"name": "f", "arguments": "[1]"}',
        '{"name": "f", "arguments": {"x": NaN}}',
        "[" * 100_000,  # deeper than json's recursion limit
    ],
)
def test_a_malformed_block_stays_in_the_content_as_written(inner: str) -> None:
    text = f"Before <tool_call>{inner}</tool_call> after"
    assert parse_block(inner) is None
    assert split_tool_calls(text, ids()) == (text, [])


def test_arguments_may_be_a_json_string_or_parameters_or_absent() -> None:
    assert parse_block('{"name": "f", "arguments": "{\\"a\\": 1}"}') == ("f", '{"a": 1}')
    assert parse_block('{"name": "f", "parameters": {"a": "é"}}') == ("f", '{"a": "é"}')
    assert parse_block('{"name": "f"}') == ("f", "{}")


def test_a_block_the_text_ends_in_counts_when_it_is_whole_json() -> None:
    assert split_tool_calls('<tool_call>{"name": "f", "arguments": {}}', ids())[1][0].name == "f"
    cut = 'Hi <tool_call>{"name": "f", "argu'
    assert split_tool_calls(cut, ids()) == (cut, [])


def test_text_without_tags_comes_back_unchanged() -> None:
    for text in ["", "plain", "  spaced \n", "a < b and <tool> or <tool_call"]:
        assert split_tool_calls(text, ids()) == (text, [])


# ----- properties -------------------------------------------------------------------

# Text rich in the pieces that matter: tags (whole and partial), JSON, whitespace.
_pieces = st.sampled_from(
    ["<tool_call>", "</tool_call>", "<tool", "_call>", "</", "<", ">", "{", "}", '"', ":", ","]
    + ["\n", " ", "\t"]
    + ['"name"', '"arguments"', '"f"', "{}", '{"a": 1}', "null", "x", "é", "😀"]
    + [block("g", {"k": "v"}), '{"name": "h", "arguments": {}}']
)
_garbage = st.lists(st.one_of(_pieces, st.text(max_size=6)), max_size=30).map("".join)


def stream(text: str, cuts: list[int], format_: str = "hermes") -> tuple[str, list[ToolCall]]:
    """Content joined and calls, feeding `text` in pieces cut at `cuts`."""
    parser = parser_for(format_, ids())
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    events = []
    for start, end in itertools.pairwise(bounds):
        events += parser.feed(text[start:end])
    events += parser.finish()
    content = "".join(e.text for e in events if not isinstance(e, ToolCall))
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert calls == parser.calls
    return content, calls


@settings(max_examples=400, deadline=None)
@given(text=_garbage, cuts=st.lists(st.integers(min_value=0, max_value=500), max_size=12))
def test_any_text_cut_anyhow_streams_what_the_whole_reply_says(text: str, cuts: list[int]) -> None:
    assert_streamed_as_whole(text, cuts, "hermes")


def assert_streamed_as_whole(text: str, cuts: list[int], format_: str) -> None:
    """`text` fed in pieces cut at `cuts` reads as the whole text does; what is not a
    well-formed call stays content, every character of it."""
    whole_content, whole_calls = split_tool_calls(text, ids(), format_)
    content, calls = stream(text, cuts, format_)
    assert calls == whole_calls
    assert content == (whole_content or "")
    if not calls:
        assert content == text  # nothing read as a call: every character is content
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict) and call.name.strip()


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    prose=st.text(alphabet=st.characters(blacklist_characters="<"), max_size=40),
    calls=st.lists(
        st.tuples(
            st.text(min_size=1, max_size=10).filter(str.strip),
            st.dictionaries(st.text(max_size=6), _json_values, max_size=3),
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_well_formed_calls_come_back_with_their_names_and_arguments(
    prose: str, calls: list[tuple[str, dict]]
) -> None:
    text = prose + "\n".join(block(name, args) for name, args in calls)
    content, parsed = split_tool_calls(text, ids())
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    assert [c.index for c in parsed] == list(range(len(calls)))
    assert content == (prose.rstrip() or None)


# ----- OpenAI's shapes ----------------------------------------------------------------


def test_a_chat_completion_with_tool_calls_is_what_the_sdk_parses() -> None:
    text = "Checking.\n" + block("lookup_order", {"order_id": "7"})
    usage = schema.usage(10, 5, 0)
    body = schema.chat_completion(
        "chatcmpl-1", 0, "m", text, "stop", usage, parse_tool_calls=True, new_id=ids()
    )
    reply = ChatCompletion.model_validate(body)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert (call.id, call.type, call.function.name) == ("call_0", "function", "lookup_order")  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"order_id": "7"}  # type: ignore[union-attr]

    plain = schema.chat_completion("chatcmpl-2", 0, "m", text, "stop", usage)  # the call offered no tools
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert plain["choices"][0]["finish_reason"] == "stop"


def stream_chunks(
    text: str, pieces: int, parse: bool = True, format_: str = "hermes", tool_choice: object = None
) -> list[dict]:
    chunks = schema.ChatChunks(
        "chatcmpl-1",
        0,
        "m",
        parse_tool_calls=parse,
        tool_format=format_,
        tool_choice=tool_choice,  # type: ignore[arg-type]
        new_id=ids(),
    )
    size = max(1, len(text) // pieces)
    out = [chunks.start()]
    for start in range(0, len(text), size):
        out += chunks.text(text[start : start + size])
    return out + chunks.finish("stop")


def test_a_streamed_reply_sends_each_tool_call_as_openai_does() -> None:
    text = "On it.\n" + block("lookup_order", {"order_id": "7"}) + "\n" + block("track", {"id": "T"})
    chunks = [ChatCompletionChunk.model_validate(c) for c in stream_chunks(text, pieces=9)]
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == "On it."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    # Per call: index, id, type and name with empty arguments first; then the arguments.
    assert [(tc.index, tc.id, tc.type) for tc in calls] == [
        (0, "call_0", "function"),
        (0, None, None),
        (1, "call_1", "function"),
        (1, None, None),
    ]
    assert [tc.function.name for tc in calls if tc.function and tc.function.name] == ["lookup_order", "track"]
    arguments = [tc.function.arguments for tc in calls if tc.function]
    assert arguments == ["", '{"order_id": "7"}', "", '{"id": "T"}']
    assert [c.choices[0].finish_reason for c in chunks].count("tool_calls") == 1
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_gives_the_first_call_only_streamed_or_not() -> None:
    """As vLLM's server: the calls past the first are dropped (OpenAI's default, true, keeps all)."""
    text = "On it.\n" + block("lookup_order", {"order_id": "7"}) + "\n" + block("track", {"id": "T"})
    tools = [{"type": "function", "function": {"name": name}} for name in ("lookup_order", "track")]
    body = schema.validate_body(
        schema.ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": tools,
            "parallel_tool_calls": False,
        },
    )
    whole = schema.reply_reader(body)
    whole.feed(text)
    whole.finish()
    assert [call.name for call in whole.calls] == ["lookup_order"] and whole.called
    streamed = schema.ChatChunks("chatcmpl-1", 0, "m", reader=schema.reply_reader(body))
    chunks = [*streamed.text(text[:20]), *streamed.text(text[20:]), *streamed.finish("stop")]
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert {tc["index"] for tc in calls} == {0} and calls[0]["function"]["name"] == "lookup_order"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    both = schema.reply_reader(body.model_copy(update={"parallel_tool_calls": None}))
    both.feed(text)
    both.finish()
    assert [call.name for call in both.calls] == ["lookup_order", "track"]


def test_a_streamed_reply_without_tools_offered_is_plain_content() -> None:
    text = block("f", {})
    chunks = stream_chunks(text, pieces=3, parse=False)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@settings(max_examples=100, deadline=None)
@given(text=_garbage, pieces=st.integers(min_value=1, max_value=20))
def test_streamed_garbage_gives_valid_chunks_that_add_up_to_the_whole_reply(text: str, pieces: int) -> None:
    chunks = [ChatCompletionChunk.model_validate(c) for c in stream_chunks(text, pieces)]
    whole = ChatCompletion.model_validate(
        schema.chat_completion(
            "c", 0, "m", text, "stop", schema.usage(1, 1, 0), parse_tool_calls=True, new_id=ids()
        )
    ).choices[0]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == (whole.message.content or "")
    named = [tc for d in deltas for tc in d.tool_calls or [] if tc.id]
    assert [tc.id for tc in named] == [tc.id for tc in whole.message.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
