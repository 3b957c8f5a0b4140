"""The live benchmarks, kept short: the trace replay through the scheduler with sim
workers, and the seed-agent scenario with sim workers (the vLLM run is a benchmark,
not a test). No timing is asserted: only what the replay must get exactly right."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from pathlib import Path

import pytest

from inferx.bench import seed_run
from inferx.bench.live import LiveOptions, run_live_sim
from inferx.sim.profile import EngineProfile
from inferx.sim.trace import TraceConfig, generate

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def _no_progress(label: str, total: int):
    yield lambda done: None


def test_trace_replay_sends_every_call_with_the_traces_token_counts(tmp_path: Path) -> None:
    profile = EngineProfile()
    config = TraceConfig(seed=3, duration_s=6.0, rate_per_s=1.0, mix={"bfcl": 1.0})
    trace = generate(config, profile)
    assert 2 <= len(trace.chains) <= 12
    options = LiveOptions(workers=2, speed=20.0, timeout_s=120.0, state_dir=tmp_path)
    runs, errors = asyncio.run(run_live_sim(trace, ["chain-aware"], profile, options, _no_progress))
    (run,) = runs
    assert errors == {"chain-aware": {}}
    for chain, record in zip(trace.chains, run.chains, strict=True):
        assert record.status == "ok", (chain.chain_id, record.status)
        # Every prompt is exactly the trace's size: shared prefix + history + new input.
        assert record.prompt_tokens == sum(chain.prompt_tokens(k) for k in range(len(chain.hops)))
        assert len(record.ttft_s) == len(chain.hops)
        # Call k >= 1 finds at least the earlier calls' whole blocks in the cache.
        assert record.cached_tokens > 0


def test_seed_agent_scenario_on_sim_workers(tmp_path: Path) -> None:
    options = seed_run.SeedOptions(
        engine="sim", workers=2, chains=4, rate_per_s=4.0, tool_median_s=0.01, sim_speed=20.0, timeout_s=120
    )
    summaries = asyncio.run(
        seed_run.run_seed(
            options, ["off", "on"], tmp_path, ROOT / "examples" / "knowledge_base.jsonl", _no_progress, print
        )
    )
    off, on = summaries
    assert off.completed == on.completed == 4, (off.errors, on.errors)
    # off: no prefix caching and no tool cache at all.
    assert off.prefix_hit_rate == 0 and off.tool_cache_hit_rate == 0
    # on: the previous step's prompt is (almost) always found, and repeated queries hit.
    assert on.reusable_hit_rate > 0.9
    assert on.tool_cache_hit_rate > 0
