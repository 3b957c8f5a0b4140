"""The OpenAI-compatible front's pure parts: body validation, the chat rendering,
program identity from headers, program hops, response shapes and error mapping."""

from __future__ import annotations

import json

import pytest

from inferx.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from inferx.openai_compat import schema
from inferx.openai_compat.errors import InvalidField, ModelNotFound, error_reply
from inferx.openai_compat.identity import ProgramIdentity, parse_identity
from inferx.openai_compat.render import GENERATION_MARK, render_chat
from inferx.scheduling.views import Tier
from inferx.v1 import router_pb2
from inferx_router.hops import ModelHop
from inferx_router.programs import Call, ProgramBook, program_hop
from inferx_router.records import RunStore


def chat(**fields) -> schema.ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return schema.parse_body(schema.ChatCompletionRequest, json.dumps(body).encode())


def bad(cls: type[schema.CallRequest], body: object) -> InvalidField:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(InvalidField) as caught:
        schema.parse_body(cls, raw)
    return caught.value


def assert_chat_refused(fields: dict, param: str, words: str) -> None:
    """A chat body with `fields` is a 400 naming `param`, its message saying `words`."""
    error = bad(
        schema.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    )
    assert error.param == param and words in error.message, error.message


# ----- bodies -------------------------------------------------------------------------


def test_a_chat_body_takes_openai_fields_and_ignores_unsupported_ones() -> None:
    body = chat(max_completion_tokens=7, temperature=0.2, stop=["x"], seed=3, user="u")
    assert body.output_tokens() == 7 and body.temperature == 0.2
    assert chat().output_tokens() == 0  # not set: up to the context room (the engine caps it)
    assert chat(max_tokens=9).output_tokens() == 9
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True).include_usage


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b"{not json", "body", "not valid JSON"),
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body", "nested too deeply"),
        (b"[1]", "body", "JSON object"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model", "required"),
        ({"model": "m", "messages": []}, "messages", "at least 1"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'user'"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
            "only text parts",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
        ({"model": "m", "messages": [{"role": "user"}], "max_tokens": 0}, "max_tokens", "greater"),
        ({"model": "m", "messages": [{"role": "user"}], "n": 2}, "n", "n must be 1"),
        ({"model": "m", "messages": [{"role": "user"}], "tool_choice": 5}, "tool_choice", "string"),
    ],
)
def test_a_bad_chat_body_names_the_bad_field(body: object, param: str, words: str) -> None:
    error = bad(schema.ChatCompletionRequest, body)
    assert error.param == param
    assert words in error.message and error.message.startswith(param)


def test_an_assistant_refusal_part_is_its_text() -> None:
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}
    body = chat(messages=[{"role": "user", "content": "x"}, refusal, {"role": "user", "content": "ok"}])
    assert body.messages[1].content == [schema.ContentPart(type="text", text="I can't.")]
    user_refusal = {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}
    assert (
        bad(schema.ChatCompletionRequest, {"model": "m", "messages": [user_refusal]}).param
        == "messages[0].content"
    )


def test_nulls_openai_accepts_are_its_defaults() -> None:
    body = chat(n=None, stream=None, logprobs=None, top_logprobs=None, functions=None, modalities=None)
    assert not body.stream and not body.include_usage
    assert chat(n=1, logprobs=False, top_logprobs=0, functions=[], function_call="none", modalities=["text"])


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"n": 3}, "n", "n must be 1"),
        ({"logprobs": True}, "logprobs", "log probabilities"),
        ({"top_logprobs": 2}, "top_logprobs", "log probabilities"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "send tools"),
        ({"function_call": "auto"}, "function_call", "send tool_choice"),
        ({"modalities": ["text", "audio"]}, "modalities", "only text"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "only text"),
        ({"tools": [{"type": "function"}]}, "tools", "tool 0"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "tool 0"),
        ({"tools": [{"type": "custom", "custom": {"name": "c"}}]}, "tools", 'only "function" tools'),
    ],
)
def test_chat_fields_asking_for_what_inferx_cannot_give_are_refused(
    fields: dict, param: str, words: str
) -> None:
    assert_chat_refused(fields, param, words)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"max_tokens": True}, "max_tokens", "got true"),
        ({"max_completion_tokens": True}, "max_completion_tokens", "got true"),
        ({"temperature": False}, "temperature", "got false"),
        ({"stream": "yes"}, "stream", "boolean"),
        ({"stream": 1}, "stream", "boolean"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
        (
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
            "boolean",
        ),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
        ({"stream": False, "stream_options": {}}, "stream_options", "only allowed when stream is true"),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": "f"}]}
                ]
            },
            "messages[0].tool_calls",
            "call 0",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}
                ]
            },
            "messages[0].tool_calls",
            "call 0",
        ),
    ],
)
def test_mistyped_fields_a_worker_or_pydantic_would_misread_are_refused(
    fields: dict, param: str, words: str
) -> None:
    assert_chat_refused(fields, param, words)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": 0}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "}"}, "suffix"),
    ],
)
def test_completion_fields_asking_for_what_inferx_cannot_give_are_refused(fields: dict, param: str) -> None:
    error = bad(schema.CompletionRequest, {"model": "m", "prompt": "x", **fields})
    assert error.param == param and "not supported" in error.message
    assert schema.parse_body(
        schema.CompletionRequest,
        b'{"model": "m", "prompt": "x", "echo": false, "best_of": 1, "logprobs": null}',
    )


def test_a_completion_takes_one_prompt() -> None:
    body = schema.parse_body(schema.CompletionRequest, b'{"model": "m", "prompt": ["abc"]}')
    assert body.prompt_text == "abc"
    for prompt in (["a", "b"], [1, 2, 3], None):
        assert bad(schema.CompletionRequest, {"model": "m", "prompt": prompt}).param == "prompt"


# ----- rendering ----------------------------------------------------------------------


def messages(*items: dict) -> list[schema.ChatMessage]:
    return [schema.ChatMessage.model_validate(item) for item in items]


def test_chat_rendering_marks_roles_and_ends_with_the_generation_mark() -> None:
    prompt = render_chat(
        messages(
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        )
    )
    assert prompt == "<|system|>\nBe brief.\n<|user|>\nHi there\n" + GENERATION_MARK


def test_tools_tool_calls_and_tool_results_are_rendered_into_the_prompt() -> None:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    prompt = render_chat(
        messages(
            {"role": "user", "content": "Where is order 7?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "shipped"}'},
        ),
        tools=[tool],
        tool_choice="auto",
    )
    lines = prompt.splitlines()
    assert lines[0] == "<|tools|>" and json.loads(lines[1]) == tool
    assert "<|tool_calls|>" in lines and json.loads(lines[lines.index("<|tool_calls|>") + 1]) == call
    assert '<|tool|> call_1\n{"status": "shipped"}' in prompt
    assert prompt.endswith("<|tool_choice|>\nauto\n" + GENERATION_MARK)


def test_an_agent_loops_next_prompt_extends_its_previous_one() -> None:
    """What prefix caching and affinity need: the next call's rendering starts with the
    previous call's, tool choice and all changes at the end."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    first = messages({"role": "system", "content": "S"}, {"role": "user", "content": "U"})
    second = first + messages({"role": "assistant", "content": "A"}, {"role": "user", "content": "V"})
    one = render_chat(first, tools, "auto")
    two = render_chat(second, tools, {"type": "function", "function": {"name": "f"}})
    head = one.split("<|tool_choice|>")[0]
    assert two.startswith(head + GENERATION_MARK + "A\n")


# ----- identity -----------------------------------------------------------------------


def test_identity_headers_are_read_case_insensitively() -> None:
    identity = parse_identity(
        {
            "x-inferx-program": "agent-run.42",
            "X-INFERX-TIER": "Realtime",
            "x-inferx-deadline-ms": "1500",
            "X-InferX-Program-End": "true",
        }
    )
    assert identity == ProgramIdentity("agent-run.42", Tier.REALTIME, 1500, True)
    assert parse_identity({}) == ProgramIdentity()
    assert parse_identity({"x-inferx-program-end": "0"}).program_end is False


@pytest.mark.parametrize(
    ("headers", "param"),
    [
        ({"X-InferX-Program": "has space"}, "X-InferX-Program"),
        ({"X-InferX-Program": "x" * 257}, "X-InferX-Program"),
        ({"X-InferX-Tier": "urgent"}, "X-InferX-Tier"),
        ({"X-InferX-Deadline-Ms": "-5"}, "X-InferX-Deadline-Ms"),
        ({"X-InferX-Deadline-Ms": "0"}, "X-InferX-Deadline-Ms"),
        ({"X-InferX-Deadline-Ms": "1.5"}, "X-InferX-Deadline-Ms"),
        ({"X-InferX-Deadline-Ms": "86400001"}, "X-InferX-Deadline-Ms"),
        ({"X-InferX-Program": "p", "X-InferX-Program-End": "maybe"}, "X-InferX-Program-End"),
        ({"X-InferX-Program-End": "true"}, "X-InferX-Program-End"),
    ],
)
def test_a_bad_identity_header_is_an_error_naming_it(headers: dict[str, str], param: str) -> None:
    with pytest.raises(InvalidField) as caught:
        parse_identity(headers)
    assert caught.value.param == param and param in caught.value.message


# ----- calls as program hops ----------------------------------------------------------

CALL = Call(call_id="chatcmpl-abc", model="m", prompt="p", max_tokens=5, temperature=0.0)


def hop_of(book: ProgramBook, identity: ProgramIdentity, **kw) -> tuple[ModelHop, float]:
    """A call's hop, the way ProgramCalls makes it (its record entry left open)."""
    kw.setdefault("now_unix_ms", 1000)
    kw.setdefault("default_timeout_ms", 60_000)
    return program_hop(CALL, book.begin(identity, tenant="acme"), identity, **kw)


def test_calls_of_one_program_share_its_chain_key_and_count_up() -> None:
    book = ProgramBook(RunStore())
    identity = ProgramIdentity("run-1", Tier.BATCH, None, False)
    hops = [hop_of(book, identity)[0] for _ in range(3)]
    assert {h.run_id for h in hops} == {"acme/run-1"} and {h.session_id for h in hops} == {""}
    assert [h.hop_index for h in hops] == [0, 1, 2]
    assert len({h.hop_id for h in hops}) == 3  # unique per call, the index in it
    assert all(h.remaining_hops is None and h.tier == Tier.BATCH for h in hops)
    assert {h.chain_name for h in hops} == {"openai"}
    end, timeout_s = hop_of(book, ProgramIdentity("run-1", Tier.BATCH, 2500, True))
    assert end.hop_index == 3 and end.remaining_hops == 0
    assert end.deadline_unix_ms == 3500 and timeout_s == 2.5
    assert len(book) == 0  # the program ended: its next call starts a new record


def test_a_call_without_identity_is_a_one_hop_program() -> None:
    book = ProgramBook(RunStore())
    hop, timeout_s = hop_of(book, ProgramIdentity(), now_unix_ms=0)
    assert hop.hop_index == 0 and hop.remaining_hops == 0 and hop.run_id  # its own record's run id
    assert hop.tier == Tier.STANDARD and timeout_s == 60 and hop.deadline_unix_ms == 60_000
    assert len(book) == 0


def test_a_programs_name_and_priority_reach_its_hops() -> None:
    identity = ProgramIdentity("p", name="support-bot", priority=0)
    hop, _ = hop_of(ProgramBook(RunStore()), identity)
    assert hop.chain_name == "support-bot" and hop.priority == 0


# ----- responses and errors -----------------------------------------------------------


def test_usage_reports_cached_prompt_tokens() -> None:
    assert schema.usage(10, 3, 8) == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    body = schema.chat_completion("id", 1, "m", "text", "length", schema.usage(1, 1, 0))
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "text"}
    assert schema.chat_chunk("id", 1, "m", {}, "")["choices"][0]["finish_reason"] == "stop"
    assert schema.sse({"a": 1}) == 'data: {"a":1}\n\n'


@pytest.mark.parametrize(
    "text",
    ["plain", "caf\u00e9 \u4f60\u597d \U0001f600", 'quote " backslash \\ newline \n tab \t', "\ud800 lone"],
)
def test_a_streamed_chunk_carries_any_text_exactly(text: str) -> None:
    """Every streamed token is written by `sse` (orjson where it writes what json
    would): a client reading the event as JSON gets the model's text back unchanged,
    non-ASCII, escapes and a lone surrogate (which orjson refuses) included."""
    payload = schema.chat_chunk("id", 1, "m", {"content": text}, None)
    event = schema.sse(payload)
    assert event.startswith("data: ") and event.endswith("\n\n") and "\n" not in event[:-2]
    assert json.loads(event.encode()[len("data: ") : -2]) == payload  # sent as UTF-8


@pytest.mark.parametrize(
    ("error", "status", "type_"),
    [
        (InvalidArgument("bad"), 400, "invalid_request_error"),
        (FailedPrecondition("bad"), 400, "invalid_request_error"),
        (NotFound("gone"), 404, "invalid_request_error"),
        (Aborted("clash"), 409, "conflict_error"),
        (ResourceExhausted("full"), 429, "rate_limit_error"),
        (Unavailable("down"), 503, "service_unavailable_error"),
        (DeadlineExceeded("late"), 504, "timeout_error"),
        (TimeoutError(), 504, "timeout_error"),
        (Internal("oops"), 500, "server_error"),
        (KeyError("secret internals"), 500, "server_error"),
    ],
)
def test_domain_errors_map_to_openai_errors(error: BaseException, status: int, type_: str) -> None:
    reply = error_reply(error)
    assert reply.status == status
    assert set(reply.body["error"]) == {"message", "type", "param", "code"}
    assert reply.body["error"]["type"] == type_
    assert "secret" not in reply.body["error"]["message"]


def test_retry_after_and_params_come_through() -> None:
    assert error_reply(ResourceExhausted("full", retry_after_s=2.2)).headers == {"Retry-After": "3"}
    assert error_reply(ResourceExhausted("full")).headers == {"Retry-After": "1"}
    assert error_reply(Unavailable("down")).headers == {}
    assert error_reply(Unavailable("down", retry_after_s=0.1)).headers == {"Retry-After": "1"}
    missing = error_reply(ModelNotFound("gpt-9")).body["error"]
    assert (
        missing["param"] == "model" and missing["code"] == "model_not_found" and "gpt-9" in missing["message"]
    )
    header = error_reply(InvalidField("X-InferX-Tier", "nope")).body["error"]
    assert header["param"] == "X-InferX-Tier" and header["message"] == "X-InferX-Tier: nope"


def test_a_programs_unknown_remaining_hops_stay_unset_on_the_wire() -> None:
    """The scheduler reads an unset remaining_hops as unknown (None) and 0 as the last
    hop (the program's KV is let go): the request must tell them apart."""
    from inferx_router.executors import hop_request

    book = ProgramBook(RunStore())
    going, _ = hop_of(book, ProgramIdentity("p"))
    ending, _ = hop_of(book, ProgramIdentity("p", program_end=True))
    assert not hop_request(going).context.HasField("remaining_hops")
    last = hop_request(ending).context
    assert last.HasField("remaining_hops") and last.remaining_hops == 0
    assert last.run_id == "acme/p" and last.session_id == "" and last.hop_index == 1


def test_sampling_fields_reach_the_hop_request_as_sent() -> None:
    """top_p, seed and stop: from the body (or CallModel's fields) to the worker's
    SamplingOptions; unset ones stay unset (1.0, no seed, no stop)."""
    from dataclasses import replace

    from inferx_router.executors import hop_request
    from inferx_router.program_calls import request_body

    body = schema.validate_body(
        schema.ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "top_p": 0.5,
            "seed": 7,
            "stop": "\nObs",
        },
    )
    assert (body.top_p, body.seed, body.stop_sequences) == (0.5, 7, ["\nObs"])
    call = replace(CALL, top_p=body.top_p or 1.0, seed=body.seed, stop=tuple(body.stop_sequences))
    hop, _ = program_hop(
        call,
        ProgramBook(RunStore()).begin(ProgramIdentity(""), tenant="acme"),
        ProgramIdentity(""),
        now_unix_ms=1000,
        default_timeout_ms=60_000,
    )
    sampling = hop_request(hop).sampling
    assert (round(sampling.top_p, 6), sampling.seed, list(sampling.stop)) == (0.5, 7, ["\nObs"])
    plain = hop_request(hop_of(ProgramBook(RunStore()), ProgramIdentity(""))[0]).sampling
    assert (plain.top_p, plain.HasField("seed"), list(plain.stop)) == (1.0, False, [])
    grpc_body = request_body(
        router_pb2.ProgramCallRequest(model="m", prompt="p", top_p=0.25, seed=3, stop=["END", "\n\n"])
    )
    assert (grpc_body.top_p, grpc_body.seed, grpc_body.stop_sequences) == (0.25, 3, ["END", "\n\n"])


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"stop": ""}, "stop", "a stop sequence is empty"),
        ({"stop": ["a", ""]}, "stop", "a stop sequence is empty"),
        ({"stop": [str(i) for i in range(17)]}, "stop", "at most 16 stop sequences, got 17"),
        ({"stop": 3}, "stop", ""),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
    ],
)
def test_bad_sampling_fields_are_named(fields: dict, param: str, words: str) -> None:
    with pytest.raises(InvalidField) as caught:
        schema.validate_body(schema.CompletionRequest, {"model": "m", "prompt": "p", **fields})
    assert caught.value.param == param and words in caught.value.message


def test_response_format_reaches_the_hop_request_as_json() -> None:
    schema_ = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema_}}
    body = schema.validate_body(
        schema.ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": fmt},
    )
    assert json.loads(body.response_format_json) == fmt
    text = schema.validate_body(
        schema.CompletionRequest, {"model": "m", "prompt": "p", "response_format": {"type": "text"}}
    )
    assert text.response_format_json == ""  # free text: nothing for the engine
    from dataclasses import replace

    from inferx_router.executors import hop_request
    from inferx_router.program_calls import request_body

    call = replace(CALL, response_format_json=body.response_format_json)
    identity = ProgramIdentity("")
    hop, _ = program_hop(
        call,
        ProgramBook(RunStore()).begin(identity, tenant="acme"),
        identity,
        now_unix_ms=1000,
        default_timeout_ms=60_000,
    )
    assert json.loads(hop_request(hop).sampling.response_format_json) == fmt
    grpc_body = request_body(
        router_pb2.ProgramCallRequest(model="m", prompt="p", response_format_json='{"type": "json_object"}')
    )
    assert grpc_body.response_format == {"type": "json_object"}


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"type": "xml"}, "type: expected one of text, json_object, json_schema, got 'xml'"),
        ({"type": "json_schema"}, "json_schema: expected"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "json_schema: expected"),
        ("json", "valid dictionary"),
    ],
)
def test_bad_response_formats_are_named(value: object, words: str) -> None:
    with pytest.raises(InvalidField) as caught:
        schema.validate_body(
            schema.CompletionRequest, {"model": "m", "prompt": "p", "response_format": value}
        )
    assert caught.value.param.startswith("response_format") and words in caught.value.message


def test_the_worker_reads_response_format_json_or_refuses_it() -> None:
    from inferx.errors import InvalidArgument
    from inferx_worker.servicer import response_format

    assert response_format("") is None and response_format('{"type": "text"}') is None
    assert response_format('{"type": "json_object"}') == {"type": "json_object"}
    for bad in ("{", "[]", '{"type": "yaml"}'):
        with pytest.raises(InvalidArgument, match="response_format_json"):
            response_format(bad)
