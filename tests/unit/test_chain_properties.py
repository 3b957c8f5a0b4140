"""Property tests: random valid DAGs always load; targeted mutations are always rejected."""

from __future__ import annotations

import copy
import itertools
import json
import re
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferx.chain import (
    ChainConfigError,
    critical_path,
    load_chain_text,
    parse_duration_ms,
    topological_order,
    upstream,
)

FAST = settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Generated ids are lowercase, so these can never collide with a real node.
MISSING = "ZZ_missing"

node_ids = st.lists(
    st.from_regex(r"[a-z][a-z0-9_.-]{0,7}", fullmatch=True), min_size=1, max_size=8, unique=True
)
input_names = st.lists(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True), max_size=3, unique=True)
durations = st.one_of(
    st.integers(1, 5_000),
    st.integers(1, 5_000).map(lambda n: f"{n}ms"),
    st.integers(1, 60).map(lambda n: f"{n / 10}s"),
    st.integers(1, 3).map(lambda n: f"{n}m"),
)


@st.composite
def chains(draw: st.DrawFn) -> dict[str, Any]:
    """A valid chain document: deps only on earlier nodes, templates only on upstream ones."""
    ids = draw(node_ids)
    inputs = draw(input_names)
    declare_inputs = bool(inputs) and draw(st.booleans())
    deps_of: dict[str, list[str]] = {}
    nodes = []
    for index, node_id in enumerate(ids):
        earlier = ids[:index]
        deps = draw(st.lists(st.sampled_from(earlier), unique=True, max_size=3)) if earlier else []
        deps_of[node_id] = deps
        # Templates may use any transitive upstream node, not only direct deps.
        before = sorted(_closure(deps_of, node_id))
        used_nodes = draw(st.lists(st.sampled_from(before), max_size=2)) if before else []
        used_inputs = draw(st.lists(st.sampled_from(inputs), max_size=2)) if inputs else []
        refs = [f"{{{{ nodes.{ref}.output }}}}" for ref in used_nodes]
        refs += [f"{{{{inputs.{name}}}}}" for name in used_inputs]
        template = "ctx: " + " ".join(refs)
        kind = draw(st.sampled_from(["model_inference", "tool_call", "memory_retrieval"]))
        node: dict[str, Any] = {"id": node_id, "type": kind, "timeout": draw(durations)}
        if len(deps) > 0 or draw(st.booleans()):
            node["depends_on"] = deps
        node["priority"] = draw(st.sampled_from(["high", "medium", "normal", "low"]))
        if kind == "model_inference":
            node.update(model=draw(st.sampled_from(["qwen-7b", "qwen-72b"])), prompt=template)
            node["max_tokens"] = draw(st.integers(1, 512))
        else:
            if kind == "tool_call" or draw(st.booleans()):
                node["tool"] = draw(st.sampled_from(["vector_search", "web"]))
            node["arguments"] = {"query": template}
            node["cacheable"] = draw(st.booleans())
        nodes.append(node)
    chain: dict[str, Any] = {
        "name": draw(st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True)),
        "slo": {"end_to_end_latency_p99": draw(durations), "availability": "99.9%"},
        "nodes": nodes,
    }
    if declare_inputs:
        chain["inputs"] = inputs
    return {"agent_chain": chain}


def _closure(deps: dict[str, list[str]], node_id: str) -> set[str]:
    seen: set[str] = set()
    stack = list(deps.get(node_id, []))
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(deps.get(current, []))
    return seen


def as_text(doc: dict[str, Any], as_json: bool) -> str:
    return json.dumps(doc) if as_json else yaml.safe_dump(doc, sort_keys=False)


def rejected(doc: dict[str, Any], as_json: bool) -> list[str]:
    try:
        load_chain_text(as_text(doc, as_json))
    except ChainConfigError as error:
        return error.problems
    raise AssertionError(f"accepted an invalid chain: {doc}")


def all_path_sums(doc: dict[str, Any]) -> list[float]:
    """Sum of timeouts along every dependency path (brute force, small graphs only)."""
    nodes = doc["agent_chain"]["nodes"]
    timeout = {n["id"]: parse_duration_ms(n["timeout"]) for n in nodes}
    dependents = {n["id"]: [m["id"] for m in nodes if n["id"] in m.get("depends_on", [])] for n in nodes}

    def walk(node_id: str, total: float) -> list[float]:
        total += timeout[node_id]
        return [total] + list(itertools.chain.from_iterable(walk(d, total) for d in dependents[node_id]))

    return [total for n in nodes for total in walk(n["id"], 0.0)]


@FAST
@given(doc=chains(), as_json=st.booleans(), data=st.data())
def test_valid_chains_are_accepted(doc: dict[str, Any], as_json: bool, data: Any) -> None:
    # Listing order is free: shuffle so file order is not already a topological order.
    nodes = data.draw(st.permutations(doc["agent_chain"]["nodes"]))
    doc["agent_chain"]["nodes"] = nodes
    config = load_chain_text(as_text(doc, as_json)).config
    order = topological_order(config)
    assert sorted(order) == sorted(n["id"] for n in nodes)
    position = {node_id: index for index, node_id in enumerate(order)}
    for node in nodes:
        for dep in node.get("depends_on", []):
            assert position[dep] < position[node["id"]]
            assert dep in upstream(config, node["id"])


@FAST
@given(doc=chains())
def test_critical_path_is_the_longest_dependency_path(doc: dict[str, Any]) -> None:
    config = load_chain_text(json.dumps(doc)).config
    path, total = critical_path(config)
    # Sums of float milliseconds (timeouts like "1.1s"): equal up to rounding.
    assert total == pytest.approx(max(all_path_sums(doc)))
    assert total == pytest.approx(sum(config.node(node_id).timeout_ms for node_id in path))
    for before, after in itertools.pairwise(path):
        assert before in config.node(after).depends_on
    # The SLO check agrees with the critical path: strict loading fails exactly when it is exceeded.
    try:
        load_chain_text(json.dumps(doc), strict=True)
        assert total <= config.slo.latency_p99_ms
    except ChainConfigError as error:
        assert total > config.slo.latency_p99_ms
        assert error.problems[0].startswith(f"critical path {' -> '.join(path)} takes up to")


@FAST
@given(doc=chains(), as_json=st.booleans(), data=st.data())
def test_round_trip_through_the_normalised_form(doc: dict[str, Any], as_json: bool, data: Any) -> None:
    config = load_chain_text(as_text(doc, as_json)).config
    assert load_chain_text(as_text(config.to_document(), data.draw(st.booleans()))).config == config


@FAST
@given(doc=chains(), as_json=st.booleans(), data=st.data())
def test_back_edge_makes_a_reported_cycle(doc: dict[str, Any], as_json: bool, data: Any) -> None:
    nodes = doc["agent_chain"]["nodes"]
    if len(nodes) == 1:
        nodes.append({"id": nodes[0]["id"] + "x", "type": "tool_call", "tool": "t"})
    first, second = sorted(
        data.draw(st.lists(st.integers(0, len(nodes) - 1), min_size=2, max_size=2, unique=True))
    )
    # second runs after first, then first is made to depend on second: a cycle.
    nodes[second].setdefault("depends_on", [])
    if nodes[first]["id"] not in nodes[second]["depends_on"]:
        nodes[second]["depends_on"].append(nodes[first]["id"])
    nodes[first].setdefault("depends_on", []).append(nodes[second]["id"])
    cycles = [p for p in rejected(doc, as_json) if "dependency cycle" in p]
    assert cycles
    for problem in cycles:
        found = re.search(r"dependency cycle (.+)$", problem)
        assert found is not None, problem
        ring = found.group(1).split(" -> ")
        assert ring[0] == ring[-1] and problem.startswith(f"node '{ring[0]}': depends_on: ")
        deps = {n["id"]: n.get("depends_on", []) for n in nodes}
        for before, after in itertools.pairwise(ring):
            assert before in deps[after]  # printed in run order: "a -> b" means b depends on a


@FAST
@given(doc=chains(), as_json=st.booleans(), data=st.data())
def test_missing_dependency_is_reported(doc: dict[str, Any], as_json: bool, data: Any) -> None:
    node = data.draw(st.sampled_from(doc["agent_chain"]["nodes"]))
    node.setdefault("depends_on", []).append(MISSING)
    assert f"node '{node['id']}': depends_on: unknown node '{MISSING}'" in rejected(doc, as_json)


@FAST
@given(doc=chains(), as_json=st.booleans(), data=st.data())
def test_template_reference_to_missing_node_is_reported(
    doc: dict[str, Any], as_json: bool, data: Any
) -> None:
    node = data.draw(st.sampled_from(doc["agent_chain"]["nodes"]))
    field = "prompt" if node["type"] == "model_inference" else "arguments.query"
    reference = f" {{{{ nodes.{MISSING}.output }}}}"
    if field == "prompt":
        node["prompt"] += reference
    else:
        node["arguments"]["query"] += reference
    expected = f"node '{node['id']}': {field}: references unknown node '{MISSING}'"
    assert expected in rejected(doc, as_json)


@FAST
@given(doc=chains(), as_json=st.booleans(), data=st.data())
def test_duplicate_id_is_reported(doc: dict[str, Any], as_json: bool, data: Any) -> None:
    nodes = doc["agent_chain"]["nodes"]
    copied = copy.deepcopy(data.draw(st.sampled_from(nodes)))
    copied.pop("depends_on", None)  # the copy must not add a cycle or a bad reference
    copied.pop("prompt", None)
    copied.pop("arguments", None)
    nodes.append(copied)
    expected = f"node '{copied['id']}' (nodes[{len(nodes) - 1}]): id: duplicate node id"
    assert any(problem.startswith(expected) for problem in rejected(doc, as_json))


@FAST
@given(doc=chains(), as_json=st.booleans(), data=st.data())
def test_model_node_without_model_is_reported(doc: dict[str, Any], as_json: bool, data: Any) -> None:
    node = data.draw(st.sampled_from(doc["agent_chain"]["nodes"]))
    node["type"] = "model_inference"
    node.pop("model", None)
    node.pop("tool", None)
    node.pop("cacheable", None)
    if "arguments" in node:
        node["prompt"] = node.pop("arguments")["query"]
    expected = f"node '{node['id']}': model: a model_inference node needs a 'model'"
    assert expected in rejected(doc, as_json)


@FAST
@given(doc=chains(), as_json=st.booleans(), data=st.data(), amount=st.integers(0, 9_999))
def test_non_positive_timeout_is_reported(doc: dict[str, Any], as_json: bool, data: Any, amount: int) -> None:
    node = data.draw(st.sampled_from(doc["agent_chain"]["nodes"]))
    node["timeout"] = data.draw(st.sampled_from([-amount, f"-{amount}ms", f"-{amount}s", 0, "0s"]))
    expected = f"node '{node['id']}': timeout: must be a positive duration like 500ms, 3s or 1m, got "
    assert any(problem.startswith(expected) for problem in rejected(doc, as_json))


@FAST
@given(doc=chains(), as_json=st.booleans(), data=st.data())
def test_independent_problems_are_all_reported(doc: dict[str, Any], as_json: bool, data: Any) -> None:
    nodes = doc["agent_chain"]["nodes"]
    bad_timeout = data.draw(st.sampled_from(nodes))
    bad_timeout["timeout"] = "-1s"
    bad_dep = data.draw(st.sampled_from(nodes))
    bad_dep.setdefault("depends_on", []).append(MISSING)
    problems = rejected(doc, as_json)
    timeout_problem = "timeout: must be a positive duration like 500ms, 3s or 1m, got '-1s'"
    assert f"node '{bad_timeout['id']}': {timeout_problem}" in problems
    assert f"node '{bad_dep['id']}': depends_on: unknown node '{MISSING}'" in problems
