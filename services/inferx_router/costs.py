"""A chain run's cost: its model nodes' estimates before it runs (for `slo.max_cost`),
and each hop's cost once it has (inferx.pricing has the arithmetic)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from inferx.chain.plan import LatencyEstimate
from inferx.chain.schema import ChainConfig, NodeSpec
from inferx.pricing import BudgetPlan, NodeCost, Price, estimate_hop_cost, hop_cost, plan_within
from inferx.tokens import estimate_tokens
from inferx.v1 import router_pb2

PriceOf = Callable[[str], Price]  # model -> its pool's price


def prompt_estimate(config: ChainConfig, node: NodeSpec, inputs: Mapping[str, str]) -> int:
    """The node's prompt tokens, estimated before the run: its template (or the default
    prompt's inputs), every input, and all its model dependencies may generate."""
    text = node.prompt or ""
    upstream = sum(
        config.node(dep).max_tokens or 0 for dep in node.depends_on if config.node(dep).kind.is_model
    )
    return estimate_tokens(text) + sum(estimate_tokens(value) for value in inputs.values()) + upstream


def node_costs(
    config: ChainConfig, inputs: Mapping[str, str], price_of: PriceOf, latency: LatencyEstimate
) -> list[NodeCost]:
    rows = []
    for node in config.nodes:
        if not node.kind.is_model:
            continue
        prompt = prompt_estimate(config, node, inputs)
        expected_s = latency.node_ms(config.name, node) / 1000

        def estimate(
            model: str, prompt: int = prompt, node: NodeSpec = node, expected_s: float = expected_s
        ) -> float:
            return estimate_hop_cost(
                price_of(model), prompt_tokens=prompt, max_tokens=node.max_tokens, expected_s=expected_s
            )

        rows.append(
            NodeCost(
                node.id,
                estimate(node.model or ""),
                estimate(node.fallback_model) if node.fallback_model else None,
                skippable=not node.critical,
            )
        )
    return rows


def budget_plan(
    config: ChainConfig, inputs: Mapping[str, str], price_of: PriceOf, latency: LatencyEstimate
) -> BudgetPlan | None:
    """The run's plan within slo.max_cost (None without one); OverBudget when none fits."""
    if config.slo.max_cost is None:
        return None
    return plan_within(config.name, node_costs(config, inputs, price_of, latency), config.slo.max_cost)


def cost_of_hop(price: Price, result: router_pb2.NodeFinished, worker_s: float) -> float:
    usage = result.usage
    return hop_cost(
        price,
        prompt_tokens=usage.prompt_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        completion_tokens=usage.completion_tokens,
        gpu_seconds=worker_s,
    )
