"""Program identity for drop-in use: session headers, vLLM router's `agentic_context`
and `agent_hint`, body session fields, CallModel's fields; unknown program fields are
errors naming them; garbage never escapes as anything but an InvalidField."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferx.openai_compat.errors import InvalidField
from inferx.openai_compat.identity import (
    DEFAULT_PRIORITY,
    ProgramIdentity,
    identity_of_fields,
    parse_identity,
    priority_rank,
)
from inferx.scheduling.views import Tier


def bad(headers: dict[str, str], body: dict[str, Any] | None = None) -> InvalidField:
    with pytest.raises(InvalidField) as caught:
        parse_identity(headers, body)
    return caught.value


# ----- session headers and body fields -------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "program", "parent"),
    [
        ({"X-Session-Id": "conv-7"}, "conv-7", ""),
        ({"session-id": "s1"}, "s1", ""),  # Codex
        ({"Session-Id": "s1", "Thread-Id": "worker"}, "s1:worker", "s1"),
        ({"x-claude-code-session-id": "c1"}, "c1", ""),
        ({"X-Claude-Code-Session-Id": "c1", "X-Claude-Code-Agent-Id": "explore"}, "c1:explore", "c1"),
        (
            {
                "X-Claude-Code-Session-Id": "c1",
                "X-Claude-Code-Agent-Id": "c1:explore",  # already scoped: kept as it is
                "X-Claude-Code-Parent-Agent-Id": "plan",
            },
            "c1:explore",
            "c1:plan",
        ),
    ],
)
def test_session_headers_name_the_program(headers: dict[str, str], program: str, parent: str) -> None:
    identity = parse_identity(headers)
    assert (identity.program_id, identity.parent_program_id) == (program, parent)


def test_inferx_headers_win_and_the_claude_session_comes_before_the_generic_one() -> None:
    both = {"X-InferX-Program": "mine", "X-Session-Id": "theirs"}
    assert parse_identity(both).program_id == "mine"
    two = {"X-Session-Id": "generic", "X-Claude-Code-Session-Id": "claude"}
    assert parse_identity(two).program_id == "claude"


def test_body_session_fields_are_identity_but_user_is_not() -> None:
    assert parse_identity({}, {"session_id": "b1"}).program_id == "b1"
    assert parse_identity({}, {"session_id": 42}).program_id == "42"
    assert parse_identity({}, {"session_params": {"session_id": "n1"}, "session_id": "b1"}).program_id == "n1"
    assert parse_identity({}, {"user": "alice"}).program_id == ""  # an end user, not an agent run
    assert parse_identity({"X-Session-Id": "h"}, {"session_id": "b"}).program_id == "h"


def test_an_end_mark_with_a_session_header_ends_that_session() -> None:
    identity = parse_identity({"X-Session-Id": "s", "X-InferX-Program-End": "true"})
    assert identity.program_id == "s" and identity.program_end


def test_the_program_name_header_names_the_programs_chain() -> None:
    assert parse_identity({}).name == "openai"
    assert parse_identity({"X-InferX-Program-Name": "support-bot"}).name == "support-bot"
    assert bad({"X-InferX-Program-Name": "no spaces"}).param == "X-InferX-Program-Name"
    assert bad({"X-InferX-Program-Name": "x" * 65}).param == "X-InferX-Program-Name"


# ----- agentic_context (vLLM router) ---------------------------------------------------------


def ctx(**fields: Any) -> dict[str, Any]:
    return {"vllm_xargs": {"agentic_context": fields}}


def test_agentic_context_maps_onto_program_tier_priority_deadline_and_end() -> None:
    identity = parse_identity(
        {},
        ctx(
            program_id="task-a:researcher",
            parent_program_id="task-a:lead",
            priority=5,
            deadline=1.5,
            expected_resume=False,
            kv_retention_ttl=30,
            tier="realtime",
            # vLLM router's other fields: accepted, not used
            root_program_id="task-a:lead",
            agent_role="subagent",
            spawn_reason="research",
            step_id=3,
            request_id="r-1",
            blocks_parent=True,
            expected_output_tokens=200,
        ),
    )
    assert identity == ProgramIdentity(
        program_id="task-a:researcher",
        tier=Tier.REALTIME,
        deadline_ms=1500,
        program_end=True,
        parent_program_id="task-a:lead",
        priority=0,
        kv_retention_s=30.0,
    )


def test_the_kv_retention_header_wins_over_the_field_and_needs_a_program() -> None:
    both = parse_identity({"X-InferX-KV-Retention-S": "0", "X-InferX-Program": "p"}, ctx(kv_retention_ttl=30))
    assert both.kv_retention_s == 0.0  # 0 is a hint (let go at once), not "unset"
    assert parse_identity({}, ctx(program_id="p", kv_retention_ttl_seconds=12.5)).kv_retention_s == 12.5
    assert parse_identity({"X-InferX-Program": "p"}).kv_retention_s is None
    # A call of no program holds nothing after it: the hint has nothing to keep.
    assert parse_identity({"X-InferX-KV-Retention-S": "30"}).kv_retention_s is None
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(InvalidField) as caught:
            parse_identity({"X-InferX-KV-Retention-S": bad, "X-InferX-Program": "p"})
        assert caught.value.param == "X-InferX-KV-Retention-S"


def test_agentic_context_derives_the_program_from_task_or_session_and_agent() -> None:
    assert parse_identity({}, ctx(task_id="t", agent_id="a")).program_id == "t:a"
    assert parse_identity({}, ctx(session_id="s")).program_id == "s"
    derived = parse_identity({}, ctx(task_id="t", agent_id="child", parent_agent_id="lead"))
    assert derived.parent_program_id == "t:lead"
    assert parse_identity({}, ctx(program_id="p", expected_resume=True)).program_end is False


def test_agentic_context_may_be_top_level_or_a_json_string() -> None:
    assert parse_identity({}, {"agentic_context": {"program_id": "p"}}).program_id == "p"
    as_text = {"vllm_xargs": {"agentic_context": json.dumps({"program_id": "p", "deadline_seconds": 2})}}
    identity = parse_identity({}, as_text)
    assert identity.program_id == "p" and identity.deadline_ms == 2000
    assert parse_identity({}, {"vllm_xargs": {"other_arg": 1}}) == ProgramIdentity()  # not a program field


def test_headers_win_over_agentic_context_field_by_field() -> None:
    headers = {"X-InferX-Program": "h", "X-InferX-Tier": "batch", "X-InferX-Program-End": "false"}
    identity = parse_identity(
        headers, ctx(program_id="b", tier="realtime", expected_resume=False, priority=1)
    )
    assert (identity.program_id, identity.tier, identity.program_end) == ("h", Tier.BATCH, False)
    assert identity.priority == 1  # only the context gives one


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (ctx(program_id="p", colour="red"), "vllm_xargs.agentic_context.colour", "unknown field"),
        ({"agentic_context": {"program_id": "p", "prio": 1}}, "agentic_context.prio", "priority"),
        (ctx(program_id=""), "vllm_xargs.agentic_context.program_id", "empty"),
        (ctx(program_id=["x"]), "vllm_xargs.agentic_context.program_id", "string"),
        (ctx(program_id="has space"), "vllm_xargs.agentic_context.program_id", "visible ASCII"),
        (ctx(program_id="p", priority="high"), "vllm_xargs.agentic_context.priority", "integer"),
        (ctx(program_id="p", deadline=-1), "vllm_xargs.agentic_context.deadline", "at least 0"),
        (ctx(program_id="p", deadline=0), "vllm_xargs.agentic_context.deadline", "1 to"),
        (ctx(program_id="p", deadline=1e308), "vllm_xargs.agentic_context.deadline", "1 to"),
        (ctx(program_id="p", deadline=10**400), "vllm_xargs.agentic_context.deadline", "1 to"),
        (ctx(program_id="p", deadline=float("inf")), "vllm_xargs.agentic_context.deadline", "seconds"),
        (
            ctx(program_id="p", expected_resume="no"),
            "vllm_xargs.agentic_context.expected_resume",
            "true or false",
        ),
        (ctx(program_id="p", tier="urgent"), "vllm_xargs.agentic_context.tier", "realtime"),
        (
            ctx(program_id="p", parent_program_id="p"),
            "vllm_xargs.agentic_context.parent_program_id",
            "differ",
        ),
        (ctx(agent_id="a"), "vllm_xargs.agentic_context.program_id", "required"),
        (ctx(expected_resume=False), "agentic_context.expected_resume", "needs a program"),
        ({"vllm_xargs": {"agentic_context": "{nope"}}, "vllm_xargs.agentic_context", "JSON string"),
        ({"vllm_xargs": {"agentic_context": "x" * 20_000}}, "vllm_xargs.agentic_context", "longer"),
        ({"vllm_xargs": {"agentic_context": [1]}}, "vllm_xargs.agentic_context", "object"),
        ({"vllm_xargs": "x"}, "vllm_xargs", "object"),
        (
            {"agentic_context": {"program_id": "a"}, "vllm_xargs": {"agentic_context": {"program_id": "b"}}},
            "agentic_context",
            "once",
        ),
        ({"agent_hint": {"parent_session_id": "x"}}, "agent_hint.session_id", "required"),
        ({"agent_hint": {"session_id": "s", "who": 1}}, "agent_hint.who", "unknown field"),
        ({"session_id": ""}, "session_id", "empty"),
    ],
)
def test_bad_program_fields_are_errors_naming_them(body: dict[str, Any], param: str, words: str) -> None:
    error = bad({}, body)
    assert error.param == param, error.message
    assert words in error.message and error.message.startswith(param)


def test_unknown_field_errors_list_what_agentic_context_takes() -> None:
    error = bad({}, ctx(program_id="p", colour="red"))
    assert "program_id" in error.message and "expected_resume" in error.message


def test_agent_hint_is_vllm_routers_older_contract() -> None:
    hint = {"agent_hint": {"session_id": "child", "parent_session_id": "root", "expected_resume": False}}
    identity = parse_identity({}, hint)
    assert (identity.program_id, identity.parent_program_id, identity.program_end) == ("child", "root", True)


def test_priority_ranks() -> None:
    assert [priority_rank(p) for p in (-5, -1, 0, 1, 2, 9)] == [3, 3, 2, 1, 0, 0]
    assert priority_rank(0) == DEFAULT_PRIORITY


# ----- CallModel's fields ---------------------------------------------------------------------


def test_call_model_fields_make_the_same_identity() -> None:
    assert identity_of_fields() == ProgramIdentity()
    identity = identity_of_fields(
        program_id="p",
        name="bot",
        tier=1,
        deadline_ms=900,
        program_end=True,
        parent_program_id="q",
        priority=1,
    )
    assert identity == ProgramIdentity("p", Tier.REALTIME, 900, True, "bot", "q", 1)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"program_id": "a b"}, "program_id"),
        ({"name": "a/b"}, "program_name"),
        ({"tier": 7}, "tier"),
        ({"deadline_ms": 86_400_001}, "deadline_ms"),
        ({"program_end": True}, "program_end"),
        ({"parent_program_id": "q"}, "parent_program_id"),
        ({"program_id": "p", "parent_program_id": "p"}, "parent_program_id"),
    ],
)
def test_bad_call_model_fields_are_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidField) as caught:
        identity_of_fields(**fields)
    assert caught.value.param == param


# ----- garbage ---------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([10**400, -(10**400), 1e308, -1e308])
    | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
program_keys = st.sampled_from(
    [
        "program_id",
        "task_id",
        "session_id",
        "agent_id",
        "parent_program_id",
        "parent_agent_id",
        "priority",
        "deadline",
        "expected_resume",
        "kv_retention_ttl",
        "tier",
        "step_id",
        "blocks_parent",
    ]
) | st.text(max_size=10)
contexts = st.dictionaries(program_keys, json_values, max_size=6)
header_names = st.sampled_from(
    [
        "X-InferX-Program",
        "X-InferX-Program-Name",
        "X-InferX-Tier",
        "X-InferX-Deadline-Ms",
        "X-InferX-Program-End",
        "X-InferX-KV-Retention-S",
        "X-Session-Id",
        "Session-Id",
        "Thread-Id",
        "X-Claude-Code-Session-Id",
        "X-Claude-Code-Agent-Id",
        "X-Claude-Code-Parent-Agent-Id",
    ]
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "vllm_xargs": st.one_of(
            json_values, st.fixed_dictionaries({"agentic_context": contexts | json_values})
        ),
        "agentic_context": contexts | json_values | contexts.map(json.dumps),
        "agent_hint": st.dictionaries(
            st.sampled_from(["session_id", "parent_session_id", "expected_resume", "x"]), json_values
        )
        | json_values,
        "session_id": json_values,
        "session_params": json_values,
        "user": json_values,
    },
)


@settings(max_examples=400, deadline=None)
@given(headers=st.dictionaries(header_names, st.text(max_size=300), max_size=5), body=bodies)
def test_garbage_is_an_identity_or_an_error_naming_the_field(headers: dict[str, str], body: dict) -> None:
    try:
        identity = parse_identity(headers, body)
    except InvalidField as exc:
        assert exc.param and exc.message.startswith(exc.param)
        return
    assert isinstance(identity, ProgramIdentity)
    assert identity.program_end is False or identity.program_id
    assert identity.parent_program_id != identity.program_id or not identity.program_id
    assert identity.deadline_ms is None or 1 <= identity.deadline_ms <= 86_400_000
    assert 0 <= identity.priority <= 3
