"""Chain-config format: the seed is accepted unchanged, every rejection says where and why."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
import yaml

from inferx.chain import (
    ChainConfig,
    ChainConfigError,
    InputSpec,
    NodeSpec,
    SloSpec,
    ValueFormatError,
    critical_path,
    format_duration_ms,
    load_chain_text,
    parse_availability,
    parse_duration_ms,
    required_inputs,
    sinks,
    topological_order,
    upstream,
    validate_chain,
)
from inferx.errors import InvalidArgument

SEED = """\
agent_chain:
  name: customer_service_agent
  slo: {end_to_end_latency_p99: 5000ms, availability: 99.9%}
  nodes:
    - {id: intent_recognition, type: model_inference, model: qwen-7b, timeout: 500ms, priority: high}
    - {id: knowledge_retrieval, type: tool_call, tool: vector_search, timeout: 300ms, cacheable: true}
    - id: response_generation
      type: model_inference
      model: qwen-72b
      timeout: 3000ms
      priority: high
      depends_on: [intent_recognition, knowledge_retrieval]
"""  # noqa: E501 - the seed format, verbatim


def seed_doc() -> dict[str, Any]:
    return yaml.safe_load(SEED)


def load(doc: dict[str, Any], **kwargs: Any) -> Any:
    return load_chain_text(json.dumps(doc), **kwargs)


def problems_of(doc_or_text: dict[str, Any] | str, **kwargs: Any) -> list[str]:
    text = doc_or_text if isinstance(doc_or_text, str) else json.dumps(doc_or_text)
    with pytest.raises(ChainConfigError) as info:
        load_chain_text(text, **kwargs)
    return info.value.problems


def chain_with(*nodes: Any, **chain: Any) -> dict[str, Any]:
    # Any: some tests pass a node that is not a mapping on purpose.
    # 10 minutes: well above the 30s default timeouts, so no SLO warning unless a test wants one.
    body = {"name": "c", "slo": {"end_to_end_latency_p99": "10m"}, "nodes": list(nodes)}
    body.update(chain)
    return {"agent_chain": body}


def model(node_id: str, **fields: Any) -> dict[str, Any]:
    return {"id": node_id, "type": "model_inference", "model": "m", **fields}


def tool(node_id: str, **fields: Any) -> dict[str, Any]:
    return {"id": node_id, "type": "tool_call", "tool": "t", **fields}


# --------------------------------------------------------------------------- the seed


def test_seed_yaml_is_accepted_unchanged() -> None:
    chain = load_chain_text(SEED)
    config = chain.config
    assert chain.warnings == []
    assert config.name == "customer_service_agent"
    assert config.slo.latency_p99_ms == 5000.0
    assert config.slo.availability == 0.999
    assert config.tier == "standard" and config.inputs == {}
    intent, knowledge, response = config.nodes
    assert (intent.model, intent.timeout_ms, intent.priority_rank) == ("qwen-7b", 500.0, 0)
    assert (knowledge.tool, knowledge.cacheable, knowledge.priority_rank) == (
        "vector_search",
        True,
        2,
    )
    assert response.depends_on == ["intent_recognition", "knowledge_retrieval"]
    # Defaults of the extension keys.
    assert (response.max_tokens, response.temperature, response.retries) == (64, 0.0, 0)
    assert (response.critical, response.idempotent, response.cache_ttl_ms) == (True, True, 300_000)


def test_seed_as_json_gives_the_same_config() -> None:
    assert load_chain_text(json.dumps(seed_doc())).config == load_chain_text(SEED).config


def test_seed_graph_helpers() -> None:
    config = load_chain_text(SEED).config
    assert topological_order(config) == [
        "intent_recognition",
        "knowledge_retrieval",
        "response_generation",
    ]
    assert sinks(config) == ["response_generation"]
    assert upstream(config, "response_generation") == {"intent_recognition", "knowledge_retrieval"}
    assert upstream(config, "intent_recognition") == set()
    assert critical_path(config) == (["intent_recognition", "response_generation"], 3500.0)
    with pytest.raises(KeyError):
        upstream(config, "nope")


def test_priority_rank_orders_high_to_low() -> None:
    ranks = [NodeSpec(id="n", type="tool_call", tool="t", priority=p).priority_rank for p in
             ("high", "medium", "normal", "low")]  # fmt: skip
    assert ranks == [0, 1, 2, 3]


def test_memory_node_defaults_to_session_memory_tool() -> None:
    doc = chain_with({"id": "mem", "type": "memory_retrieval"}, model("m", depends_on=["mem"]))
    node = load(doc).config.node("mem")
    assert (node.tool, node.limit) == ("session_memory", 5)


def test_models_are_frozen() -> None:
    config = load_chain_text(SEED).config
    with pytest.raises(pydantic.ValidationError):
        config.name = "other"


# --------------------------------------------------------------------------- syntax / document


def test_yaml_syntax_error_reports_source_line_and_column() -> None:
    text = "agent_chain:\n  name: x\n  slo: {end_to_end_latency_p99: 5s\n  nodes: []\n"
    (problem,) = problems_of(text, source="chain.yaml")
    assert problem.startswith("chain.yaml:4:8: invalid YAML/JSON: ")
    assert "expected ',' or '}'" in problem


def test_json_syntax_error_reports_line_and_column() -> None:
    text = '{\n  "agent_chain": {\n    "name": "x",,\n  }\n}'
    (problem,) = problems_of(text)
    assert problem.startswith("<config>:3:17: invalid YAML/JSON")


def test_duplicate_yaml_key_is_rejected_with_position() -> None:
    text = "agent_chain:\n  name: x\n  name: y\n"
    assert problems_of(text) == ["<config>:3:3: invalid YAML/JSON: duplicate key 'name' (first at line 2)"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "<config>: the config is empty; expected an 'agent_chain' mapping"),
        ("[1, 2]", "<config>: the config must be a mapping with an 'agent_chain' key, got a list"),
        ("agent_chain: 5", "agent_chain: must be a mapping, got 5"),
    ],
)
def test_document_shape_problems(text: str, expected: str) -> None:
    assert problems_of(text) == [expected]


def test_missing_agent_chain_suggests_the_key() -> None:
    assert problems_of("agent_chians: {}") == [
        "<config>: unknown top-level key 'agent_chians' (did you mean 'agent_chain'?)",
        "<config>: missing top-level key 'agent_chain'",
    ]


def test_alias_bomb_is_refused() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]"
              for i in range(1, 9)]  # fmt: skip
    (problem,) = problems_of("\n".join(lines))
    assert "more than 100000 values" in problem


# --------------------------------------------------------------------------- unknown keys


def test_unknown_node_key_suggests_the_closest_key() -> None:
    doc = chain_with({"id": "gen", "type": "model_inference", "modle": "qwen-7b"})
    problems = problems_of(doc)
    assert "node 'gen': unknown key 'modle' (did you mean 'model'?)" in problems


def test_unknown_chain_and_slo_keys_suggest_the_closest_key() -> None:
    doc = chain_with(model("a"), tierr="batch")
    doc["agent_chain"]["slo"]["end_to_end_latency"] = "5s"
    problems = problems_of(doc)
    assert "agent_chain: unknown key 'tierr' (did you mean 'tier'?)" in problems
    assert "slo: unknown key 'end_to_end_latency' (did you mean 'end_to_end_latency_p99'?)" in problems


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    (problem,) = problems_of(chain_with(model("a", colour="blue")))
    assert problem.startswith("node 'a': unknown key 'colour'; valid keys: id, type, model, tool")


def test_unknown_input_spec_key() -> None:
    doc = chain_with(model("a"), inputs={"q": {"requird": False}})
    assert problems_of(doc) == ["inputs.q: unknown key 'requird' (did you mean 'required'?)"]


# --------------------------------------------------------------------------- node problems


def test_duplicate_node_ids() -> None:
    problems = problems_of(chain_with(model("a"), tool("b"), tool("a")))
    assert problems == ["node 'a' (nodes[2]): id: duplicate node id (also nodes[0])"]


def test_unknown_node_type_lists_the_valid_types() -> None:
    (problem,) = problems_of(chain_with({"id": "x", "type": "model_inferense", "model": "m"}))
    assert problem == (
        "node 'x': type: unknown node type 'model_inferense' (did you mean 'model_inference'?); "
        "valid: model_inference, tool_call, memory_retrieval, chain"
    )


def test_dependency_on_missing_node_suggests_the_closest_id() -> None:
    doc = seed_doc()
    doc["agent_chain"]["nodes"][2]["depends_on"] = ["intent_recognition", "knowlege_retrieval"]
    assert problems_of(doc) == [
        "node 'response_generation': depends_on: unknown node 'knowlege_retrieval' "
        "(did you mean 'knowledge_retrieval'?)"
    ]


def test_self_dependency() -> None:
    assert problems_of(chain_with(model("a", depends_on=["a"]))) == [
        "node 'a': depends_on: a node cannot depend on itself"
    ]


def test_dependency_cycle_is_printed_as_a_path() -> None:
    doc = chain_with(
        model("a", depends_on=["c"]),
        model("b", depends_on=["a"]),
        model("c", depends_on=["b"]),
        model("d"),
    )
    # c runs before a, a before b, b before c.
    assert problems_of(doc) == ["node 'a': depends_on: dependency cycle a -> b -> c -> a"]


def test_model_node_without_model_and_tool_node_without_tool() -> None:
    doc = chain_with({"id": "gen", "type": "model_inference"}, {"id": "t", "type": "tool_call"})
    assert problems_of(doc) == [
        "node 'gen': model: a model_inference node needs a 'model'",
        "node 't': tool: a tool_call node needs a 'tool'",
    ]


@pytest.mark.parametrize("timeout", ["-3s", "0ms", 0, -5, "abc", "3 parsecs", True, "1.5"])
def test_bad_timeouts_name_node_and_field(timeout: Any) -> None:
    if timeout == "1.5":  # a unit-less string is milliseconds, so this one is fine
        assert load(chain_with(model("gen", timeout=timeout))).config.nodes[0].timeout_ms == 1.5
        return
    (problem,) = problems_of(chain_with(model("gen", timeout=timeout)))
    assert problem == (
        f"node 'gen': timeout: must be a positive duration like 500ms, 3s or 1m, got {timeout!r}"
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"retries": 11}, "node 'a': retries: must be less than or equal to 10, got 11"),
        ({"max_tokens": 0}, "node 'a': max_tokens: must be greater than 0, got 0"),
        ({"temperature": -1}, "node 'a': temperature: must be greater than or equal to 0, got -1"),
        ({"priority": "urgent"}, "node 'a': priority: unknown value 'urgent'"),
        ({"cache_ttl": "5 mins"}, "node 'a': cache_ttl: must be a positive duration"),
        ({"id": "-bad id"}, "node '-bad id': id: '-bad id' is not a valid identifier"),
        ({"id": 7}, "nodes[0]: id: must be a valid string, got 7"),
        ({"depends_on": "x"}, "node 'a': depends_on: must be a valid list, got 'x'"),
        ({"stop": [""]}, "node 'a': stop[0]: "),
        ({"stop": ["x"] * 17}, "node 'a': stop: "),
    ],
)
def test_bad_field_values_name_node_and_field(fields: dict[str, Any], expected: str) -> None:
    problems = problems_of(chain_with(model("a", **fields)))
    assert any(problem.startswith(expected) for problem in problems), problems


def test_node_that_is_not_a_mapping_is_named_by_index() -> None:
    assert problems_of(chain_with(model("a"), "b")) == ["nodes[1]: must be a mapping, got 'b'"]


def test_empty_chain_and_missing_nodes() -> None:
    assert problems_of(chain_with()) == ["nodes: a chain needs at least one node"]
    doc = chain_with(model("a"))
    del doc["agent_chain"]["nodes"]
    assert problems_of(doc) == ["agent_chain: missing required key 'nodes'"]


def test_bad_slo_values() -> None:
    doc = chain_with(model("a"))
    doc["agent_chain"]["slo"] = {"end_to_end_latency_p99": "-1s", "availability": "150%"}
    assert problems_of(doc) == [
        "slo.end_to_end_latency_p99: must be a positive duration like 500ms, 3s or 1m, got '-1s'",
        "slo.availability: must be a percentage like 99.9% or a fraction in (0, 1], got '150%'",
    ]


def test_bad_chain_name_and_tier() -> None:
    doc = chain_with(model("a"), name="my chain", tier="fast")
    problems = problems_of(doc)
    assert problems[0].startswith("name: 'my chain' is not a valid identifier")
    assert problems[1] == "tier: unknown value 'fast'; valid: realtime, standard, batch"


def test_all_problems_are_reported_together() -> None:
    doc = chain_with(
        model("a", timeout="-1s", depends_on=["b"]),
        {"id": "b", "type": "tool_call", "depends_on": ["a"], "toool": "x"},
    )
    problems = problems_of(doc)
    assert problems == [
        "node 'a': timeout: must be a positive duration like 500ms, 3s or 1m, got '-1s'",
        "node 'b': unknown key 'toool' (did you mean 'tool'?)",
        "node 'b': tool: a tool_call node needs a 'tool'",
        "node 'a': depends_on: dependency cycle a -> b -> a",
    ]


def test_error_is_invalid_argument_with_newline_joined_message() -> None:
    with pytest.raises(InvalidArgument) as info:
        load(chain_with(model("a", depends_on=["a", "zz"])))
    error = info.value
    assert isinstance(error, ChainConfigError)
    assert error.message == "\n".join(error.problems) and len(error.problems) == 2


# --------------------------------------------------------------------------- templates & inputs


def test_template_reference_to_undeclared_input() -> None:
    doc = chain_with(model("a", prompt="{{ inputs.questoin }}"), inputs=["question"])
    assert problems_of(doc) == [
        "node 'a': prompt: unknown input 'questoin' (did you mean 'question'?); declared inputs: question"
    ]


def test_inputs_are_implicit_when_none_are_declared() -> None:
    doc = chain_with(
        model("a", prompt="{{ inputs.question }} {{ inputs.user }}"),
        tool("b", arguments={"q": "{{ inputs.question }}"}),
    )
    config = load(doc).config
    assert list(required_inputs(config)) == ["question", "user"]
    assert all(spec.required for spec in required_inputs(config).values())


def test_declared_inputs_forms_and_required_inputs() -> None:
    doc = chain_with(
        model("a", prompt="{{ inputs.q }} {{ inputs.lang }}"),
        inputs={
            "q": {"description": "the question"},
            "lang": {"default": "en"},
            "opt": {"required": False},
        },
    )
    config = load(doc).config
    assert config.inputs["q"] == InputSpec(required=True, description="the question")
    assert list(required_inputs(config)) == ["q"]  # defaulted and optional inputs are not
    listed = load(chain_with(model("a"), inputs=["q", "r"])).config
    assert list(listed.inputs) == ["q", "r"] and list(required_inputs(listed)) == ["q", "r"]


def test_bad_input_names() -> None:
    (problem,) = problems_of(chain_with(model("a"), inputs=["ok", "not-ok"]))
    assert problem.startswith("inputs: invalid input name(s) 'not-ok'")
    (problem,) = problems_of(chain_with(model("a"), inputs=["q", "q"]))
    assert problem == "inputs: input 'q' is listed twice"


def test_template_reference_to_unknown_node() -> None:
    doc = chain_with(model("intent"), tool("b", arguments={"q": "{{ nodes.itent.output }}"}))
    assert problems_of(doc) == [
        "node 'b': arguments.q: references unknown node 'itent' (did you mean 'intent'?)"
    ]


def test_template_reference_to_node_that_is_not_upstream() -> None:
    doc = chain_with(model("a"), model("b", prompt="{{ nodes.a.output }}"))
    assert problems_of(doc) == [
        "node 'b': prompt: references node 'a', which is not upstream of this node (add it to depends_on)"
    ]


def test_template_reference_to_transitive_upstream_is_fine() -> None:
    doc = chain_with(
        model("a"),
        model("b", depends_on=["a"]),
        model("c", depends_on=["b"], prompt="{{nodes.a.output}}"),
    )
    assert load(doc).warnings == []


def test_template_reference_to_own_output() -> None:
    assert problems_of(chain_with(model("a", prompt="{{ nodes.a.output }}"))) == [
        "node 'a': prompt: a node cannot use its own output"
    ]


def test_bad_template_expression_in_a_node() -> None:
    (problem,) = problems_of(chain_with(model("a", prompt="{{ input.q }}")))
    assert problem.startswith("node 'a': prompt: bad template expression '{{ input.q }}'")


# --------------------------------------------------------------------------- SLO and warnings


def slow_chain() -> dict[str, Any]:
    doc = seed_doc()
    doc["agent_chain"]["slo"]["end_to_end_latency_p99"] = "3000ms"
    return doc


SLO_MESSAGE = (
    "critical path intent_recognition -> response_generation takes up to 3500ms of timeouts, "
    "more than the 3000ms SLO"
)


def test_slo_exceeded_is_a_warning_by_default() -> None:
    assert load(slow_chain()).warnings == [SLO_MESSAGE]


def test_slo_exceeded_is_an_error_when_strict() -> None:
    assert problems_of(slow_chain(), strict=True) == [SLO_MESSAGE]
    assert load(seed_doc(), strict=True).warnings == []  # 3500ms fits in 5000ms


def test_keys_the_node_type_ignores_are_warnings() -> None:
    doc = chain_with(tool("t", prompt="hi", max_tokens=5))
    assert load(doc).warnings == [
        "node 't': max_tokens: ignored for tool_call nodes",
        "node 't': prompt: ignored for tool_call nodes",
    ]
    assert len(problems_of(doc, strict=True)) == 2


def test_validate_chain_checks_a_programmatic_config() -> None:
    config = ChainConfig(
        name="c",
        slo=SloSpec(end_to_end_latency_p99="1s"),
        nodes=[
            NodeSpec(id="a", type="model_inference", model="m", timeout="800ms", depends_on=["b"]),
            NodeSpec(id="b", type="model_inference", model="m", timeout="800ms", depends_on=["a"]),
        ],
    )
    with pytest.raises(ChainConfigError, match="dependency cycle a -> b -> a"):
        validate_chain(config)
    with pytest.raises(ChainConfigError, match="dependency cycle"):
        topological_order(config)
    fine = config.model_copy(update={"nodes": [config.nodes[0].model_copy(update={"depends_on": []})]})
    assert validate_chain(fine) == []


def test_topological_order_keeps_file_order_among_ready_nodes() -> None:
    doc = chain_with(model("z"), model("y", depends_on=["z"]), model("x"), model("w", depends_on=["x"]))
    assert topological_order(load(doc).config) == ["z", "y", "x", "w"]
    assert sinks(load(doc).config) == ["y", "w"]


# --------------------------------------------------------------------------- normalised form


def rich_chain() -> dict[str, Any]:
    return chain_with(
        {
            "id": "mem",
            "type": "memory_retrieval",
            "limit": 3,
            "arguments": {"session": "{{ inputs.sid }}"},
        },
        tool(
            "search",
            timeout="1.5s",
            cacheable=True,
            cache_ttl="2m",
            arguments={"q": "{{inputs.q}}"},
        ),
        model(
            "gen",
            depends_on=["mem", "search"],
            prompt="{{ nodes.mem.output }} {{ nodes.search.output }} {{ inputs.q }}",
            fallback_model="small",
            temperature=0.7,
            max_context_tokens=4096,
            retries=2,
            idempotent=False,
            critical=False,
            priority="medium",
        ),
        description="rich",
        tier="realtime",
        inputs={"q": {"description": "question"}, "sid": {"required": False, "default": "anon"}},
    )


@pytest.mark.parametrize("make", [seed_doc, rich_chain])
def test_normalised_form_round_trips(make: Any) -> None:
    config = load(make()).config
    document = config.to_document()
    again = load_chain_text(yaml.safe_dump(document, sort_keys=False)).config
    assert again == config
    assert again.to_document() == document


def test_normalised_form_uses_seed_key_names_and_duration_strings() -> None:
    document = load(rich_chain()).config.to_document()
    chain = document["agent_chain"]
    assert chain["slo"] == {"end_to_end_latency_p99": "600000ms", "availability": 0.999}
    search = chain["nodes"][1]
    assert (search["timeout"], search["cache_ttl"]) == ("1500ms", "120000ms")
    assert "max_tokens" not in search and "prompt" not in search  # not used by tool nodes
    assert chain["nodes"][0]["tool"] == "session_memory"
    assert chain["inputs"]["sid"] == {"required": False, "description": "", "default": "anon"}


def test_json_schema_describes_the_document_form() -> None:
    schema = ChainConfig.json_schema()
    assert isinstance(schema, dict) and "agent_chain" in schema["properties"]
    assert schema["required"] == ["agent_chain"]
    text = json.dumps(schema)  # serialisable, and every $ref resolves at the root
    for ref in {part.split('"')[0] for part in text.split('"$ref": "#/$defs/')[1:]}:
        assert ref in schema["$defs"]
    node = schema["$defs"]["NodeSpec"]["properties"]
    assert "timeout" in node and "timeout_ms" not in node


# --------------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("value", "ms"),
    [("500ms", 500), ("3s", 3000), ("1.5s", 1500), ("2m", 120_000), ("1h", 3_600_000),
     (250, 250), (0.5, 0.5), (" 7 ms ", 7), ("42", 42)],
)  # fmt: skip
def test_parse_duration_ms(value: Any, ms: float) -> None:
    assert parse_duration_ms(value) == ms


@pytest.mark.parametrize("value", ["-3s", "0s", 0, -1, "abc", "", None, True, float("inf"), "3d"])
def test_parse_duration_ms_rejects(value: Any) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration_ms(value, what="timeout")
    assert str(info.value) == f"timeout must be a positive duration like 500ms, 3s or 1m, got {value!r}"
    assert isinstance(info.value, ValueFormatError)


@pytest.mark.parametrize("ms", [500.0, 1500.0, 0.25, 1e20, 123.456])
def test_format_duration_round_trips(ms: float) -> None:
    assert parse_duration_ms(format_duration_ms(ms)) == ms


@pytest.mark.parametrize(("value", "fraction"), [("99.9%", 0.999), ("100%", 1.0), (0.95, 0.95), (1, 1.0)])
def test_parse_availability(value: Any, fraction: float) -> None:
    assert parse_availability(value) == fraction


@pytest.mark.parametrize("value", ["150%", "0%", 0, 99.9, "abc", True, -0.5])
def test_parse_availability_rejects(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^availability must be a percentage like 99\.9%"):
        parse_availability(value)


def test_non_string_keys_are_reported_where_they_are() -> None:
    doc = "agent_chain:\n  name: x\n  slo: {end_to_end_latency_p99: 1s}\n  nodes:\n"
    doc += "    - {id: a, type: tool_call, tool: t, 1: 2}\n"
    assert problems_of(doc) == ["node 'a': keys must be strings, got 1"]


def test_a_model_node_takes_stop_sequences() -> None:
    config = load(chain_with(model("a", stop=["\nObservation:", "END"]))).config
    assert config.nodes[0].stop == ["\nObservation:", "END"]
    assert load(chain_with(model("b"))).config.nodes[0].stop == []
