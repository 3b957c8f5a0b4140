"""`inferx bench --overhead`: the pure arithmetic (percentiles, per-hop figures,
marginal and fixed costs), the chains it stores, and clear errors for bad flags."""

from __future__ import annotations

import math

import pytest

from inferx.bench.overhead import (
    DIRECT,
    PathSamples,
    chain_name,
    chain_yaml,
    summarize,
    summarize_path,
)
from inferx.chain.validate import load_chain_text
from inferx.cli.main import main


def samples(name: str, hops: int, latencies: list[float], **load) -> PathSamples:
    return PathSamples(name, hops, latencies, **load)


def test_percentiles_are_nearest_rank_and_the_rates_come_from_the_closed_loop() -> None:
    # 100 samples 1..100 ms: nearest-rank P50 = 50, P99 = 99 (linear would give 50.5, 99.01).
    direct = summarize_path(
        samples(DIRECT, 1, [float(v) for v in range(100, 0, -1)], load_calls=500, load_wall_s=2.0)
    )
    assert (direct.p50_ms, direct.p99_ms) == (50.0, 99.0)
    assert direct.calls_per_s == direct.hops_per_s == 250.0
    assert math.isnan(direct.added_per_hop_p50_ms) and math.isnan(direct.added_per_hop_p99_ms)


def test_per_hop_and_added_latency_against_the_direct_call() -> None:
    direct = summarize_path(samples(DIRECT, 1, [1.0] * 10, load_calls=10, load_wall_s=1.0))
    chain = summarize_path(
        samples("4-hop", 4, [20.0] * 9 + [40.0] * 1, load_calls=50, load_wall_s=2.0, load_errors=2, errors=1),
        direct,
    )
    assert (chain.p50_ms, chain.p99_ms) == (20.0, 40.0)
    assert (chain.per_hop_p50_ms, chain.per_hop_p99_ms) == (5.0, 10.0)
    assert (chain.added_per_hop_p50_ms, chain.added_per_hop_p99_ms) == (4.0, 9.0)
    assert chain.calls_per_s == 25.0 and chain.hops_per_s == 100.0
    assert chain.errors == 3 and chain.samples == 10


def test_marginal_hop_and_fixed_run_cost_from_the_1_hop_and_longest_chain() -> None:
    summary = summarize(
        [
            samples(DIRECT, 1, [1.0], load_calls=1, load_wall_s=1.0),
            samples("1-hop", 1, [7.0], load_calls=1, load_wall_s=1.0, errors=1),
            samples("4-hop", 4, [22.0], load_calls=1, load_wall_s=1.0),
        ]
    )
    assert [p.name for p in summary.paths] == [DIRECT, "1-hop", "4-hop"]
    assert summary.marginal_hop_p50_ms == 5.0  # (22 - 7) / 3
    assert summary.fixed_chain_p50_ms == 2.0  # 7 - 5
    assert summary.errors == 1


def test_an_outside_clients_paths_are_compared_with_its_own_direct_call() -> None:
    """`--outside` (issue #45): the plain client's chains against the plain client's
    direct call, not the bench's; they are not taken for the marginal hop."""
    summary = summarize(
        [
            samples(DIRECT, 1, [1.0], load_calls=1, load_wall_s=1.0),
            samples("1-hop", 1, [7.0], load_calls=1, load_wall_s=1.0),
            samples("4-hop", 4, [22.0], load_calls=1, load_wall_s=1.0),
            samples(DIRECT, 1, [2.0], load_calls=3, load_wall_s=1.0, client="outside"),
            samples("1-hop batched", 1, [3.0], load_calls=2, load_wall_s=1.0, batched=True, client="outside"),
            samples(
                "4-hop batched", 4, [12.0], load_calls=1, load_wall_s=1.0, batched=True, client="outside"
            ),
        ]
    )
    outside = {p.name: p for p in summary.paths if p.client == "outside"}
    assert outside["direct"].p50_ms == 2.0 and math.isnan(outside["direct"].added_per_hop_p50_ms)
    assert outside["1-hop batched"].added_per_hop_p50_ms == 1.0  # 3 - 2, not 3 - 1
    assert outside["4-hop batched"].added_per_hop_p50_ms == 1.0  # 12 / 4 - 2
    assert outside["4-hop batched"].hops_per_s == 4.0
    assert summary.marginal_hop_p50_ms == 5.0  # the bench's own 1-hop and 4-hop only


def test_a_final_only_path_is_summarized_but_not_taken_for_the_longest_chain() -> None:
    """The final-only path is the N-hop chain with fewer events: it gets its own row, and
    the marginal hop still comes from the chains that send every event."""
    summary = summarize(
        [
            samples(DIRECT, 1, [1.0], load_calls=1, load_wall_s=1.0),
            samples("1-hop", 1, [7.0], load_calls=1, load_wall_s=1.0),
            samples("4-hop", 4, [22.0], load_calls=1, load_wall_s=1.0),
            PathSamples("8-hop final", 8, [30.0], final_only=True, load_calls=2, load_wall_s=1.0),
        ]
    )
    final = summary.paths[-1]
    assert (final.name, final.final_only, final.per_hop_p50_ms, final.hops_per_s) == (
        "8-hop final",
        True,
        3.75,
        16.0,
    )
    assert summary.marginal_hop_p50_ms == 5.0  # (22 - 7) / 3, not from the final-only path


def test_without_a_long_chain_there_is_no_marginal_figure_and_direct_is_required() -> None:
    summary = summarize([samples(DIRECT, 1, [1.0]), samples("1-hop", 1, [3.0])])
    assert math.isnan(summary.marginal_hop_p50_ms) and math.isnan(summary.fixed_chain_p50_ms)
    # No sample and no closed loop: no value rather than a made-up one.
    empty = summarize_path(samples("1-hop", 1, []))
    assert math.isnan(empty.p50_ms) and math.isnan(empty.calls_per_s)
    with pytest.raises(ValueError, match="direct"):
        summarize([samples("1-hop", 1, [3.0])])


@pytest.mark.parametrize("hops", [1, 4])
def test_the_stored_chains_are_valid_sequences_of_one_token_hops(hops: int) -> None:
    config = load_chain_text(chain_yaml(hops), source="overhead").config
    assert config.name == chain_name(hops)
    assert len(config.nodes) == hops
    assert all(node.max_tokens == 1 for node in config.nodes)
    assert [node.depends_on for node in config.nodes] == [[]] + [[f"hop{k}"] for k in range(hops - 1)]


def run_cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    return int(exited.value.code or 0)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--hops", "1"], "--hops must be at least 2"),
        (["--count", "0"], "--count must be at least 1"),
        (["--warmup", "-1"], "--warmup must be 0 or more"),
        (["--concurrency", "0"], "--concurrency must be at least 1"),
        (["--concurrency", "8", "--load-calls", "4"], "--load-calls must be at least --concurrency"),
        (["--speed", "0"], "--speed must be a positive number"),
        (["--timeout", "0"], "--timeout must be positive"),
        (["--outside", "--outside-duration", "0"], "--outside-duration must be a positive number"),
        (["--engine", "vllm"], "drop --engine vllm"),
        (["--router", "127.0.0.1:1"], "drop --router"),
        (["--compare", "round-robin"], "drop --compare"),
        (["--workers", "2"], "drop --workers"),
        (["--policy", "fastest"], "unknown policy 'fastest'"),
    ],
)
def test_bad_flags_are_one_clear_line_before_anything_starts(
    extra: list[str], message: str, tmp_path, capsys
) -> None:
    results = tmp_path / "r.json"
    assert run_cli(["bench", "--overhead", "--results", str(results), *extra]) == 1
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err
    assert captured.err.startswith("inferx: INVALID_ARGUMENT:")
    assert not results.exists()  # refused before the results file (or a stack) was made
