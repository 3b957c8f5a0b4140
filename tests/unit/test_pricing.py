"""Cost arithmetic and keeping a run within slo.max_cost (inferx.pricing)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferx.errors import FailedPrecondition, InvalidArgument
from inferx.pricing import (
    FALLBACK_MODEL,
    PRIMARY,
    SKIPPED,
    NodeCost,
    OverBudget,
    Price,
    format_cost,
    hop_cost,
    least_cost,
    parse_price,
    plan_within,
    step_within,
)


def test_hop_cost_prices_uncached_cached_output_and_gpu_time() -> None:
    price = Price(prompt_per_1k=1.0, cached_per_1k=0.1, output_per_1k=2.0, gpu_second=0.5)
    cost = hop_cost(price, prompt_tokens=1000, cached_prompt_tokens=400, completion_tokens=500, gpu_seconds=2)
    assert cost == pytest.approx(0.6 + 0.04 + 1.0 + 1.0)


def test_cached_tokens_cost_as_prompt_tokens_without_a_cached_price() -> None:
    price = Price(prompt_per_1k=1.0)
    assert hop_cost(price, prompt_tokens=1000, cached_prompt_tokens=1000) == pytest.approx(1.0)
    assert Price().free and not price.free


def test_parse_price_round_trips_and_names_bad_fields() -> None:
    price = Price(prompt_per_1k=0.5, cached_per_1k=0.05, output_per_1k=1.5, gpu_second=0.001)
    assert parse_price(price.to_json()) == price
    assert parse_price("{}") == Price()
    with pytest.raises(InvalidArgument, match="prompt_per_1k: must be a finite number >= 0"):
        parse_price({"prompt_per_1k": -1})
    with pytest.raises(InvalidArgument, match="output_per_1k: must be a number"):
        parse_price({"output_per_1k": "cheap"})
    with pytest.raises(InvalidArgument, match="gpu_second: must be a finite"):
        parse_price({"gpu_second": math.inf})
    with pytest.raises(InvalidArgument, match="unknown field 'prompt'"):
        parse_price({"prompt": 1})
    with pytest.raises(InvalidArgument, match="not JSON"):
        parse_price("{")


def test_plan_keeps_everything_when_it_fits() -> None:
    nodes = [NodeCost("a", 1.0, 0.5), NodeCost("b", 1.0, skippable=True)]
    plan = plan_within("c", nodes, 2.0)
    assert plan.choices == {"a": PRIMARY, "b": PRIMARY} and plan.estimate == 2.0


def test_plan_takes_fallback_models_before_skipping() -> None:
    nodes = [NodeCost("a", 1.0, 0.2), NodeCost("b", 1.0, skippable=True)]
    plan = plan_within("c", nodes, 1.5)
    assert plan.choices == {"a": FALLBACK_MODEL, "b": PRIMARY}
    plan = plan_within("c", nodes, 0.5)
    assert plan.choices == {"a": FALLBACK_MODEL, "b": SKIPPED}
    assert plan.estimate == pytest.approx(0.2)


def test_plan_refuses_a_run_that_cannot_fit_naming_the_budget() -> None:
    with pytest.raises(
        OverBudget, match=r"chain 'c' would cost at least 0\.8 .*slo\.max_cost 0\.5"
    ) as caught:
        plan_within("c", [NodeCost("a", 1.0, 0.8)], 0.5)
    assert isinstance(caught.value, FailedPrecondition)


def test_a_fallback_dearer_than_the_model_is_never_taken() -> None:
    plan = plan_within("c", [NodeCost("a", 1.0, 2.0), NodeCost("b", 1.0, skippable=True)], 1.0)
    assert plan.choices == {"a": PRIMARY, "b": SKIPPED}


def test_format_cost() -> None:
    assert format_cost(0) == "0"
    assert format_cost(1.5) == "1.5"
    assert format_cost(0.000123) == "0.000123"


costs = st.floats(min_value=0, max_value=100, allow_nan=False)
node_costs = st.lists(
    st.tuples(costs, st.one_of(st.none(), costs), st.booleans()), min_size=0, max_size=8
).map(lambda rows: [NodeCost(f"n{i}", p, f, s) for i, (p, f, s) in enumerate(rows)])


@given(node_costs, costs)
def test_plan_fits_exactly_when_the_least_cost_does(nodes: list[NodeCost], max_cost: float) -> None:
    least = least_cost(nodes)
    if least > max_cost:
        with pytest.raises(OverBudget):
            plan_within("c", nodes, max_cost)
        return
    plan = plan_within("c", nodes, max_cost)
    assert plan.estimate <= max_cost + 1e-9
    for node in nodes:
        choice = plan.choice(node.node_id)
        assert choice != SKIPPED or node.skippable
        assert choice != FALLBACK_MODEL or (node.fallback is not None and node.fallback < node.primary)
    if sum(n.primary for n in nodes) <= max_cost:
        assert set(plan.choices.values()) <= {PRIMARY}


@given(
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.floats(0, 1e4),
    st.floats(0, 10),
    st.floats(0, 10),
)
def test_cost_is_monotone_in_usage_and_caching_never_costs_more_when_cheaper(
    prompt: int, cached: int, out: int, gpu_s: float, rate: float, cached_rate: float
) -> None:
    price = Price(
        prompt_per_1k=rate, cached_per_1k=min(cached_rate, rate), output_per_1k=rate, gpu_second=rate
    )
    base = hop_cost(price, prompt_tokens=prompt, completion_tokens=out, gpu_seconds=gpu_s)
    assert base >= 0
    assert (
        hop_cost(
            price, prompt_tokens=prompt, cached_prompt_tokens=cached, completion_tokens=out, gpu_seconds=gpu_s
        )
        <= base + 1e-9
    )
    assert hop_cost(price, prompt_tokens=prompt + 1, completion_tokens=out, gpu_seconds=gpu_s) >= base


def test_step_within_what_is_left() -> None:
    assert step_within(1.0, 0.5, None, skippable=False) == PRIMARY
    assert step_within(1.0, 2.0, 0.5, skippable=True) == FALLBACK_MODEL
    assert step_within(1.0, 2.0, 1.5, skippable=True) == SKIPPED
    assert step_within(1.0, 2.0, 1.5, skippable=False) == PRIMARY  # critical: runs, misses its cost SLO
    assert step_within(-1.0, 0.0, None, skippable=False) == PRIMARY


@given(node_costs, costs)
def test_plan_estimates_add_up(nodes: list[NodeCost], max_cost: float) -> None:
    if least_cost(nodes) > max_cost:
        return
    plan = plan_within("c", nodes, max_cost)
    assert sum(plan.estimates.values()) == pytest.approx(plan.estimate)
    assert set(plan.estimates) == {n.node_id for n in nodes}
