"""Benchmark reports from small synthetic summaries: every render path (simulated and
live/router tables, the seed-agent table, the JSON form), the comparison's undefined
ratios, the results file written before rendering, and the layering of sim/bench."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from rich.console import Console

from inferx.bench import report
from inferx.bench.metrics import Comparison, Stats, Summary, compare, summarize
from inferx.bench.results import ResultsFile, jsonable, replay_data
from inferx.bench.seed_run import SeedSummary, compare_seed, resolve_configs
from inferx.sim.records import ChainRecord, ReplayResult

ROOT = Path(__file__).resolve().parents[2]
INF = math.inf


def make_stats(**overrides) -> Stats:
    values = dict(
        chains=100,
        completed=100,
        shed=0,
        latency_p50_s=10.0,
        latency_p90_s=20.0,
        latency_p99_s=40.0,
        serving_p50_s=5.0,
        serving_p99_s=30.0,
        slowdown_p50=1.1,
        slowdown_p99=2.0,
        slo_attainment=0.95,
        goodput_per_s=0.9,
        ttft_p50_s=0.1,
        ttft_p99_s=1.5,
        prefix_hit_rate=0.75,
        preemptions=3,
    )
    values.update(overrides)
    return Stats(**values)


def make_summary(policy: str, source: str = "simulator", **overrides) -> Summary:
    overall = make_stats(**overrides)
    return Summary(
        policy=policy,
        source=source,
        workers=4,
        window_s=100.0,
        rate_per_s=1.0,
        makespan_s=130.0,
        wall_s=2.5,
        overall=overall,
        tiers={"realtime": overall, "batch": overall},
    )


def make_seed(config: str, **overrides) -> SeedSummary:
    values = dict(
        config=config,
        chains=10,
        completed=10,
        latency_p50_s=8.0,
        latency_p90_s=12.0,
        latency_p99_s=20.0,
        reusable_hit_rate=0.5,
        prefix_hit_rate=0.45,
        tool_cache_hit_rate=0.0,
        worker_switches=3.5,
        wall_s=60.0,
        errors=[],
    )
    values.update(overrides)
    return SeedSummary(**values)


def render(*things) -> str:
    console = Console(record=True, width=250, highlight=False)
    for thing in things:
        console.print(thing)
    return console.export_text()


def render_with(fn, *args) -> str:
    console = Console(record=True, width=250, highlight=False)
    fn(console, *args)
    return console.export_text()


# ----- every row names a field that exists ------------------------------------------------


def test_every_table_row_names_a_field_of_its_summary() -> None:
    assert {attr for _, attr, _ in report.ROWS} <= set(Stats.model_fields)
    # The seed-agent table once asked SeedSummary for serving time it never had and
    # crashed after 11 minutes of vLLM runs.
    assert {attr for _, attr, _ in report.SEED_ROWS} <= set(SeedSummary.model_fields)


# ----- simulated bench table -------------------------------------------------------------


def test_simulated_report_renders_every_row_and_the_comparison() -> None:
    base = make_summary("round-robin")
    cand = make_summary("chain-aware", latency_p99_s=10.0, goodput_per_s=1.8, slo_attainment=1.0)
    comparison = compare(base, cand)
    text = render_with(report.print_report, [base, cand], comparison, "header line")
    assert "header line" in text
    for label, _, _ in report.ROWS:
        assert label in text
    assert "chain-aware / round-robin" in text and "tier realtime" in text and "tier batch" in text
    assert "P99 ratio 0.25" in text and "goodput ratio 2.00x" in text
    assert "target p99 ratio <= 0.5: met" in text
    assert "target goodput >= 1.5x round-robin: met" in text


# ----- the comparison: a reference that shed chains has no P99 ---------------------------


def test_a_baseline_that_shed_chains_has_no_p99_ratio() -> None:
    base = make_summary("round-robin", shed=2, completed=98, latency_p99_s=INF)
    cand = make_summary("chain-aware", latency_p99_s=100.0)
    comparison = compare(base, cand)
    assert comparison.p99_ratio is None
    assert comparison.baseline_shed == 2
    assert comparison.targets["p99 ratio <= 0.5"] is None
    assert any("round-robin shed 2 chains" in n and "P99 undefined" in n for n in comparison.notes)
    text = render_with(report.print_report, [base, cand], comparison, "h")
    assert "P99 ratio undefined" in text
    assert "round-robin shed 2 chains (of 100); P99 undefined" in text
    assert "target p99 ratio <= 0.5: undefined" in text
    assert "target p99 ratio <= 0.5: met" not in text
    # The JSON form says null, never 0.
    data = report.to_json([base, cand], comparison, {})
    assert data["comparison"]["p99_ratio"] is None
    assert data["comparison"]["targets"]["p99 ratio <= 0.5"] is None


def test_failed_chains_are_named_as_failed_not_shed() -> None:
    base = make_summary("round-robin", completed=97, latency_p99_s=INF)
    comparison = compare(base, make_summary("chain-aware"))
    assert comparison.baseline_failed == 3 and comparison.baseline_shed == 0
    assert any("failed 3 chains" in n for n in comparison.notes)


def test_a_candidate_that_misses_its_p99_does_not_meet_the_target() -> None:
    comparison = compare(make_summary("round-robin"), make_summary("chain-aware", latency_p99_s=INF))
    assert comparison.p99_ratio == INF and comparison.targets["p99 ratio <= 0.5"] is False


def test_no_realtime_chains_and_no_baseline_goodput_are_undefined_targets() -> None:
    base = make_summary("round-robin", goodput_per_s=0.0)
    cand = make_summary("chain-aware")
    cand.tiers.pop("realtime")
    comparison = compare(base, cand)
    assert comparison.goodput_ratio is None and comparison.realtime_attainment is None
    assert comparison.targets["realtime SLO attainment >= 99%"] is None
    assert comparison.targets["goodput >= 1.5x round-robin"] is None
    text = render_with(report.print_report, [base, cand], comparison, "h")
    assert "goodput ratio undefined" in text and "realtime SLO attainment undefined" in text


def test_a_real_shed_run_summarizes_to_an_undefined_ratio() -> None:
    def chain(i: int, status: str, latency: float | None) -> ChainRecord:
        return ChainRecord(f"c{i}", "chat", "realtime", 0, 100, 1, status=status, latency_s=latency)

    shed = [chain(i, "shed", None) for i in range(5)] + [chain(i, "ok", 5) for i in range(5, 100)]
    fine = [chain(i, "ok", 2) for i in range(100)]
    base = summarize(ReplayResult("round-robin", "simulator", 100, 4, shed, preemptions=0))
    cand = summarize(ReplayResult("chain-aware", "simulator", 100, 4, fine, preemptions=0))
    assert math.isinf(base.overall.latency_p99_s)
    assert compare(base, cand).p99_ratio is None


# ----- live / router reports -------------------------------------------------------------


def test_router_report_leaves_out_what_it_did_not_measure() -> None:
    run = make_summary("chain-aware", source="running stack (x1)", preemptions=None)
    text = render_with(report.print_report, [run], None, "running stack")
    assert "preemptions" not in text  # never a made-up 0
    assert "latency P99" in text and "running stack (x1)" in text


def test_live_report_shows_unmeasured_values_as_dashes_next_to_measured_ones() -> None:
    live = [make_summary("round-robin", source="live", preemptions=None), make_summary("chain-aware")]
    table = report.stats_table("all chains", {s.policy: s.overall for s in live}, ratio=True)
    row = next(line for line in render(table).splitlines() if "preemptions" in line)
    assert "-" in row and "3" in row


def test_agreement_table_pairs_live_and_simulated_figures() -> None:
    live = [make_summary("round-robin", source="live", preemptions=None)]
    simulated = [jsonable(make_summary("round-robin", latency_p99_s=41.5))]
    text = render(report.agreement_table(live, simulated))
    assert "round-robin live" in text and "round-robin sim" in text
    assert "40.00 s" in text and "41.50 s" in text
    assert "engine" not in text  # neither learned the engine: no rows for it


def test_agreement_table_pairs_what_live_and_simulated_learned_of_the_engine() -> None:
    live = [make_summary("chain-aware", source="live").model_copy(update={"engine": {"sim": ENGINE_LIVE}})]
    simulated = [jsonable(make_summary("chain-aware").model_copy(update={"engine": {"sim": ENGINE_SIM}}))]
    lines = render(report.agreement_table(live, simulated)).splitlines()
    prefill = next(line for line in lines if "prefill tokens/s" in line)
    kv = next(line for line in lines if "per 1k KV tokens" in line)
    assert "11,772" in prefill and "12,286" in prefill
    assert "0.146" in kv and "0.221" in kv
    # a live run that learned nothing (a policy that does not) shows dashes, not a figure
    live = [make_summary("chain-aware", source="live")]
    prefill = next(
        line for line in render(report.agreement_table(live, simulated)).splitlines() if "prefill" in line
    )
    assert "-" in prefill and "12,286" in prefill


ENGINE_LIVE = {"prefill_tokens_per_s": 11_772.4, "kv_read_s_per_token": 1.462e-7}
ENGINE_SIM = {"prefill_tokens_per_s": 12_286.0, "kv_read_s_per_token": 2.21e-7}


# ----- seed-agent table -------------------------------------------------------------------


def test_seed_report_renders_every_row_and_the_ratio_against_the_reference() -> None:
    summaries = [
        make_seed("reference"),
        make_seed("on", latency_p99_s=5.0, reusable_hit_rate=0.99),
        make_seed("no-affinity", errors=["UNAVAILABLE: x"]),
    ]
    comparison = compare_seed(summaries)
    assert comparison is not None and comparison.p99_ratio == pytest.approx(0.25)
    text = render_with(report.print_seed_report, summaries, comparison, "seed header")
    for label, _, _ in report.SEED_ROWS:
        assert label in text
    assert "on / reference" in text and "0.25" in text
    assert "P99 ratio on/reference 0.25 (target <= 0.5: met)" in text
    assert "no-affinity: errors ['UNAVAILABLE: x']" in text


def test_seed_reference_that_missed_chains_gives_no_ratio() -> None:
    summaries = [make_seed("reference", completed=8, latency_p99_s=INF), make_seed("on")]
    comparison = compare_seed(summaries)
    assert comparison is not None and comparison.p99_ratio is None and comparison.target_met is None
    text = render_with(report.print_seed_report, summaries, comparison, "h")
    assert "reference did not complete 2 of 10 chains; P99 undefined" in text
    assert "target <= 0.5: undefined" in text and ": met" not in text


def test_seed_comparison_needs_both_configurations() -> None:
    assert compare_seed([make_seed("on"), make_seed("no-affinity")]) is None
    text = render_with(report.print_seed_report, [make_seed("on")], None, "h")
    assert "P99 ratio" not in text


def test_seed_reference_keeps_vllm_prefix_caching_and_off_is_an_old_name() -> None:
    from inferx.bench.seed_run import CONFIGS

    assert "--no-prefix-caching" not in CONFIGS["reference"]["worker"]
    assert CONFIGS["reference"]["scheduler"] == ["--policy", "round-robin"]
    configs, notes = resolve_configs(["off", "on", "no-affinity"])
    assert configs == ["reference", "on", "no-affinity"]
    assert len(notes) == 1 and "prefix caching ON" in notes[0] and "superseded" in notes[0]
    with pytest.raises(ValueError, match="choose from on, reference, no-affinity"):
        resolve_configs(["all-on"])
    with pytest.raises(ValueError, match="twice"):
        resolve_configs(["off", "reference"])


# ----- JSON output and the results file -------------------------------------------------


def test_json_output_is_strict_json_with_null_for_inf_and_nan() -> None:
    base = make_summary("round-robin", latency_p99_s=INF, ttft_p50_s=math.nan, preemptions=None)
    data = report.to_json([base], None, {"where": "x"})
    text = json.dumps(data, allow_nan=False)  # raises on any inf/nan left
    back = json.loads(text)
    assert back["where"] == "x" and back["comparison"] is None
    overall = back["summaries"][0]["overall"]
    assert overall["latency_p99_s"] is None and overall["ttft_p50_s"] is None
    assert overall["preemptions"] is None and overall["latency_p50_s"] == 10.0


def test_results_file_holds_raw_chains_and_is_replaced_whole(tmp_path: Path) -> None:
    chain = ChainRecord("c1", "chat", "realtime", 0.0, 10.0, 1.0, status="shed")
    run = ReplayResult("round-robin", "simulator", 100.0, 4, [chain])
    path = tmp_path / "deep" / "r.json"
    results = ResultsFile(path)
    results.write({"complete": False, "runs": [replay_data(run, {"RESOURCE_EXHAUSTED": 1})]})
    first = json.loads(path.read_text())
    assert first["runs"][0]["chains"][0]["status"] == "shed"
    assert first["runs"][0]["chains"][0]["latency_s"] is None
    assert first["runs"][0]["errors"] == {"RESOURCE_EXHAUSTED": 1}
    results.write({"complete": True, "summaries": [summarize(run)]})
    second = json.loads(path.read_text())
    assert second["complete"] is True and "runs" not in second
    assert math.isinf(summarize(run).overall.latency_p99_s)
    assert second["summaries"][0]["overall"]["latency_p99_s"] is None
    assert list(tmp_path.joinpath("deep").iterdir()) == [path]  # no temporary file left


def test_results_file_refuses_a_directory(tmp_path: Path) -> None:
    from inferx.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="is a directory"):
        ResultsFile(tmp_path)


def test_results_file_refuses_a_device_it_would_replace(tmp_path: Path) -> None:
    # The write replaces the file (atomically): given /dev/null, it would have put the
    # results where the device was.
    from inferx.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="not a regular file"):
        ResultsFile(Path("/dev/null"))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(InvalidArgument, match="not a regular file"):
        ResultsFile(fifo)


def test_comparison_round_trips_through_json() -> None:
    comparison = compare(make_summary("round-robin", latency_p99_s=INF, shed=3), make_summary("x"))
    again = Comparison.model_validate(json.loads(json.dumps(jsonable(comparison))))
    assert again.p99_ratio is None and again.baseline_shed == 3
