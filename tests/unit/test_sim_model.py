"""The iteration-level engine model, the trace generator and the virtual-time cluster:
prefill and prefix reuse, LRU eviction, preemption, and the ranking of the policies."""

import math

import pytest

from inferx.bench.metrics import stats, summarize
from inferx.errors import InvalidArgument
from inferx.scheduling.registry import make_policy
from inferx.scheduling.views import HopView
from inferx.sim.cluster import ClusterSim, alone_latency_s
from inferx.sim.engine import EngineModel, SimRequest
from inferx.sim.kv import Segment
from inferx.sim.profile import EngineProfile, load_profile
from inferx.sim.records import ChainRecord, ReplayResult
from inferx.sim.trace import TraceConfig, generate, read_trace, write_trace


def run_alone(engine: EngineModel, request: SimRequest, now: float = 0.0) -> float:
    engine.add(request)
    while (plan := engine.plan()) is not None:
        now += plan.duration_s
        engine.commit(plan, plan.steps, now)
    return now


def test_step_time_follows_the_published_profile() -> None:
    p = EngineProfile()
    assert p.step_ms(1, 0, 0) == pytest.approx(10.0)
    assert p.step_ms(32, 0, 0) == pytest.approx(11.3)
    assert p.step_ms(0, 15_000, 0) == pytest.approx(1000.0)
    assert p.step_ms(1, 0, 100_000) == pytest.approx(10.0 + 8.0)  # KV reads


def test_cached_prefix_skips_prefill_and_output_is_cached_for_the_next_hop() -> None:
    engine = EngineModel(EngineProfile())
    sys = Segment("sys", 8000)
    first = SimRequest("a", (sys, Segment("a/0i", 100)), 10, output_segments=(Segment("a/0o", 10),))
    cold = run_alone(engine, first)
    nxt = (sys, Segment("a/0i", 100), Segment("a/0o", 10), Segment("a/1i", 100))
    second = SimRequest("b", nxt, 10)
    warm = run_alone(engine, second, cold) - cold
    assert second.cached_tokens == 8110 and first.cached_tokens == 0
    assert warm < cold / 3


def test_lru_evicts_the_least_recently_used_prefix() -> None:
    engine = EngineModel(EngineProfile(kv_capacity_tokens=2500))
    for key in ("x", "y", "z"):  # each leaves 1000 cached tokens; z needs x's room
        run_alone(engine, SimRequest(key, (Segment(key, 1000),), 1))
    assert "x" not in engine.kv and "y" in engine.kv and "z" in engine.kv
    assert engine.kv.evictions >= 1


def test_eviction_takes_the_tail_of_a_cached_prefix_first() -> None:
    # vLLM frees a request's blocks tail first, so memory pressure shortens a cached
    # prefix instead of dropping its head (which would make the rest useless).
    engine = EngineModel(EngineProfile(kv_capacity_tokens=3000))
    prompt = (Segment("c/0i", 1000), Segment("c/1i", 1000))
    run_alone(engine, SimRequest("a", prompt, 1, output_segments=(Segment("c/1o", 1),)))
    run_alone(engine, SimRequest("other", (Segment("o", 1500),), 1))
    assert "c/0i" in engine.kv and "c/1i" not in engine.kv and "c/1o" not in engine.kv
    again = SimRequest("b", (Segment("c/0i", 1000), Segment("c/1i", 1000)), 1)
    run_alone(engine, again)
    assert again.cached_tokens == 1000


def test_sequences_are_preempted_when_kv_runs_out_and_still_finish() -> None:
    engine = EngineModel(EngineProfile(kv_capacity_tokens=2200, max_batched_tokens=4096))
    requests = [SimRequest(f"r{i}", (Segment(None, 900),), 300, priority=i) for i in range(2)]
    for request in requests:
        engine.add(request)
    now = 0.0
    while (plan := engine.plan()) is not None:
        now += plan.duration_s
        engine.commit(plan, plan.steps, now)
    assert engine.preemptions >= 1
    assert requests[1].preemptions >= 1 and requests[0].preemptions == 0  # lowest priority goes
    assert all(r.finished_at is not None for r in requests)
    assert engine.kv.pinned == 0


def test_a_reply_stops_when_its_sequence_fills_the_pool_and_the_engine_goes_on() -> None:
    """vLLM caps a sequence at max_model_len (at most the KV pool). Without the cap a
    sequence outgrowing the pool preempted itself, could never be admitted again and,
    at the head of the queue, blocked every later request on that engine for good."""
    engine = EngineModel(EngineProfile(kv_capacity_tokens=1000, max_batched_tokens=4096))
    greedy = SimRequest("greedy", (Segment(None, 990),), 40)
    after = SimRequest("after", (Segment(None, 100),), 5)
    engine.add(greedy)
    engine.add(after)
    run_alone(engine, SimRequest("last", (Segment(None, 10),), 1))
    assert greedy.finished_at is not None and greedy.generated == 10  # cut at the pool
    assert after.finished_at is not None
    assert engine.preemptions == 0 and engine.kv.pinned == 0


def test_a_prompt_longer_than_the_pool_is_refused_not_queued() -> None:
    engine = EngineModel(EngineProfile(kv_capacity_tokens=1000))
    with pytest.raises(InvalidArgument, match="1,000 tokens .*max_model_len"):
        engine.add(SimRequest("huge", (Segment(None, 1000),), 1))
    assert engine.idle


def test_priority_orders_admission_and_equal_priorities_are_fcfs() -> None:
    engine = EngineModel(EngineProfile(max_num_seqs=1))
    for name, priority in (("late-low", 5), ("high", 0), ("low", 5)):
        engine.add(SimRequest(name, (Segment(None, 10),), 1, priority=priority))
    finished = []
    now = 0.0
    while (plan := engine.plan()) is not None:
        now += plan.duration_s
        finished += [r.request_id for r in engine.commit(plan, plan.steps, now).finished]
    assert finished == ["high", "late-low", "low"]


def test_trace_is_deterministic_round_trips_and_rescales(tmp_path) -> None:
    config = TraceConfig(seed=7, duration_s=120, rate_per_s=1.0)
    trace = generate(config)
    assert generate(config) == trace
    kinds = {c.kind for c in trace.chains}
    assert kinds == {"chat", "bfcl", "swe"}
    swe = [c for c in trace.chains if c.kind == "swe"]
    assert all(15 <= len(c.hops) <= 30 and c.prompt_tokens(len(c.hops) - 1) > 12_000 for c in swe)
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    assert read_trace(path) == trace
    faster = trace.at_rate(2.0)
    assert faster.chains[5].arrival_s == pytest.approx(trace.chains[5].arrival_s / 2)
    (tmp_path / "bad.jsonl").write_text('{"chain_id": 1}\n')
    with pytest.raises(InvalidArgument, match="meta"):
        read_trace(tmp_path / "bad.jsonl")


def test_profile_file_overrides_defaults(tmp_path) -> None:
    path = tmp_path / "gpu.yaml"
    path.write_text("decode_step_ms: 7.5\nprefill_tokens_per_s: 30000\n")
    profile = load_profile(path)
    assert profile.decode_step_ms == 7.5 and profile.kv_capacity_tokens == 425_984
    path.write_text("decode_step_ms: -1\n")
    with pytest.raises(InvalidArgument, match="decode_step_ms"):
        load_profile(path)


def test_metrics_count_shed_chains_as_misses() -> None:
    ok = ChainRecord("a", "chat", "realtime", 0, slo_s=10, alone_s=2, status="ok", latency_s=4)
    shed = ChainRecord("b", "chat", "realtime", 0, slo_s=10, alone_s=2, status="shed")
    s = stats([ok, shed], window_s=10, preemptions=0)
    assert s.slo_attainment == pytest.approx(0.5) and s.goodput_per_s == pytest.approx(0.1)
    assert math.isinf(s.latency_p99_s) and s.latency_p50_s == pytest.approx(4)


def test_serving_time_is_latency_minus_the_chains_tool_and_think_time() -> None:
    trace = generate(TraceConfig(seed=2, duration_s=30, rate_per_s=1.0, mix={"bfcl": 1.0}))
    chain = trace.chains[0]
    record = ChainRecord.start(chain, alone_s=1.0)
    delays = sum(hop.delay_after_s for hop in chain.hops[:-1])
    assert delays > 0 and record.delays_s == pytest.approx(delays)
    record.finish("ok", chain.arrival_s + delays + 3.0)
    s = stats([record], window_s=30, preemptions=0)
    assert s.serving_p99_s == pytest.approx(3.0) and s.latency_p99_s == pytest.approx(delays + 3.0)


def test_chain_aware_beats_round_robin_past_round_robins_saturation() -> None:
    """A small deterministic run: same trace, same engines, only the policy differs."""
    trace = generate(TraceConfig(seed=11, duration_s=240, rate_per_s=1.5))
    results = {}
    for name in ("round-robin", "chain-aware"):
        run = ClusterSim(trace, make_policy(name), EngineProfile(), workers=4).run()
        results[name] = summarize(run)
    base, aware = results["round-robin"].overall, results["chain-aware"].overall
    assert aware.prefix_hit_rate > base.prefix_hit_rate + 0.1
    assert aware.latency_p99_s < base.latency_p99_s
    assert aware.goodput_per_s > base.goodput_per_s
    assert results["chain-aware"].tiers["realtime"].slo_attainment >= 0.99


def test_alone_latency_includes_delays_and_model_time() -> None:
    trace = generate(TraceConfig(seed=3, duration_s=30, rate_per_s=1.0))
    chain = trace.chains[0]
    alone = alone_latency_s(chain, EngineProfile())
    assert alone > chain.delays_s() + chain.model_alone_s(EngineProfile()) * 0.9


def test_replay_summary_has_every_tier_of_the_trace() -> None:
    trace = generate(TraceConfig(seed=5, duration_s=60, rate_per_s=1.0))
    run: ReplayResult = ClusterSim(trace, make_policy("chain-aware"), workers=2).run()
    summary = summarize(run)
    assert set(summary.tiers) == {c.tier for c in trace.chains}
    assert summary.overall.completed == len(trace.chains)


class _Recording:
    """Wraps a policy and records what it is told: each hop's view and the chain ends."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.views: list[HopView] = []
        self.ends: list[str] = []
        self.name = inner.name

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def admit(self, hop, workers, queued, now):
        self.views.append(hop)
        return self.inner.admit(hop, workers, queued, now)

    def on_chain_end(self, chain_key, now) -> None:
        self.ends.append(chain_key)
        self.inner.on_chain_end(chain_key, now)


@pytest.mark.parametrize("programs", [False, True])
def test_programs_mode_hides_the_rest_of_the_path_and_the_end(programs: bool) -> None:
    """As dynamic programs (the OpenAI front), the scheduler is told neither the calls
    left nor the expected rest of the path, nor when a program ends; as declared chains
    it is told all three. The chains complete either way."""
    trace = generate(TraceConfig(seed=5, duration_s=60, rate_per_s=1.0))
    policy = _Recording(make_policy("chain-aware"))
    run = ClusterSim(trace, policy, workers=2, programs=programs).run()
    assert summarize(run).overall.completed == len(trace.chains)
    remaining = {view.remaining_hops for view in policy.views}
    if programs:
        assert remaining == {None}
        assert all(view.remaining_critical_path_s == 0.0 for view in policy.views)
        assert policy.ends == []
    else:
        assert None not in remaining and 0 in remaining
        assert len(policy.ends) == len(trace.chains)
