"""Steady-state capacity (issue #42): every probe measures the same long window of
arrivals at its rate, so a policy that absorbs one short burst but cannot sustain the
rate does not get that rate as its capacity."""

from __future__ import annotations

import json

import pytest

from inferx.errors import InvalidArgument
from inferx.sim.capacity import find_capacity, meets_slo, simulated_evaluator
from inferx.sim.cluster import ClusterSim, sim_policy
from inferx.sim.profile import EngineProfile
from inferx.sim.steady import burst_trace, steady_trace, steady_window
from inferx.sim.trace import TraceConfig, generate

PROFILE = EngineProfile()


def small_trace(seed: int = 3):
    return generate(
        TraceConfig(seed=seed, duration_s=30, rate_per_s=1.0, mix={"chat": 0.5, "bfcl": 0.5}), PROFILE
    )


def test_every_rate_gets_the_same_window_and_only_its_chains_count() -> None:
    base = small_trace()
    window = steady_window(base, 300.0)
    assert window.warmup_s == pytest.approx(max(3 * window.median_slo_s, 30.0))
    assert window.drain_s == max(c.slo_s for c in base.chains)
    for rate in (0.5, 2.0, 8.0):
        trace, measured = steady_trace(base, rate, window)
        arrivals = [c.arrival_s for c in trace.chains]
        assert arrivals == sorted(arrivals)
        assert max(arrivals) < window.span_s and max(arrivals) > window.span_s - 5 / rate
        # About rate x window chains are measured, whatever the rate (Poisson: within 25%).
        assert len(measured) == pytest.approx(rate * window.window_s, rel=0.25)
        assert all(window.measured(c.arrival_s) == (c.chain_id in measured) for c in trace.chains)
        assert len({c.chain_id for c in trace.chains}) == len(trace.chains)  # fresh ids


def test_repetitions_keep_the_chains_and_their_order() -> None:
    base = small_trace()
    trace, _ = steady_trace(base, 4.0, steady_window(base, 300.0))
    n = len(base.chains)
    assert len(trace.chains) > 3 * n
    for original, again in zip(base.chains, trace.chains[n : 2 * n], strict=True):
        assert again.chain_id == f"{original.chain_id}~1"
        assert again.hops == original.hops and again.tier == original.tier and again.slo_s == original.slo_s


def test_the_default_window_is_long() -> None:
    base = small_trace()
    window = steady_window(base)
    assert window.window_s >= 1800 and window.window_s >= 20 * window.median_slo_s and window.steady
    assert not steady_window(base, 60.0).steady
    with pytest.raises(InvalidArgument, match="--window-s"):
        steady_window(base, -5.0)


def test_a_burst_is_the_first_chains_all_counted() -> None:
    base = small_trace()
    trace, measured = burst_trace(base, 10.0, len(base.chains) + 5)
    assert len(trace.chains) == len(base.chains) + 5 == len(measured)
    assert trace.chains[-1].arrival_s < (len(base.chains) + 5) / 10.0 * 1.6
    with pytest.raises(InvalidArgument):
        burst_trace(base, 10.0, 0)


def test_a_burst_absorbed_is_not_a_sustained_capacity() -> None:
    """The old search (the trace's chains squeezed into a short span: `--burst` with the
    whole trace) gives one worker a rate it cannot sustain; the steady-state search does
    not, and its capacity does hold over the window."""
    base = small_trace()
    burst = find_capacity(
        "rr", simulated_evaluator(base, "round-robin", PROFILE, 1, burst=len(base.chains)), 1.0, tolerance=0.1
    )
    steady = simulated_evaluator(base, "round-robin", PROFILE, 1, window=steady_window(base, 200.0))
    at_burst_capacity = steady(burst.rate_per_s)
    assert not meets_slo(at_burst_capacity)  # one worker cannot sustain what it absorbed in a burst
    assert at_burst_capacity.stopped == "miss budget spent"  # decided early: the verdict was known
    sustained = find_capacity("rr", steady, burst.rate_per_s / 4, tolerance=0.25)
    assert 0 < sustained.rate_per_s < burst.rate_per_s / 2
    at = sustained.at_capacity
    assert at is not None and meets_slo(at.attainment)
    assert at.attainment.chains > 10 * len(base.chains) / 4  # many chains measured


def test_a_measured_run_stops_when_its_chains_end_or_its_budget_is_spent() -> None:
    base = small_trace()
    window = steady_window(base, 200.0)
    trace, measured = steady_trace(base, 1.0, window)
    easy = ClusterSim(trace, sim_policy("round-robin", PROFILE), PROFILE, 2, measured=measured).run()
    assert easy.stopped == "every measured chain ended"
    assert all(c.status == "ok" for c in easy.chains if c.chain_id in measured)
    assert easy.makespan_s < window.span_s + max(c.slo_s for c in base.chains) * 3
    trace, measured = steady_trace(base, 40.0, window)
    crushed = ClusterSim(
        trace, sim_policy("round-robin", PROFILE), PROFILE, 1, measured=measured, miss_budget=(5, 2)
    ).run()
    assert crushed.stopped == "miss budget spent"
    late = [c for c in crushed.chains if c.chain_id in measured and not c.slo_met]
    assert len(late) >= 3  # past the budget (finished chains, plus the unfinished counted as misses)


def test_cli_reports_the_window_and_chains_per_probe(capsys, tmp_path) -> None:
    from inferx.cli.main import main

    argv = [
        "sim",
        "--capacity",
        "--duration",
        "20",
        "--window-s",
        "60",
        "--json",
        "--jobs",
        "2",
        "--workers",
        "1",
    ]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--compare", "round-robin", "least-loaded", "--results", str(tmp_path / "r.json")])
    assert exit_info.value.code == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    context = data["context"]
    assert context["mode"] == "steady" and context["jobs"] == 2
    (window,) = context["window"]
    assert window["window_s"] == 60 and window["steady"] is False  # 60 s is short: said so
    assert "not steady state" in captured.err
    for result in data["capacity"].values():
        (seed,) = result["per_seed"]
        probes = seed["probes"]
        assert probes and all(
            p["attainment"]["simulated_chains"] >= p["attainment"]["chains"] for p in probes
        )


def test_cli_refuses_a_burst_and_a_window_together(capsys, tmp_path) -> None:
    from inferx.cli.main import main

    argv = ["sim", "--capacity", "--duration", "20", "--window-s", "150", "--burst", "10"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--results", str(tmp_path / "r.json")])
    assert exit_info.value.code == 1
    assert "--burst" in capsys.readouterr().err


def test_a_dag_trace_is_probed_in_steady_state_with_its_alone_times_kept() -> None:
    """Research chains are DAGs (`depends_on` lists): repeated chains keep their alone
    time (remembered by content) and their structure."""
    from inferx.sim.cluster import alone_latency_s

    base = generate(TraceConfig(seed=2, duration_s=40, rate_per_s=0.25, mix={"research": 1.0}), PROFILE)
    assert any(h.depends_on for c in base.chains for h in c.hops)
    trace, measured = steady_trace(base, 0.05, steady_window(base, 300.0))
    run = ClusterSim(trace, sim_policy("session-affinity", PROFILE), PROFILE, 2, measured=measured).run()
    by_id = {c.chain_id: c for c in trace.chains}
    for record in run.chains[: 2 * len(base.chains)]:
        assert record.alone_s == pytest.approx(alone_latency_s(by_id[record.chain_id], PROFILE))


def _record(chain_id: str, serving_s: float, *, done: bool = True):
    from inferx.sim.records import ChainRecord

    record = ChainRecord(chain_id, "k", "standard", 0.0, 100.0, alone_s=serving_s + 5.0, delays_s=5.0)
    if done:
        record.finish("ok", serving_s + 5.0)
    return record


def test_the_bound_counts_chains_of_the_mix_not_whatever_finishes() -> None:
    """Overloaded, a policy that finishes every cheap chain and starves the costly ones
    finishes 90% of the chains but serves a fraction of the work: its bound is the work's
    share (chains of the trace's mix per second), not the chains' count."""
    from inferx.sim.capacity import throughput_of

    window = steady_window(small_trace(), 300.0)
    cheap = [_record(f"c{i}", 1.0) for i in range(90)]
    costly = [_record(f"x{i}", 30.0, done=False) for i in range(10)]
    starving = throughput_of("p", 2.0, cheap + costly, cheap, window)
    assert starving.completed_chains_rate_per_s == pytest.approx(1.8)  # 90 of 100, times 2/s
    assert starving.completed_rate_per_s == pytest.approx(2.0 * 90 / (90 + 300))
    assert starving.saturated
    fair = throughput_of("p", 2.0, cheap + costly, cheap[:45] + costly[:5], window)
    assert fair.completed_rate_per_s == pytest.approx(1.0)
    assert fair.completed_rate_per_s > starving.completed_rate_per_s
    kept_up = throughput_of("p", 2.0, cheap, cheap, window)
    assert kept_up.completed_rate_per_s == pytest.approx(2.0) and not kept_up.saturated


def test_cli_bound_reports_the_engines_bound_and_each_share(capsys, tmp_path) -> None:
    from inferx.cli.main import main

    argv = ["sim", "--capacity", "--duration", "20", "--window-s", "60", "--json", "--workers", "1"]
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                *argv,
                "--bound",
                "--compare",
                "round-robin",
                "least-loaded",
                "--results",
                str(tmp_path / "r.json"),
            ]
        )
    assert exit_info.value.code == 0
    data = json.loads(capsys.readouterr().out)
    bound = data["bound"]
    (seed,) = bound["per_seed"]
    assert set(seed["throughput"]) == {"round-robin", "least-loaded"}  # the top policies (up to 3)
    served = max(t["completed_rate_per_s"] for t in seed["throughput"].values())
    best = max(result["per_seed"][0]["rate_per_s"] for result in data["capacity"].values())
    assert bound["rate_per_s"] == seed["bound_per_s"] == max(served, best)  # never below a capacity
    assert all(share <= 1.0 for share in seed["share"].values())
    for name, result in data["capacity"].items():
        assert seed["share"][name] == pytest.approx(result["per_seed"][0]["rate_per_s"] / seed["bound_per_s"])
    assert "bound_method" in data["context"] and "serving time alone" in data["context"]["bound_method"]
    raw = json.loads((tmp_path / "r.json").read_text())
    assert raw["complete"] and raw["bound"]["rate_per_s"] == bound["rate_per_s"]


def test_the_bound_is_never_below_a_sustained_capacity() -> None:
    """Overloaded, long contexts can thrash the KV cache so every run serves less than a
    policy sustained within SLO: the bound is then that capacity (served work too)."""
    from inferx.sim.capacity import engine_bound

    assert engine_bound({"a": 2.8, "b": 1.2}, {"a": 2.0, "b": 1.8}) == (2.8, "a")
    bound, by = engine_bound({"a": 0.0035, "b": 0.0208}, {"a": 0.0217, "b": 0.0217, "c": 0.011})
    assert bound == 0.0217 and by.startswith("a (its capacity")
