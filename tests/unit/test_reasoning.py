"""A reasoning model's thinking read apart (inferx.openai_compat.reasoning), as vLLM's
deepseek_r1 and qwen3 reasoning parsers do: whole and streamed in any pieces, before
tool calls are read (a call the model only thinks about is not made), in OpenAI's
`reasoning_content` on both chat shapes; where the parser comes from (a model mapping,
else the workers' registration); and the `openai` engine writing a server's
reasoning_content back so that the routers read it the same way."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferx.errors import FailedPrecondition
from inferx.openai_compat import schema
from inferx.openai_compat.errors import ToolChoiceNotFollowed
from inferx.openai_compat.reasoning import (
    DEEPSEEK_R1,
    QWEN3,
    Reasoning,
    ReasoningSplitter,
    check_reasoning_parser,
    split_reasoning,
)
from inferx.openai_compat.toolcalls import Content, ToolCall
from inferx.pools import PoolDirectory, model_entry
from inferx.v1 import common_pb2
from inferx_worker.config import WorkerSettings
from inferx_worker.engines.openai_engine import ChatDeltas, OpenAIEngine

CALL = '<tool_call>\n{"name": "track", "arguments": {"id": "T"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("parser", "text", "thought", "answer"),
    [
        (DEEPSEEK_R1, "plan it</think>The answer.", "plan it", "The answer."),
        (DEEPSEEK_R1, "<think>plan it</think>\n\nThe answer.", "plan it", "\n\nThe answer."),
        (DEEPSEEK_R1, "still thinking, cut off", "still thinking, cut off", ""),  # no </think>: all thought
        (DEEPSEEK_R1, "<think></think>The answer.", None, "The answer."),
        (QWEN3, "<think>plan it</think>The answer.", "plan it", "The answer."),
        (QWEN3, "  <think>plan it</think>The answer.", "plan it", "The answer."),
        (QWEN3, "The answer, no thinking.", None, "The answer, no thinking."),
        (QWEN3, "The answer mentions </think> later.", None, "The answer mentions </think> later."),
        (QWEN3, "<think>cut off", "cut off", ""),
        (QWEN3, "", None, ""),
    ],
)
def test_whole_replies_split_as_vllms_parsers_do(
    parser: str, text: str, thought: str | None, answer: str
) -> None:
    assert split_reasoning(text, parser) == (thought, answer)


@given(
    parser=st.sampled_from([DEEPSEEK_R1, QWEN3]),
    text=st.lists(
        st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n"]), max_size=30
    ).map("".join),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
)
def test_any_split_of_a_reply_reads_as_the_whole(parser: str, text: str, cuts: list[int]) -> None:
    splitter = ReasoningSplitter(parser)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces: list[Reasoning | str] = []
    start = 0
    for point in [*points, len(text)]:
        pieces += splitter.feed(text[start:point])
        start = point
    pieces += splitter.finish()
    thought = "".join(p.text for p in pieces if isinstance(p, Reasoning)) or None
    assert (thought, "".join(p for p in pieces if isinstance(p, str))) == split_reasoning(text, parser)


def test_streaming_gives_thinking_as_it_comes_holding_back_only_a_partial_tag() -> None:
    splitter = ReasoningSplitter(QWEN3)
    assert splitter.feed("<thi") == []  # may still be <think>
    assert splitter.feed("nk>first ") == [Reasoning("first ")]
    assert splitter.feed("second</th") == [Reasoning("second")]  # "</th" may end the thinking
    assert splitter.feed("ink>Answer") == ["Answer"]
    assert splitter.finish() == []


def test_unknown_parsers_are_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'.*deepseek_r1, qwen3"):
        check_reasoning_parser("r1")
    assert check_reasoning_parser("") == ""


# ----- read with tool calls, on both chat shapes -------------------------------------------


def _chat_body(**fields: object) -> schema.ChatCompletionRequest:
    data = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return schema.validate_body(schema.ChatCompletionRequest, data)


TOOLS = [{"type": "function", "function": {"name": "track", "parameters": {"type": "object"}}}]


def test_a_call_the_model_only_thinks_about_is_not_made() -> None:
    text = f"<think>I could write {CALL} but first...</think>Here: " + CALL
    reader = schema.reply_reader(_chat_body(tools=TOOLS), "hermes", QWEN3)
    events = reader.feed(text) + reader.finish()
    assert [type(e) for e in events] == [Reasoning, Content, ToolCall]
    assert reader.reasoning == f"I could write {CALL} but first..."
    assert reader.content == "Here:" and [c.name for c in reader.calls] == ["track"]
    reply = schema.chat_reply("id", 0, "m", reader, "stop", schema.usage(1, 1, 0))
    message = reply["choices"][0]["message"]
    assert (
        message["reasoning_content"] == reader.reasoning
        and message["tool_calls"][0]["function"]["name"] == "track"
    )
    assert reply["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_chunks_carry_reasoning_content_before_the_answer() -> None:
    chunks = schema.ChatChunks("id", 0, "m", reader=schema.reply_reader(_chat_body(), "hermes", DEEPSEEK_R1))
    out = [*chunks.text("weigh it"), *chunks.text(" up</think>Yes."), *chunks.finish("stop")]
    deltas = [c["choices"][0]["delta"] for c in out]
    assert deltas[:3] == [
        {"reasoning_content": "weigh it"},
        {"reasoning_content": " up"},
        {"content": "Yes."},
    ]
    assert out[-1]["choices"][0]["finish_reason"] == "stop"


def test_without_a_parser_or_on_text_completions_the_text_is_all_content() -> None:
    text = "<think>hm</think>Yes."
    plain = schema.reply_reader(_chat_body(), "hermes", "")
    assert [e for e in plain.feed(text) + plain.finish()] == [Content(text)] and plain.reasoning is None
    completion = schema.validate_body(schema.CompletionRequest, {"model": "m", "prompt": "p"})
    reader = schema.reply_reader(completion, "hermes", QWEN3)
    assert reader.feed(text) == [Content(text)]  # as vLLM: completions are the model's text
    no_thinking = schema.chat_reply("id", 0, "m", plain, "stop", schema.usage(1, 1, 0))
    assert "reasoning_content" not in no_thinking["choices"][0]["message"]


def test_a_held_reply_holds_its_thinking_too_and_fails_whole() -> None:
    """tool_choice "required": nothing of a reply that may break it is sent, thinking included."""
    reader = schema.reply_reader(_chat_body(tools=TOOLS, tool_choice="required"), "hermes", QWEN3)
    assert reader.feed("<think>no tool needed</think>") == [] and reader.feed("Just text.") == []
    with pytest.raises(ToolChoiceNotFollowed):
        reader.finish()
    kept = schema.reply_reader(_chat_body(tools=TOOLS, tool_choice="required"), "hermes", QWEN3)
    assert kept.feed("<think>use it</think>" + CALL) == []
    assert [type(e) for e in kept.finish()] == [Reasoning, ToolCall]


# ----- where a model's parser comes from ------------------------------------------------------


def _worker(worker_id: str, pool: str, parser: str) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(worker_id=worker_id, pool=pool, reasoning_parser=parser)


def test_a_mapping_beats_the_workers_which_beat_none() -> None:
    directory = PoolDirectory()
    directory.update_models(
        {
            "/inferx/v1/models/r1": b'{"pool": "a", "reasoning_parser": "deepseek_r1"}',
            "/inferx/v1/models/plain": b'{"pool": "b", "reasoning_parser": "none"}',
            "/inferx/v1/models/qwen": b'{"pool": "c"}',
        }
    )
    directory.workers_by_pool = {
        "a": {"w1": _worker("w1", "a", QWEN3)},
        "b": {"w2": _worker("w2", "b", QWEN3)},  # the mapping says the model does not reason
        "c": {"w3": _worker("w3", "c", QWEN3), "w4": _worker("w4", "c", "")},
    }
    assert directory.reasoning_parser("r1") == DEEPSEEK_R1
    assert directory.reasoning_parser("plain") == ""
    assert directory.reasoning_parser("qwen") == QWEN3
    assert directory.reasoning_parser("unmapped") == ""


def test_a_bad_parser_refuses_chats_naming_it_but_leaves_tool_formats_alone() -> None:
    directory = PoolDirectory()
    directory.update_models({"/inferx/v1/models/m": b'{"pool": "p", "reasoning_parser": "r1"}'})
    assert directory.pool_of("m") == "p" and directory.tool_call_format("m") == "hermes"
    with pytest.raises(FailedPrecondition, match="/inferx/v1/models/m: unknown reasoning parser 'r1'"):
        directory.reasoning_parser("m")
    directory.update_models({"/inferx/v1/models/m": b'{"pool": "p"}'})
    directory.workers_by_pool = {"p": {"w": _worker("w", "p", "future_parser")}}
    with pytest.raises(FailedPrecondition, match="registers reasoning parser 'future_parser'"):
        directory.reasoning_parser("m")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        model_entry({"pool": "p", "reasoning_parser": 3})
    # What load_models writes to etcd reads back the same ("none": the model does not reason).
    entry = model_entry({"pool": "p", "reasoning_parser": "none"})
    directory.update_models({"/inferx/v1/models/m": json.dumps(entry).encode()})
    assert directory.reasoning_parser("m") == ""


def test_the_worker_flag_is_checked() -> None:
    assert WorkerSettings(model="m", engine="sim").reasoning_parser == "auto"
    assert WorkerSettings(model="m", engine="sim", reasoning_parser=QWEN3).reasoning_parser == QWEN3
    with pytest.raises(ValueError, match="unknown reasoning parser 'think'"):
        WorkerSettings(model="m", engine="sim", reasoning_parser="think")


# ----- the openai engine writes a server's reasoning back ------------------------------------


def _delta(**delta: object) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


@pytest.mark.parametrize("parser", [QWEN3, DEEPSEEK_R1])
@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])  # vLLM's older and newer names
def test_server_reasoning_is_written_so_the_routers_parser_reads_it_apart(parser: str, field: str) -> None:
    deltas = ChatDeltas("hermes", reasoning_parser=parser)
    text = deltas.event(_delta(**{field: "step one, "})) + deltas.event(_delta(**{field: "step two"}))
    text += deltas.event(_delta(content="Done."))
    text += deltas.event(
        _delta(tool_calls=[{"index": 0, "id": "a", "function": {"name": "track", "arguments": "{}"}}])
    )
    text += deltas.finish()
    reader = schema.reply_reader(_chat_body(tools=TOOLS), "hermes", parser)
    reader.feed(text)
    reader.finish()
    assert reader.reasoning == "step one, step two" and reader.content == "Done."
    assert [c.name for c in reader.calls] == ["track"]


@pytest.mark.parametrize(
    ("parser", "written"), [(QWEN3, "Plain."), (DEEPSEEK_R1, "<think></think>Plain."), ("", "Plain.")]
)
def test_a_reply_without_thinking_reads_as_all_answer(parser: str, written: str) -> None:
    """deepseek_r1 reads a reply without </think> as all thinking: it gets an empty pair."""
    deltas = ChatDeltas("hermes", reasoning_parser=parser)
    text = deltas.event(_delta(content="Plain.")) + deltas.finish()
    assert text == written
    if parser:
        assert split_reasoning(text, parser) == (None, "Plain.")


def test_without_a_parser_the_servers_reasoning_is_dropped() -> None:
    deltas = ChatDeltas("hermes")
    text = deltas.event(_delta(reasoning_content="hidden")) + deltas.event(_delta(content="Shown."))
    assert text + deltas.finish() == "Shown."


def test_the_engine_registers_the_parser_its_writing_needs() -> None:
    assert OpenAIEngine("http://x", "m").writes_reasoning_parser() == QWEN3
    assert OpenAIEngine("http://x", "m", reasoning_parser="").writes_reasoning_parser() is None
    assert OpenAIEngine("http://x", "m", chat_endpoint=False).writes_reasoning_parser() is None
    assert (
        json.dumps(OpenAIEngine("http://x", "m", reasoning_parser=DEEPSEEK_R1).writes_reasoning_parser())
        == '"deepseek_r1"'
    )
