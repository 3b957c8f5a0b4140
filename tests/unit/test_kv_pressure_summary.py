"""The KV-pressure scenario's bookkeeping (benchmarks/kv_pressure.py, seed_run): its
configurations differ only in the scheduler (its policy; the peer without KV
reservations), and a step's reusable tokens that vLLM did not report as cached count
as re-prefilled."""

from __future__ import annotations

from inferx.bench import seed_agent as sa
from inferx.bench import seed_run
from tests.conftest import load_benchmark_script


def test_the_kv_pressure_configurations_differ_only_in_the_scheduler() -> None:
    names = ["kv-session-affinity", "kv-chain-aware", "kv-chain-aware-strict", "kv-chain-aware-hold"]
    configs = [seed_run.CONFIGS[n] for n in names]
    assert all(c["router"] == ["--no-tool-cache"] for c in configs)  # every tool call is a real gap
    assert all(c["worker"] == configs[0]["worker"] for c in configs)
    # the peer as deployed: a sticky router straight in front of the engines (no KV ledger)
    assert configs[0]["scheduler"] == ["--policy", "session-affinity", "--no-reserve-kv"]
    assert configs[1]["scheduler"] == ["--policy", "chain-aware"]
    assert "--strict-holds" in configs[2]["scheduler"]


def test_reusable_tokens_not_found_in_the_cache_count_as_re_prefilled() -> None:
    plan = sa.arrivals(1, 1.0, seed=7)
    outputs = {sa.step_id(k): f"answer {k}" for k in range(1, sa.STEPS + 1)}
    outputs |= {sa.tool_id(k): f"document {k}" for k in range(1, sa.STEPS)}
    tokenize = seed_run.make_tokenizer(seed_run.SeedOptions(engine="sim"))
    ids = [tokenize(p) for p in sa.rendered_prompts(plan[0].inputs, outputs)]
    reusable = sa.reusable_tokens(ids)
    full = seed_run.RunOutcome(status="ok", latency_s=1.0, outputs=outputs, workers=["w"] * sa.STEPS)
    full.prompt_tokens = [len(i) for i in ids]
    full.cached_tokens = list(reusable)  # every shared token found
    half = seed_run.RunOutcome(status="ok", latency_s=1.0, outputs=outputs, workers=["w"] * sa.STEPS)
    half.prompt_tokens = full.prompt_tokens
    half.cached_tokens = [0] + [r // 2 for r in reusable[1:]]
    hit = seed_run.summarize("a", plan, [full], tokenize, 1.0)
    missed = seed_run.summarize("b", plan, [half], tokenize, 1.0)
    assert hit.reusable_tokens == sum(reusable[1:]) > 0
    assert hit.reprefilled_tokens == 0
    assert missed.reprefilled_tokens == sum(r - r // 2 for r in reusable[1:])


def test_the_table_shows_what_the_scheduler_priced_the_engines_with() -> None:
    """The prefill rate is what a held context is worth (a re-prefill's cost), so the
    scenario's table says what the scheduler used, or that it exported nothing."""
    bench = load_benchmark_script("kv_pressure")

    def summary(config: str, engine: dict[str, dict[str, float]] | None) -> seed_run.SeedSummary:
        return seed_run.SeedSummary(
            config=config, chains=1, completed=1, latency_p50_s=1.0, latency_p90_s=1.0, latency_p99_s=1.0,
            reusable_hit_rate=1.0, prefix_hit_rate=1.0, tool_cache_hit_rate=0.0, worker_switches=0.0,
            wall_s=1.0, errors=[], engine=engine,
        )  # fmt: skip

    learned = {"tiny": {"prefill_tokens_per_s": 2_345.6, "kv_read_s_per_token": 4e-7}}
    table = bench.table([summary("kv-session-affinity", None), summary("kv-chain-aware", learned)])
    row = next(line for line in table.splitlines() if line.startswith("| engine priced at"))
    assert row.endswith("| not exported | 2,346 tok/s, 0.400 ms/1k KV |")
