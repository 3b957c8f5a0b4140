"""ChainPlan: the graph facts of a chain version, and the expected remaining path."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferx.chain.plan import TIMEOUTS, ChainPlan, LearnedLatency
from inferx.chain.validate import load_chain_text

ROOT = Path(__file__).resolve().parents[2]

FAN_OUT = """
agent_chain:
  name: fan
  slo: {end_to_end_latency_p99: 60s}
  nodes:
    - {id: plan, type: model_inference, model: small, timeout: 1s}
    - {id: search_a, type: tool_call, tool: web, timeout: 2s, depends_on: [plan]}
    - {id: search_b, type: tool_call, tool: web, timeout: 5s, depends_on: [plan]}
    - {id: recall, type: memory_retrieval, timeout: 1s, depends_on: [search_a]}
    - {id: write, type: model_inference, model: big, timeout: 10s, depends_on: [recall, search_b]}
    - {id: check, type: model_inference, model: small, timeout: 1s, depends_on: [plan]}
"""


def plan_of(text: str) -> ChainPlan:
    return load_chain_text(text).plan


def test_example_chain_remaining_paths_are_timeouts_without_history() -> None:
    config = load_chain_text(
        (ROOT / "examples" / "chains" / "customer_service_agent.yaml").read_text()
    ).config
    plan = ChainPlan.build(config)
    assert plan.remaining_paths_ms(TIMEOUTS) == {
        "intent_recognition": 3500,
        "knowledge_retrieval": 3300,
        "response_generation": 3000,
    }
    assert plan.sinks == ("response_generation",)
    assert plan.model_hops == 2


def test_fan_out_graph_facts() -> None:
    plan = plan_of(FAN_OUT)
    assert plan.order == ("plan", "search_a", "search_b", "recall", "write", "check")
    assert plan.dependents["plan"] == ("search_a", "search_b", "check")
    assert plan.sinks == ("write", "check")
    # Tool and memory nodes are passed through: the next model hops after `plan` are
    # `write` (through both searches, listed once) and `check`.
    assert plan.next_model_hops["plan"] == ("write", "check")
    assert plan.next_model_hops["search_b"] == ("write",)
    assert plan.next_model_hops["write"] == ()
    assert plan.model_hops == 3
    # The longest path from `plan` goes through search_b (5 s), not search_a + recall (3 s).
    assert plan.remaining_path_ms("plan") == 1000 + 5000 + 10000
    assert plan.critical_path() == (["plan", "search_b", "write"], 16000.0)


def test_learned_latency_replaces_timeouts_once_there_is_history() -> None:
    plan = plan_of(FAN_OUT)
    learned = LearnedLatency(alpha=0.5, min_samples=2)
    learned.observe("fan", "search_b", 100.0)
    # One sample is not history yet: the timeout still stands in.
    assert plan.remaining_path_ms("search_b", learned) == 5000 + 10000
    learned.observe("fan", "search_b", 300.0)
    for node, ms in (("write", 2000.0), ("write", 2000.0), ("plan", 50.0), ("plan", 50.0)):
        learned.observe("fan", node, ms)
    assert learned.node_ms("fan", plan.node("search_b")) == pytest.approx(200.0)
    # search_b is now fast, so the longest path from `plan` runs through search_a (2 s
    # timeout) and recall (1 s timeout), which have no history.
    assert plan.remaining_path_ms("plan", learned) == pytest.approx(50 + 2000 + 1000 + 2000)
    # Another chain with a node of the same id learns separately.
    assert learned.node_ms("other", plan.node("search_b")) == 5000


def test_learned_latency_is_capped_by_the_timeout_and_bounded_in_size() -> None:
    plan = plan_of(FAN_OUT)
    learned = LearnedLatency(min_samples=1, max_nodes=2)
    learned.observe("fan", "write", 99_999.0)
    assert learned.node_ms("fan", plan.node("write")) == 10_000  # never above its timeout
    learned.observe("fan", "plan", 10.0)
    assert learned.node_ms("fan", plan.node("plan")) == 10.0
    learned.observe("fan", "check", 5.0)  # a third node: the oldest (`write`) is forgotten
    learned.observe("fan", "plan", 10.0)
    assert learned.node_ms("fan", plan.node("check")) == 5.0
    assert learned.node_ms("fan", plan.node("plan")) == 10.0
    learned.observe("fan", "write", 20.0)  # `write` again: now `plan` (oldest) goes
    assert learned.node_ms("fan", plan.node("plan")) == 1000
    with pytest.raises(ValueError):
        LearnedLatency(alpha=0)
