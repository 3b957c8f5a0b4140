"""`inferx sim` / `inferx bench --scenario seed-agent` end to end in-process (the live
stacks replaced by synthetic results): the raw results reach their file before any
table is rendered, old names keep working with a note, bad input is one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferx.bench import report, seed_run
from inferx.cli.main import main
from inferx.sim.profile import EngineProfile
from inferx.sim.trace import TraceConfig, generate, write_trace


def run_cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    return int(exited.value.code or 0)


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    write_trace(generate(TraceConfig(seed=3, duration_s=20, rate_per_s=1.0), EngineProfile()), path)
    return path


def sim_argv(trace_file: Path, results: Path, *extra: str) -> list[str]:
    return ["sim", "--trace", str(trace_file), "--rate", "1", "--results", str(results), *extra]


def test_sim_writes_raw_results_and_reports_with_the_registered_names(
    trace_file: Path, tmp_path: Path, capsys
) -> None:
    results = tmp_path / "r.json"
    assert run_cli(sim_argv(trace_file, results, "--compare", "baseline", "chain-aware")) == 0
    captured = capsys.readouterr()
    assert f"raw results: {results}" in captured.err
    data = json.loads(results.read_text())
    assert data["kind"] == "sim" and data["complete"] is True
    # `baseline` is accepted and reported under its registered name.
    assert [r["policy"] for r in data["runs"]] == ["round-robin", "chain-aware"]
    assert [s["policy"] for s in data["summaries"]] == ["round-robin", "chain-aware"]
    assert data["comparison"]["baseline"] == "round-robin"
    assert len(data["runs"][0]["chains"]) == data["context"]["chains"] > 5
    assert "chain-aware vs round-robin" in captured.out and "baseline" not in captured.out


def test_a_rendering_bug_does_not_lose_the_figures(trace_file: Path, tmp_path: Path, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise AttributeError("'Summary' object has no attribute 'something_new'")

    monkeypatch.setattr(report, "print_report", broken)
    results = tmp_path / "r.json"
    with pytest.raises(AttributeError):
        main(sim_argv(trace_file, results))
    data = json.loads(results.read_text())
    assert data["complete"] is True
    assert {s["policy"] for s in data["summaries"]} == {"round-robin", "chain-aware"}


def test_sim_json_on_stdout_and_the_same_figures_in_the_file(
    trace_file: Path, tmp_path: Path, capsys
) -> None:
    results = tmp_path / "r.json"
    assert run_cli(sim_argv(trace_file, results, "--policy", "chain-aware", "--json")) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(results.read_text())
    assert printed["summaries"] == saved["summaries"]
    assert printed["summaries"][0]["overall"]["preemptions"] is not None  # the simulator counts them


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sim", "--compare", "fastest"], "unknown policy 'fastest'"),
        (["sim", "--compare", "baseline", "round-robin"], "names a policy twice"),
        (["bench", "--scenario", "seed-agent", "--engine", "sim", "--compare", "all-on"], "choose from"),
        (
            ["bench", "--engine", "sim", "--compare", "chain-aware", "--option", "realtime_guard=false"],
            "the live scheduler has no flag for it",
        ),
        (
            ["bench", "--peer", "vllm-router", "--option", "exact_prefix=true"],
            "this benchmark starts no such",
        ),
        (["bench", "--overhead", "--option", "exact_prefix=true"], "this benchmark starts no such policy"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, capsys) -> None:
    assert run_cli(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_results_path_that_is_a_directory_is_refused_before_the_run(
    trace_file: Path, tmp_path: Path, capsys
) -> None:
    assert run_cli(sim_argv(trace_file, tmp_path)) == 1
    err = capsys.readouterr().err
    assert "is a directory" in err and "Traceback" not in err


# ----- seed-agent, with the stacks replaced by synthetic summaries -------------------------


def fake_summary(config: str, p99: float) -> seed_run.SeedSummary:
    return seed_run.SeedSummary(
        config=config,
        chains=4,
        completed=4,
        latency_p50_s=p99 / 2,
        latency_p90_s=p99 * 0.9,
        latency_p99_s=p99,
        reusable_hit_rate=0.9,
        prefix_hit_rate=0.8,
        tool_cache_hit_rate=0.5,
        worker_switches=0.0,
        wall_s=12.0,
        errors=[],
    )


@pytest.fixture
def fake_seed(monkeypatch) -> list[list[str]]:
    """run_seed without stacks: records the configurations it was asked for."""
    asked: list[list[str]] = []

    async def run_seed(options, configs, root, knowledge, progress, note, on_config=None):
        asked.append(list(configs))
        summaries = []
        for config in configs:
            summary = fake_summary(config, {"reference": 20.0}.get(config, 5.0))
            summaries.append(summary)
            outcomes = [seed_run.RunOutcome(status="ok", latency_s=1.0)]
            if on_config is not None:
                on_config(summary, outcomes)
        return summaries

    monkeypatch.setattr(seed_run, "run_seed", run_seed)
    return asked


def test_seed_agent_off_runs_the_reference_with_a_note(fake_seed, tmp_path: Path, capsys) -> None:
    results = tmp_path / "seed.json"
    argv = ["bench", "--scenario", "seed-agent", "--engine", "sim", "--results", str(results)]
    assert run_cli([*argv, "--compare", "off", "on", "no-affinity"]) == 0
    assert fake_seed == [["reference", "on", "no-affinity"]]
    captured = capsys.readouterr()
    assert "'off' now runs 'reference'" in captured.err
    assert "on / reference" in captured.out and "P99 ratio on/reference 0.25" in captured.out
    data = json.loads(results.read_text())
    assert data["complete"] is True and data["comparison"]["p99_ratio"] == 0.25
    assert [r["summary"]["config"] for r in data["runs"]] == ["reference", "on", "no-affinity"]
    assert data["runs"][0]["outcomes"][0]["status"] == "ok"
    assert data["context"]["configs"]["reference"]["worker"] == []  # prefix caching stays on


def test_seed_agent_default_is_reference_vs_on_and_json_works(fake_seed, tmp_path: Path, capsys) -> None:
    argv = ["bench", "--scenario", "seed-agent", "--engine", "sim", "--json"]
    assert run_cli([*argv, "--results", str(tmp_path / "s.json")]) == 0
    assert fake_seed == [["reference", "on"]]
    printed = json.loads(capsys.readouterr().out)
    assert [s["config"] for s in printed["summaries"]] == ["reference", "on"]
    assert printed["comparison"]["p99_ratio"] == 0.25


def test_seed_agent_rendering_bug_keeps_the_results(fake_seed, tmp_path: Path, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise AttributeError("'SeedSummary' object has no attribute 'serving_p50_s'")

    monkeypatch.setattr(report, "print_seed_report", broken)
    results = tmp_path / "seed.json"
    with pytest.raises(AttributeError):
        main(["bench", "--scenario", "seed-agent", "--engine", "sim", "--results", str(results)])
    data = json.loads(results.read_text())
    assert data["complete"] is True and len(data["summaries"]) == 2


def test_long_runs_show_their_rate_and_time_left() -> None:
    """The progress of a benchmark shows chains done of total, the rate, elapsed and
    remaining time (live benches take 10+ minutes)."""
    from types import SimpleNamespace

    from inferx.cli.bench import ChainRateColumn

    column = ChainRateColumn()
    assert column.render(SimpleNamespace(speed=None)).plain == "-- chains/s"  # type: ignore[arg-type]
    assert column.render(SimpleNamespace(speed=2.5)).plain == "2.50 chains/s"  # type: ignore[arg-type]


def test_live_policy_options_become_the_schedulers_flags() -> None:
    """What `--option` gives the live stack's scheduler: the flag of the same name, a
    bool as the flag or its --no- form; each flag is one the scheduler parses."""
    from inferx.bench.live import scheduler_flags
    from inferx.settings import load_settings
    from inferx_scheduler.config import SchedulerSettings

    flags = scheduler_flags({"exact_prefix": True, "worker_hints": False, "max_hold_s": 90.0})
    assert flags == ("--exact-prefix", "--no-worker-hints", "--max-hold-s", "90.0")
    parsed = load_settings(SchedulerSettings, "inferx-scheduler", list(flags))
    assert (parsed.exact_prefix, parsed.worker_hints, parsed.max_hold_s) == (True, False, 90.0)
    assert parsed.policy_options()["learn_engine"] is True
    unlearned = load_settings(
        SchedulerSettings, "inferx-scheduler", list(scheduler_flags({"learn_engine": False}))
    )
    assert unlearned.policy_options()["learn_engine"] is False


def test_a_told_engine_is_taken_as_given_unless_the_scheduler_is_asked_to_learn(tmp_path) -> None:
    from inferx.settings import load_settings
    from inferx_scheduler.config import SchedulerSettings

    profile = tmp_path / "engine.yaml"
    profile.write_text("prefill_tokens_per_s: 6000\n")
    told = ["--engine-profile", str(profile)]
    for argv, learns in ((told, False), ([*told, "--learn-engine"], True), (["--no-learn-engine"], False)):
        options = load_settings(SchedulerSettings, "inferx-scheduler", argv).policy_options()
        assert options["learn_engine"] is learns, argv
        assert options.get("prefill_tokens_per_s", 15_000) == (6000 if told[1] in argv else 15_000)


def test_the_live_benchs_simulator_comparison_gets_the_same_policy_options(
    trace_file: Path, tmp_path: Path, monkeypatch
) -> None:
    """`--option` reaches the live scheduler as flags and the simulator it is compared
    with as options: a comparison of differently configured policies would mean nothing."""
    from inferx.bench import live, runner

    seen: dict[str, object] = {}
    real = runner.run_simulated

    async def fake_live(trace, policies, profile, options, progress, note, keep):
        seen["flags"] = options.scheduler_flags
        runs = real(trace, policies, profile, options.workers, progress)  # stands in for the live stack
        return runs, {p: {} for p in policies}

    def simulated(trace, policies, profile, workers, progress, options=None, pools=1):
        seen["sim options"] = options
        return real(trace, policies, profile, workers, progress, options, pools)

    monkeypatch.setattr(live, "run_live_sim", fake_live)
    monkeypatch.setattr(runner, "run_simulated", simulated)
    argv = ["bench", "--engine", "sim", "--trace", str(trace_file), "--rate", "1", "--policy", "chain-aware"]
    argv += ["--option", "learn_engine=true", "--results", str(tmp_path / "r.json"), "--json"]
    assert run_cli(argv) == 0
    assert seen == {"flags": ("--learn-engine",), "sim options": {"learn_engine": True}}
    data = json.loads((tmp_path / "r.json").read_text())
    assert (
        data["context"]["simulator"][0]["engine"] is not None
    )  # the simulated chain-aware learned, as told to
