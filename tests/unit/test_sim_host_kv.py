"""The simulator's KV offload tier: what the GPU evicts goes to host memory (LRU), a
prompt whose prefix is there loads it back at the PCIe rate instead of re-prefilling
it, and a profile without the tier behaves exactly as before."""

import pytest

from inferx.sim.engine import EngineModel, SimRequest
from inferx.sim.host_kv import HostKv
from inferx.sim.kv import KvPool, Segment
from inferx.sim.profile import EngineProfile


def run_alone(engine: EngineModel, request: SimRequest, now: float = 0.0) -> float:
    engine.add(request)
    while (plan := engine.plan()) is not None:
        now += plan.duration_s
        engine.commit(plan, plan.steps, now)
    return now


def test_host_tier_keeps_lru_and_drops_what_does_not_fit() -> None:
    host = HostKv(2500)
    for key in ("a", "b", "c"):
        host.store(key, 1000)
    assert "a" not in host and "b" in host and "c" in host  # a was least recently stored
    assert host.used == 2000 and host.evictions == 1 and host.stored == 3
    host.store("huge", 3000)  # larger than the tier: dropped, nothing else lost
    assert "huge" not in host and host.used == 2000 and host.evictions == 2
    assert host.take("b") == 1000 and "b" not in host and host.used == 1000 and host.loads == 1
    host.discard("c")
    host.discard("absent")
    assert host.used == 0 and len(host) == 0


def test_gpu_eviction_offloads_and_recompute_removes_the_host_copy() -> None:
    pool = KvPool(2000, HostKv(10_000))
    pool.insert("x", 1000, pinned=False)
    pool.insert("y", 1000, pinned=False)
    assert pool.make_room(1000)
    assert "x" not in pool and pool.host is not None and "x" in pool.host
    assert pool.host.tokens_of("x") == 1000
    pool.insert("x", 1000, pinned=True)  # recomputed on the GPU: one tier holds it
    assert "x" not in pool.host and pool.host.used == 0


def test_without_host_tier_evicted_prefixes_are_lost() -> None:
    pool = KvPool(1000)
    pool.insert("x", 1000, pinned=False)
    assert pool.make_room(1000) and "x" not in pool and pool.host is None


def offload_profile(**overrides: object) -> EngineProfile:
    values: dict[str, object] = dict(kv_capacity_tokens=10_000, host_kv_capacity_tokens=100_000)
    values.update(overrides)
    return EngineProfile(**values)


def evict_chain_then_return(engine: EngineModel) -> tuple[SimRequest, float]:
    """A chain's 8k-token context is evicted by another's, then its next hop comes back.
    Returns the returning hop and its latency alone on the engine."""
    first = SimRequest("c0", (Segment("c/0i", 8000),), 1, output_segments=(Segment("c/0o", 1),))
    now = run_alone(engine, first)
    now = run_alone(engine, SimRequest("other", (Segment("o", 9000),), 1), now)
    assert "c/0i" not in engine.kv
    back = SimRequest("c1", (Segment("c/0i", 8000), Segment("c/0o", 1), Segment("c/1i", 100)), 1)
    return back, run_alone(engine, back, now) - now


def test_a_prefix_in_host_memory_is_loaded_back_at_the_transfer_cost() -> None:
    profile = offload_profile()
    engine = EngineModel(profile)
    back, latency = evict_chain_then_return(engine)
    assert back.loaded_tokens == 8001 and back.cached_tokens == 0  # the context and its output
    assert engine.loaded_tokens_total == 8001
    assert engine.kv.host is not None and "c/0i" not in engine.kv.host  # back on the GPU
    assert "c/0i" in engine.kv
    load_s = 8001 / profile.host_load_tokens_per_s
    # The load, then a prefill of what was neither cached nor offloaded (100 new tokens).
    rest_s = profile.step_ms(0, 100, 0, 100 * (8001 + 50)) / 1000
    assert latency == pytest.approx(load_s + rest_s, rel=0.02)

    lost = EngineModel(EngineProfile(kv_capacity_tokens=10_000))  # the same without a tier
    again, reprefill = evict_chain_then_return(lost)
    assert again.loaded_tokens == 0 and again.cached_tokens == 0
    assert latency < reprefill / 3  # ~190k tokens/s over PCIe against 15k of prefill


def test_a_full_host_tier_loses_the_prefix_and_it_is_re_prefilled() -> None:
    engine = EngineModel(offload_profile(host_kv_capacity_tokens=5000))  # smaller than the context
    back, _ = evict_chain_then_return(engine)
    assert back.loaded_tokens == 0
    assert engine.kv.host is not None and engine.kv.host.evictions >= 1


def test_a_load_does_not_stall_the_others() -> None:
    # While the returning hop's prefix comes back over PCIe, a decoding sequence keeps
    # its step time: the copy runs beside compute.
    profile = offload_profile(host_kv_gbps=0.1)  # slow link: ~760 tokens/s
    engine = EngineModel(profile)
    back, _ = evict_chain_then_return(engine)  # warms up; now evict again
    run_alone(engine, SimRequest("other2", (Segment("o2", 9000),), 1))
    assert "c/0i" not in engine.kv
    decoding = SimRequest("d", (Segment(None, 10),), 200)
    engine.add(decoding)
    again = SimRequest("c2", back.prompt, 1)
    engine.add(again)
    now, step_times = 0.0, []
    while (plan := engine.plan()) is not None:
        if plan.decodes and not plan.prefills:
            step_times.append(plan.step_s)
        now += plan.duration_s
        engine.commit(plan, plan.steps, now)
    assert again.loaded_tokens > 8000 and again.finished_at is not None
    assert decoding.finished_at is not None
    assert decoding.finished_at < again.finished_at  # 200 decodes ~2 s; the load ~10 s
    assert max(step_times) == pytest.approx(profile.step_ms(1, 0, 10 + 200) / 1000, rel=0.05)
    assert engine.kv.pinned == 0


def test_host_tier_off_leaves_the_model_unchanged() -> None:
    plain = EngineModel(EngineProfile(kv_capacity_tokens=10_000))
    assert plain.kv.host is None
    assert EngineProfile().host_kv_capacity_tokens == 0
    assert EngineProfile().host_load_tokens_per_s == pytest.approx(25e9 / 131072)


def test_the_sim_worker_reports_its_profiles_tier() -> None:
    from inferx_worker.engines.sim_engine import SimEngine, SimParams

    capacity = SimEngine(SimParams(profile=offload_profile())).capacity()
    assert capacity.host_kv_capacity_tokens == 100_000
    assert capacity.host_kv_load_tokens_per_s == pytest.approx(EngineProfile().host_load_tokens_per_s)
    assert SimEngine(SimParams(profile=EngineProfile())).capacity().host_kv_load_tokens_per_s == 0.0
