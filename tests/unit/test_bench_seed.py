"""The seed-agent scenario: its chain config validates and has the seed's shape, its
prompts extend each other, and the reusable-prefix hit rate is computed right."""

import math

import pytest

from inferx.bench import seed_agent as sa
from inferx.chain.validate import load_chain_text


def test_chain_config_validates_strictly_and_has_the_seed_shape() -> None:
    config = load_chain_text(sa.chain_yaml(), strict=True).config
    models = [n for n in config.nodes if n.type == "model_inference"]
    tools = [n for n in config.nodes if n.type == "tool_call"]
    assert len(models) == 8 and len(tools) == 7
    assert all(t.cacheable and t.tool == sa.TOOL for t in tools)
    assert all(m.max_tokens == 16 for m in models)
    # A strict sequence: every step waits for the previous step and its lookup.
    assert models[3].depends_on == ["step3", "kb3"] and tools[3].depends_on == ["step4"]


def test_each_prompt_extends_the_previous_one() -> None:
    inputs = {"query": "Where is order 12345?", "topic": "late delivery"}
    outputs = {f"step{k}": f"notes {k}" for k in range(1, 9)}
    outputs |= {f"kb{k}": f"document {k}" for k in range(1, 8)}
    prompts = sa.rendered_prompts(inputs, outputs)
    assert len(prompts) == 8
    for before, after in zip(prompts, prompts[1:], strict=False):
        stable = before[: before.rindex("\nStep ")]  # all but the previous step's header
        assert after.startswith(stable) and len(after) > len(before)
    assert "notes 3" in prompts[3] and "document 3" in prompts[3] and "document 4" not in prompts[3]


def test_queries_repeat_across_runs_on_the_same_topic() -> None:
    plan = sa.arrivals(30, rate_per_s=2.0, seed=1)
    assert len({a.inputs["query"] for a in plan}) == 30
    assert len({a.inputs["topic"] for a in plan}) < 30
    assert all(b.at_s >= a.at_s for a, b in zip(plan, plan[1:], strict=False))


def test_reusable_tokens_is_the_common_prefix_with_the_previous_prompt() -> None:
    prompts = [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 9, 9, 9, 9]]
    assert sa.reusable_tokens(prompts) == [0, 3, 2]
    assert sa.common_prefix([], [1]) == 0


def test_reuse_hit_rate_caps_each_hop_at_its_reusable_tokens() -> None:
    hops = [sa.HopReuse(reusable=100, cached=96), sa.HopReuse(reusable=200, cached=0)]
    assert sa.reuse_hit_rate(hops) == pytest.approx(96 / 300)
    # Cache hits beyond the shared prefix (e.g. the previous completion's blocks)
    # do not count: the rate cannot pass 100%.
    assert sa.reuse_hit_rate([sa.HopReuse(100, 130)]) == pytest.approx(1.0)
    assert math.isnan(sa.reuse_hit_rate([sa.HopReuse(0, 0)]))
