"""The `coding` workload has the shape of the Copilot coding-agent dataset."""

from __future__ import annotations

import statistics
from collections import Counter

import pytest

from inferx.sim.trace import TraceConfig, generate


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_coding_sessions_have_the_datasets_shape(seed: int) -> None:
    trace = generate(TraceConfig(seed=seed, duration_s=4000, rate_per_s=0.05, mix={"coding": 1.0}))
    chains = trace.chains
    assert len(chains) > 150
    prompts = [c.prompt_tokens(k) for c in chains for k in range(len(c.hops))]
    outputs = [h.output_tokens for c in chains for h in c.hops]
    calls = [len(c.hops) for c in chains]
    assert 60_000 <= statistics.mean(prompts) <= 76_000  # about 68k prompt tokens per call
    assert 18_000 <= min(prompts)  # contexts 20-110k ...
    # ... and no call's prompt and reply pass 110k (calls once crept on past it, 60 tokens
    # each, to prompts longer than the 7B profile's whole KV pool of 111,616 tokens)
    assert max(c.prompt_tokens(k) + h.output_tokens for c in chains for k, h in enumerate(c.hops)) <= 110_000
    assert 450 <= statistics.mean(outputs) <= 620  # about 530 completion tokens
    assert 26 <= statistics.mean(calls) <= 38  # about 4 turns x 8 calls
    delays = sorted(h.delay_after_s for c in chains for h in c.hops[:-1])
    # Heavy-tailed tool time: most tool calls are seconds, some test runs take minutes.
    assert statistics.median(delays) < 10 and delays[int(len(delays) * 0.99)] > 120
    # Tiers are independent of kind: realtime, standard and batch coding sessions.
    assert set(Counter(c.tier for c in chains)) == {"realtime", "standard", "batch"}


def test_a_kind_with_one_tier_keeps_it() -> None:
    trace = generate(
        TraceConfig(seed=1, duration_s=200, rate_per_s=0.2, mix={"coding": 1.0}, tiers={"coding": "batch"})
    )
    assert {c.tier for c in trace.chains} == {"batch"}
