"""The engine's figures learned from finished hops (`inferx.scheduling.engine_fit`):
the estimators, the fit's prior and refits, chain-aware pricing by what it learned
(and not, when told not to), and the simulator and the live scheduler feeding it."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferx.bench.live import engine_from_metrics
from inferx.bench.report import engine_line
from inferx.pools import PoolDirectory
from inferx.scheduling.chain_aware import ChainAwareConfig, ChainAwarePolicy
from inferx.scheduling.engine_fit import EngineFit, EngineSample, best_rate, envelope_slope
from inferx.scheduling.queue import DispatchQueue
from inferx.scheduling.views import HopView, WorkerSlots
from inferx.sim.cluster import ClusterSim, sim_policy
from inferx.sim.profile import EngineProfile
from inferx.sim.trace import generate, workload
from inferx.v1 import common_pb2, scheduler_pb2
from inferx_scheduler import metrics
from inferx_scheduler.dispatcher import HopDispatcher
from inferx_scheduler.servicer import _engine_sample
from tests.conftest import load_benchmark_script


def waits(rng: random.Random, n: int, idle_share: float = 0.3) -> list[float]:
    """What hops waited besides their own work: none for some, up to seconds for the rest."""
    return [0.0 if rng.random() < idle_share else rng.expovariate(2.0) for _ in range(n)]


@settings(max_examples=40, deadline=None)
@given(rate=st.floats(500, 100_000), seed=st.integers(0, 10_000))
def test_best_rate_never_exceeds_the_engine_and_finds_it_when_some_hops_ran_alone(
    rate: float, seed: int
) -> None:
    rng = random.Random(seed)
    tokens = [rng.choice((1500, 3000, 6000, 12000, 30000)) * rng.uniform(0.9, 1.1) for _ in range(300)]
    points = [(x, x / rate + w) for x, w in zip(tokens, waits(rng, len(tokens)), strict=True)]
    found = best_rate(points)
    assert found is not None
    assert found <= rate * (1 + 1e-9)  # waiting only ever adds: a hop can only fall short
    assert found == pytest.approx(rate, rel=0.02)


def test_best_rate_needs_a_bucket_with_enough_hops() -> None:
    assert best_rate([(2000.0, 0.2)] * 7) is None
    assert best_rate([(2000.0, 0.2)] * 8) == pytest.approx(10_000)
    assert best_rate([(2000.0, 0.0)] * 8) is None  # no time: says nothing


@settings(max_examples=40, deadline=None)
@given(slope=st.floats(1e-9, 1e-6), base=st.floats(0.001, 0.05), seed=st.integers(0, 10_000))
def test_envelope_slope_finds_the_cost_per_kv_token_under_additive_stalls(
    slope: float, base: float, seed: int
) -> None:
    rng = random.Random(seed)
    kv = [rng.uniform(2_000, 400_000) for _ in range(400)]
    # a step: fixed part + slope * KV, plus prefill chunks that share some steps (never less)
    points = [(x, base + slope * x + w / 20) for x, w in zip(kv, waits(rng, len(kv)), strict=True)]
    found = envelope_slope(points)
    assert found is not None
    # within 10%, or an eighth of Llama-3-8B's 8e-8 where the slope is lost in the stalls
    assert found == pytest.approx(slope, rel=0.1, abs=1e-8)


def test_envelope_slope_cannot_tell_without_spread() -> None:
    assert envelope_slope([(10_000.0, 0.01)] * 50) is None  # one bucket
    assert envelope_slope([(10_000.0, 0.01)] * 50 + [(40_000.0, 0.02)] * 7) is None  # too few in the second


def slow_engine_samples(
    n: int, rate: float = 4_000.0, kv_read: float = 5e-7, seed: int = 1
) -> list[EngineSample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        tokens = rng.choice((2048, 4096, 8192))
        kv = rng.choice((20_000, 60_000, 150_000))
        output = rng.randint(20, 200)
        step = 0.01 + kv_read * kv + (0.0 if rng.random() < 0.3 else rng.uniform(0, 0.05))
        ttft = tokens / rate + (0.0 if rng.random() < 0.3 else rng.uniform(0, 1.0))
        samples.append(EngineSample(tokens, ttft, output, step * (output - 1), kv_in_flight=kv))
    return samples


def test_the_fit_keeps_its_prior_until_it_has_seen_enough_then_learns_both_figures() -> None:
    fit = EngineFit(15_000.0, 8e-8, refit_every=32)
    samples = slow_engine_samples(200)
    for sample in samples[:31]:
        fit.observe(sample)
    assert (fit.prefill_tokens_per_s, fit.kv_read_s_per_token, fit.fits) == (15_000.0, 8e-8, 0)
    for sample in samples[31:]:
        fit.observe(sample)
    assert fit.learned == {"prefill": True, "kv_read": True} and fit.fits == 6
    assert fit.prefill_tokens_per_s == pytest.approx(4_000, rel=0.03)
    assert fit.kv_read_s_per_token == pytest.approx(5e-7, rel=0.1)


def test_hops_that_say_nothing_of_a_figure_do_not_count_for_it() -> None:
    fit = EngineFit(15_000.0, 8e-8, refit_every=1)
    # prefilled little (its first token is mostly a decode step), decoded one token, no KV known
    for _ in range(100):
        fit.observe(EngineSample(prefill_tokens=200, ttft_s=0.5, output_tokens=1, decode_s=0.0))
        fit.observe(
            EngineSample(prefill_tokens=0, ttft_s=0.02, output_tokens=50, decode_s=2.0, kv_in_flight=0)
        )
    assert fit.samples == 0 and fit.fits == 0
    assert (fit.prefill_tokens_per_s, fit.kv_read_s_per_token) == (15_000.0, 8e-8)


WORKERS = {"p": [WorkerSlots("a", 1), WorkerSlots("b", 1)]}


def learned_queue(*, learn: bool, samples: list[EngineSample]) -> DispatchQueue:
    """A chain-aware queue (told a fast engine) that has run `samples`' hops on "b"."""
    config = ChainAwareConfig(prefill_tokens_per_s=60_000.0, max_affinity_wait_s=30.0, learn_engine=learn)
    q = DispatchQueue(policy=ChainAwarePolicy(config))
    for i, sample in enumerate(samples):
        view = HopView("p", f"probe{i}", "0", remaining_hops=0)
        q.submit("p", view.run_id, view.hop_id, 0.0, view)
        (hop,) = q.assign({"p": [WorkerSlots("b", 1)]}, now=0.0)
        q.finished(hop, 0.0, context_tokens=100, service_s=0.1, engine=sample)
    return q


@pytest.mark.parametrize("learn", [True, False])
def test_a_chain_waits_for_its_worker_as_long_as_the_learned_engine_takes_to_move_it(learn: bool) -> None:
    """Told 60k tokens/s, moving a 12k-token context costs 0.2 s: the chain's next hop
    gives up its busy worker after that. Learned from hops showing 4k tokens/s, the
    move costs 3 s, and the hop waits for its worker longer than that 0.2 s."""
    q = learned_queue(learn=learn, samples=slow_engine_samples(128))
    fit = q.policy.engine_fit("p")  # type: ignore[attr-defined]
    if learn:
        assert fit is not None and fit.prefill_tokens_per_s == pytest.approx(4_000, rel=0.03)
    else:
        assert fit is None
    q.submit("p", "c", "0", 1.0, HopView("p", "c", "0", prompt_tokens=12_000))
    (first,) = q.assign({"p": [WorkerSlots("a", 1)]}, now=1.0)
    q.finished(first, 2.0, context_tokens=12_000, service_s=1.0)
    blocker = HopView("p", "x", "0", remaining_hops=0)
    q.submit("p", "x", "0", 2.0, blocker)
    assert [h.worker_id for h in q.assign({"p": [WorkerSlots("a", 1)]}, now=2.0)] == ["a"]
    q.submit("p", "c", "1", 2.1, HopView("p", "c", "1", hop_index=1, prompt_tokens=12_100))
    placed = q.assign(WORKERS, now=3.0)  # "a" busy, "b" idle, 0.9 s later
    assert [h.worker_id for h in placed] == ([] if learn else ["b"])


def test_the_simulator_reports_its_engine_and_the_policy_learns_it() -> None:
    """An engine 2.5x slower to prefill than chain-aware is told (and without attention
    cost, so the rate is one number): what the policy prices with ends near the truth."""
    profile = EngineProfile(prefill_tokens_per_s=6_000, kv_read_ms_per_1k_tokens=0.3, prefill_attention_ms=0)
    trace = generate(workload("mix", 1).model_copy(update={"duration_s": 200.0}), profile).at_rate(0.5)
    untold: dict[str, object] = {
        "prefill_tokens_per_s": 15_000.0,
        "kv_read_s_per_token": 8e-8,
        "learn_engine": True,
    }
    policy = sim_policy("chain-aware", profile, untold)
    ClusterSim(trace, policy, profile, workers=4).run()
    fit = policy.engine_fit("sim")  # type: ignore[attr-defined]
    assert fit is not None and fit.learned == {"prefill": True, "kv_read": True}
    assert fit.prefill_tokens_per_s == pytest.approx(6_000, rel=0.1)
    # per token of KV as the scheduler counts it (prompts + max_tokens in flight, more
    # than the engine holds), so below the engine's per-token figure, and far above the prior
    assert 1.5e-7 < fit.kv_read_s_per_token <= 3.3e-7


def test_the_live_scheduler_reads_a_sample_off_the_workers_finished_event() -> None:
    event = scheduler_pb2.HopEvent(
        kind=scheduler_pb2.HopEvent.KIND_FINISHED,
        usage=common_pb2.TokenUsage(prompt_tokens=5000, completion_tokens=40, cached_prompt_tokens=1000),
        engine_ms=900.0,
        ttft_ms=500.0,
    )
    assert _engine_sample(event) == EngineSample(
        prefill_tokens=4000, ttft_s=0.5, output_tokens=40, decode_s=0.4
    )
    event.ttft_ms = 0.0  # a worker that reports no times says nothing
    assert _engine_sample(event) is None


async def test_the_scheduler_exports_what_it_prices_with_per_pool() -> None:
    """The gauges show the prior from the first sample on, and each refit after."""
    directory = PoolDirectory()
    directory.workers_by_pool = {
        "gauged": {"w1": common_pb2.WorkerInfo(worker_id="w1", pool="gauged", max_concurrency=1)}
    }
    dispatcher = HopDispatcher(directory, 16, policy_options={"prefill_tokens_per_s": 20_000.0})

    def gauges() -> tuple[float, float]:
        return (
            metrics.ENGINE_PREFILL_RATE.labels("gauged")._value.get(),
            metrics.ENGINE_KV_READ.labels("gauged")._value.get(),
        )

    samples = slow_engine_samples(64)
    for i, sample in enumerate(samples):
        hop, assigned = dispatcher.submit(HopView("gauged", f"r{i}", "h", remaining_hops=0))
        assert await asyncio.wait_for(assigned, 1) == "w1"
        dispatcher.finished(hop, 100, 0.1, sample)
        if i == 0:
            assert gauges() == (20_000.0, 8e-8)
    assert gauges()[0] == pytest.approx(4_000, rel=0.03)
    # The KV beside a hop is the queue's count (here every hop alike: nothing to fit),
    # not what the sample carried in.
    assert gauges()[1] == 8e-8


def test_a_replay_records_what_the_policy_priced_the_engine_with() -> None:
    profile = EngineProfile(prefill_tokens_per_s=6_000, prefill_attention_ms=0)
    trace = generate(workload("mix", 2).model_copy(update={"duration_s": 60.0}), profile).at_rate(0.5)
    learning = sim_policy("chain-aware", profile, {"learn_engine": True})
    learned = ClusterSim(trace, learning, profile, workers=2).run()
    assert learned.engine is not None and list(learned.engine) == ["sim"]
    assert learned.engine["sim"]["prefill_tokens_per_s"] == pytest.approx(6_000, rel=0.15)
    assert engine_line("sim", {"prefill_tokens_per_s": 6_000.0, "kv_read_s_per_token": 8e-8}) == (
        "pool sim's engine priced at 6,000 prefill tokens/s, "
        "0.080 ms of a decode step per 1k tokens of KV in flight"
    )
    # a policy that prices no engine time, or chain-aware told the engine (it takes a
    # calibration as given, as the live scheduler given --engine-profile): nothing learned
    assert ClusterSim(trace, sim_policy("round-robin", profile), profile, workers=2).run().engine is None
    assert ClusterSim(trace, sim_policy("chain-aware", profile), profile, workers=2).run().engine is None


def test_the_live_bench_reads_the_engine_figures_off_a_schedulers_metrics_page() -> None:
    page = (
        "# TYPE inferx_scheduler_engine_prefill_tokens_per_second gauge\n"
        'inferx_scheduler_engine_prefill_tokens_per_second{pool="sim"} 60000.0\n'
        'inferx_scheduler_engine_prefill_tokens_per_second{pool="half"} 1000.0\n'
        "# TYPE inferx_scheduler_engine_kv_read_seconds_per_token gauge\n"
        'inferx_scheduler_engine_kv_read_seconds_per_token{pool="sim"} 2e-08\n'
        "# TYPE inferx_scheduler_queue_depth gauge\n"
        'inferx_scheduler_queue_depth{pool="sim"} 3.0\n'
    )
    # ("half" shows one figure only: not reported as if it had both)
    assert engine_from_metrics(page) == {
        "sim": {"prefill_tokens_per_s": 60_000.0, "kv_read_s_per_token": 2e-8}
    }
    assert engine_from_metrics("# nothing here\n") is None


def test_the_benchmark_script_reports_the_true_and_the_learned_figures(tmp_path, capsys) -> None:
    """benchmarks/engine_fit.py: the figures of docs/benchmarks.md's table, and a clear
    error (not a traceback) for a profile that is not there."""
    script = load_benchmark_script("engine_fit")
    profile = tmp_path / "slow.yaml"
    profile.write_text("prefill_tokens_per_s: 6000\nprefill_attention_ms: 0\n")
    argv = ["--profile", str(profile), "--workload", "research", "--rate", "0.1", "--json"]
    assert script.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["true"]["prefill_tokens_per_s"] == 6_000
    assert report["learned"]["prefill_tokens_per_s"] == pytest.approx(6_000, rel=0.1)
    assert script.main(["--profile", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
