"""The capacity-at-SLO search against fake evaluators (pure), and the attainment rule."""

from dataclasses import dataclass

import pytest

from inferx.sim.capacity import (
    Attainment,
    CapacityProbe,
    attainment,
    find_capacity,
    meets_slo,
    simulated_evaluator,
)
from inferx.sim.profile import EngineProfile
from inferx.sim.trace import TraceConfig, generate


def fake(capacity: float, realtime_capacity: float | None = None, calls: list[float] | None = None):
    """Meets the SLO below `capacity` (overall) and below `realtime_capacity` (realtime)."""
    rt_cap = capacity if realtime_capacity is None else realtime_capacity

    def evaluate(rate: float) -> Attainment:
        if calls is not None:
            calls.append(rate)
        return Attainment(
            chains=100,
            realtime_chains=50,
            overall=1.0 if rate <= capacity else 0.9,
            realtime=1.0 if rate <= rt_cap else 0.98,
        )

    return evaluate


@pytest.mark.parametrize("true_capacity", [0.05, 0.7, 1.0, 1.9, 13.0])
def test_bisection_finds_the_capacity_within_the_tolerance(true_capacity: float) -> None:
    result = find_capacity("p", fake(true_capacity), start_rate=1.0, tolerance=0.03)
    assert result.failing_rate_per_s is not None
    assert result.rate_per_s <= true_capacity < result.failing_rate_per_s
    assert result.failing_rate_per_s <= result.rate_per_s * 1.03
    assert result.at_capacity is not None and result.at_capacity.meets


def test_the_tighter_of_the_two_targets_decides() -> None:
    result = find_capacity("p", fake(4.0, realtime_capacity=2.5), start_rate=1.0)
    assert 2.5 / 1.03 <= result.rate_per_s <= 2.5


def test_probes_are_few_and_reported() -> None:
    calls: list[float] = []
    seen: list[CapacityProbe] = []
    result = find_capacity("p", fake(3.0, calls=calls), start_rate=1.0, on_probe=seen.append)
    assert [p.rate_per_s for p in result.probes] == calls == [p.rate_per_s for p in seen]
    assert calls[:3] == [1.0, 2.0, 4.0]  # bracketing by doubling, then bisection
    assert len(calls) <= 10


def test_never_meeting_gives_zero_and_always_meeting_gives_the_highest_rate_tried() -> None:
    none = find_capacity("p", fake(0.0), start_rate=1.0, max_factor=8)
    assert none.rate_per_s == 0.0 and none.failing_rate_per_s == 0.125
    every = find_capacity("p", fake(1e9), start_rate=1.0, max_factor=8)
    assert every.rate_per_s == 8.0 and every.failing_rate_per_s is None


@dataclass
class Outcome:
    tier: str
    slo_met: bool


def test_attainment_counts_misses_and_needs_both_targets() -> None:
    chains = [Outcome("realtime", True)] * 99 + [Outcome("realtime", False)]
    chains += [Outcome("batch", True)] * 90 + [Outcome("batch", False)] * 10
    result = attainment(chains)
    assert result.realtime == 0.99 and result.overall == 189 / 200
    assert not meets_slo(result)  # 94.5% overall < 95%
    assert meets_slo(attainment(chains[:100] + chains[100:190]))
    assert meets_slo(attainment([Outcome("batch", True)] * 20))  # no realtime chains: vacuous
    assert not meets_slo(attainment([]))


def test_simulated_evaluator_counts_unfinished_chains_as_misses() -> None:
    trace = generate(TraceConfig(seed=7, duration_s=40, rate_per_s=1.0))
    whole = len(trace.chains)
    easy = simulated_evaluator(trace, "round-robin", EngineProfile(), workers=2, burst=whole)(0.5)
    assert easy.chains == whole and easy.overall > 0.95
    # 200x the rate on a tiny horizon: most chains cannot finish, and none of those count.
    crushed = simulated_evaluator(
        trace, "round-robin", EngineProfile(max_num_seqs=2), workers=1, burst=whole
    )(200.0)
    assert crushed.overall < 0.5


def test_cli_prints_capacity_per_policy_as_json(capsys, tmp_path) -> None:
    import json

    from inferx.cli.main import main

    raw = tmp_path / "raw.json"
    argv = ["sim", "--capacity", "--duration", "20", "--burst", "20", "--json", "--results", str(raw)]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--compare", "round-robin", "least-loaded", "chain-aware"])
    assert exit_info.value.code == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["capacity"]) == {"round-robin", "least-loaded", "chain-aware"}
    for result in data["capacity"].values():
        (only,) = result["per_seed"]
        assert (
            result["rate_per_s"] == result["min_rate_per_s"] == result["max_rate_per_s"] == only["rate_per_s"]
        )
        assert result["rate_per_s"] > 0 and only["overall_attainment"] >= 0.95
        assert only["failing_rate_per_s"] <= result["rate_per_s"] * 1.03
    assert data["strongest_peer"] in {"round-robin", "least-loaded"}
    peer = data["capacity"][data["strongest_peer"]]["rate_per_s"]
    assert data["chain-aware_vs_strongest_peer"] == data["capacity"]["chain-aware"]["rate_per_s"] / peer
    # The raw results were written too, complete.
    saved = json.loads(raw.read_text())
    assert saved["complete"] is True and set(saved["capacity"]) == set(data["capacity"])


def test_cli_capacity_over_seeds_reports_the_median(capsys, tmp_path) -> None:
    import json

    from inferx.cli.main import main

    argv = [
        "sim",
        "--capacity",
        "--workload",
        "mix",
        "--seeds",
        "3",
        "--duration",
        "15",
        "--json",
        "--burst",
        "20",
    ]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--compare", "round-robin", "chain-aware", "--results", str(tmp_path / "r.json")])
    assert exit_info.value.code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["context"]["trace_seeds"] == [1, 2, 3]
    for result in data["capacity"].values():
        rates = sorted(seed["rate_per_s"] for seed in result["per_seed"])
        assert len(rates) == 3 and result["rate_per_s"] == rates[1]
        assert (result["min_rate_per_s"], result["max_rate_per_s"]) == (rates[0], rates[2])


def test_cli_seeds_need_a_regenerable_trace(tmp_path) -> None:
    from inferx.cli.main import main
    from inferx.sim.trace import TraceConfig, generate, write_trace

    trace = generate(TraceConfig(seed=1, duration_s=10))
    foreign = trace.model_copy(update={"meta": trace.meta.model_copy(update={"generator": "my exporter"})})
    path = tmp_path / "t.jsonl"
    write_trace(foreign, path)
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["sim", "--capacity", "--trace", str(path), "--seeds", "2", "--results", str(tmp_path / "r.json")]
        )
    assert exit_info.value.code == 1


def test_cli_capacity_needs_the_simulator() -> None:
    from inferx.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--capacity", "--engine", "sim"])
    assert exit_info.value.code == 1


def test_a_lucky_rate_above_a_failing_one_is_not_the_capacity() -> None:
    """Meets below 2.0, fails in [2.0, 2.6), meets again (by luck) in [2.6, 2.8): the
    capacity is just under 2.0, not the lucky island."""

    def evaluate(rate: float) -> Attainment:
        ok = rate < 2.0 or 2.6 <= rate < 2.8
        return Attainment(chains=100, realtime_chains=50, overall=1.0, realtime=1.0 if ok else 0.9)

    result = find_capacity("p", evaluate, start_rate=1.4, tolerance=0.03)
    assert result.rate_per_s < 2.0 and result.rate_per_s >= 2.0 / 1.03 / 1.03**2
    assert result.failing_rate_per_s is not None and result.failing_rate_per_s <= 2.6


def test_a_capacity_that_holds_below_is_confirmed_with_two_probes() -> None:
    calls: list[float] = []
    result = find_capacity("p", fake(3.0, calls=calls), start_rate=1.0, tolerance=0.03)
    assert calls[-2:] == pytest.approx([result.rate_per_s * 0.97, result.rate_per_s * 0.97**2])
    assert 3.0 / 1.03 <= result.rate_per_s <= 3.0


def test_policy_options_are_typed_and_must_be_taken_by_a_compared_policy() -> None:
    from inferx.bench.runner import policy_options
    from inferx.errors import InvalidArgument

    options = policy_options(
        ["realtime_guard=false", "guard_kv_share=0.5"], ["session-affinity", "chain-aware"]
    )
    assert options == {"realtime_guard": False, "guard_kv_share": 0.5}
    with pytest.raises(InvalidArgument, match="no compared policy takes it"):
        policy_options(["realtime_guard=false"], ["session-affinity"])
    with pytest.raises(InvalidArgument, match="expected KEY=VALUE"):
        policy_options(["realtime_guard"], ["chain-aware"])
    # A value of the wrong type is refused before any run, naming the option.
    with pytest.raises(InvalidArgument, match="guard_slack_share"):
        policy_options(["guard_slack_share=abc"], ["chain-aware"])


def test_an_option_reaches_the_policy_in_the_search(monkeypatch) -> None:
    """--option, and the engine's calibration (the profile's figures, what chain-aware
    is told of the engines), reach the policy of every run of the search."""
    import inferx.sim.capacity as capacity_module
    from inferx.scheduling.chain_aware import ChainAwarePolicy
    from inferx.sim import cluster

    trace = generate(TraceConfig(seed=1, duration_s=20, rate_per_s=1.0))
    seen: list[tuple[bool, float]] = []

    def spy(name, profile, options=None):
        policy = cluster.sim_policy(name, profile, options)
        assert isinstance(policy, ChainAwarePolicy)
        seen.append((policy.config.realtime_guard, policy.config.kv_read_s_per_token))
        return policy

    monkeypatch.setattr(capacity_module, "sim_policy", spy)
    profile = EngineProfile(kv_read_ms_per_1k_tokens=0.33)
    simulated_evaluator(trace, "chain-aware", profile, 2, options={"realtime_guard": False}, burst=10)(1.0)
    assert seen == [(False, pytest.approx(0.33e-6))]


def test_cli_draws_the_curves(tmp_path) -> None:
    from inferx.cli.main import main

    plot = tmp_path / "curves.png"
    argv = [
        "sim",
        "--capacity",
        "--duration",
        "15",
        "--burst",
        "30",
        "--compare",
        "round-robin",
        "chain-aware",
    ]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--plot", str(plot), "--results", str(tmp_path / "r.json")])
    assert exit_info.value.code == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_cli_refuses_a_workload_and_a_trace_together(tmp_path, capsys) -> None:
    from inferx.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(
            ["sim", "--capacity", "--workload", "mix", "--trace", "x.jsonl", "--results", str(tmp_path / "r")]
        )
    assert exit_info.value.code == 1
    assert "either --workload or --trace" in capsys.readouterr().err


def test_capacity_traces_regenerate_a_written_trace_from_the_seed_given(tmp_path) -> None:
    import argparse

    from inferx.cli.capacity import capacity_traces
    from inferx.sim.trace import write_trace

    path = tmp_path / "t.jsonl"
    write_trace(generate(TraceConfig(seed=101, duration_s=10, mix={"chat": 0.7, "swe": 0.3})), path)

    def seeds(**flags) -> list[int]:
        args = argparse.Namespace(trace=str(path), workload=None, duration=None, **flags)
        traces = capacity_traces(args, None)
        assert all(t.meta.config.mix == {"chat": 0.7, "swe": 0.3} for t in traces)  # the trace's own mix
        return [t.meta.config.seed for t in traces]

    assert seeds(seed=None, seeds=2) == [101, 102]
    assert seeds(seed=102, seeds=2) == [102, 103]  # not the file's seed 101 again
    assert seeds(seed=7, seeds=1) == [7]


@pytest.mark.parametrize(
    "argv",
    [
        ["sim", "--workload", "coding", "--compare", "chain-aware"],
        ["sim", "--seed", "3"],
        ["bench", "--engine", "sim", "--seeds", "2"],
    ],
)
def test_cli_refuses_trace_generating_flags_a_replay_would_ignore(argv, capsys) -> None:
    from inferx.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 1
    assert "choose the generated traces of a capacity search" in capsys.readouterr().err


def test_cli_names_a_prompt_longer_than_the_profiles_kv_pool(tmp_path, capsys) -> None:
    """A trace whose contexts outgrow the engines' KV pool is refused with the sizes, not
    replayed with engines that can never serve it (or a traceback)."""
    from inferx.cli.main import main

    profile = tmp_path / "small.yaml"
    profile.write_text("kv_capacity_tokens: 50000\n")
    argv = ["sim", "--capacity", "--workload", "coding", "--profile", str(profile), "--jobs", "1"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--compare", "chain-aware", "--results", str(tmp_path / "r.json")])
    assert exit_info.value.code == 1
    assert "leaves no room for a reply in this engine's KV pool of 50,000 tokens" in capsys.readouterr().err
