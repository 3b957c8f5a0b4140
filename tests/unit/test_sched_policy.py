"""Each rule of the scheduling policies on hand-built queues (pure code, no clock)."""

import pytest

from inferx.scheduling.chain_aware import ChainAwareConfig, ChainAwarePolicy
from inferx.scheduling.policy import BaselinePolicy, make_policy
from inferx.scheduling.queue import DispatchQueue, Rejected
from inferx.scheduling.views import (
    TIER_BATCH,
    TIER_REALTIME,
    TIER_STANDARD,
    HopView,
    WorkerSlots,
)

ONE = {"p": [WorkerSlots("a", 1)]}
TWO = {"p": [WorkerSlots("a", 4), WorkerSlots("b", 4)]}


def view(run: str, hop: str = "0", **kw) -> HopView:
    return HopView("p", run, hop, **kw)


def chain_aware(**config) -> DispatchQueue:
    return DispatchQueue(policy=ChainAwarePolicy(ChainAwareConfig(**config)))


def submit(q: DispatchQueue, v: HopView, now: float):
    return q.submit(v.pool, v.run_id, v.hop_id, now, v)


def test_realtime_goes_before_standard_before_batch() -> None:
    q = chain_aware()
    q.assign({"p": []}, 0)
    for i, tier in enumerate((TIER_BATCH, TIER_STANDARD, TIER_REALTIME)):
        submit(q, view(f"r{tier}", tier=tier), now=i)
    order = []
    for t in range(3):
        (hop,) = q.assign(ONE, now=10 + t)
        order.append(hop.view.tier)
        q.finished(hop, 10 + t)
    assert order == [TIER_REALTIME, TIER_STANDARD, TIER_BATCH]


def test_chain_under_way_goes_before_a_new_chain() -> None:
    q = chain_aware()
    submit(q, view("new", tier=TIER_STANDARD), now=0)
    submit(q, view("old", "3", tier=TIER_STANDARD, hop_index=3), now=1)
    (hop,) = q.assign(ONE, now=2)
    assert hop.run_id == "old"


def test_short_hops_first_within_a_tier_until_the_starvation_bound() -> None:
    q = chain_aware(starvation_s=10.0)
    submit(q, view("long", prompt_tokens=20_000), now=0)
    submit(q, view("short", prompt_tokens=100), now=1)
    (hop,) = q.assign(ONE, now=2)
    assert hop.run_id == "short"
    q.finished(hop, 3)
    submit(q, view("short2", prompt_tokens=100), now=20)
    (hop,) = q.assign(ONE, now=20)  # "long" has waited 20 s > 10 s: it goes now
    assert hop.run_id == "long"


def test_slack_orders_chains_by_deadline_minus_remaining_work() -> None:
    q = chain_aware(progress="slack")
    submit(q, view("relaxed", "1", hop_index=1, deadline=100.0), now=0)
    submit(q, view("tight", "1", hop_index=1, deadline=60.0, remaining_critical_path_s=5), now=1)
    (hop,) = q.assign(ONE, now=2)
    assert hop.run_id == "tight"


def test_attained_service_prefers_the_chain_that_received_more() -> None:
    policy = ChainAwarePolicy(ChainAwareConfig(progress="attained"))
    q = DispatchQueue(policy=policy)
    for run, service in (("little", 1.0), ("much", 9.0)):
        first = submit(q, view(run), now=0)
        (hop,) = q.assign({"p": [WorkerSlots("a", 4)]}, now=0)
        assert hop is first
        q.finished(hop, 1, context_tokens=100, service_s=service)
    submit(q, view("little", "1", hop_index=1), now=2)
    submit(q, view("much", "1", hop_index=1), now=3)
    (hop,) = q.assign(ONE, now=4)
    assert hop.run_id == "much"


def test_affinity_keeps_a_chain_on_the_worker_that_holds_its_prefix() -> None:
    q = chain_aware()
    submit(q, view("c"), now=0)
    (first,) = q.assign(TWO, now=0)
    for i in range(2):  # load the chain's worker so the other one is emptier
        submit(q, view(f"other{i}", session_id=""), now=0)
    q.assign({"p": [WorkerSlots(first.worker_id or "", 4)]}, now=0)
    q.finished(first, 1, context_tokens=8000, service_s=1)
    submit(q, view("c", "1", hop_index=1, prompt_tokens=8200), now=2)
    (second,) = q.assign(TWO, now=2)
    assert second.worker_id == first.worker_id


def test_affinity_waits_for_a_busy_home_then_falls_back() -> None:
    q = chain_aware(max_affinity_wait_s=5.0)
    workers = {"p": [WorkerSlots("a", 1), WorkerSlots("b", 1)]}
    submit(q, view("c"), now=0)
    (first,) = q.assign({"p": [WorkerSlots("a", 1)]}, now=0)
    q.finished(first, 1, context_tokens=30_000, service_s=1)  # 2 s to re-prefill elsewhere
    blocker = submit(q, view("x"), now=1)
    assert q.assign({"p": [WorkerSlots("a", 1)]}, now=1) == [blocker]
    submit(q, view("c", "1", hop_index=1, prompt_tokens=30_100), now=2)
    assert q.assign(workers, now=2.5) == []  # home "a" is busy: wait, "b" stays idle
    assert q.next_wake is not None and 2.5 < q.next_wake <= 4.01
    (hop,) = q.assign(workers, now=4.5)  # patience (the re-prefill cost) ran out
    assert hop.worker_id == "b"


def test_home_without_room_for_the_kv_falls_back_to_the_freest_worker() -> None:
    q = chain_aware(max_affinity_wait_s=0.0)
    workers = {"p": [WorkerSlots("a", 8, 10_000), WorkerSlots("b", 8, 10_000)]}
    submit(q, view("c", prompt_tokens=100), now=0)
    (first,) = q.assign({"p": [WorkerSlots("a", 8, 10_000)]}, now=0)
    q.finished(first, 1, context_tokens=200, service_s=1)
    big = submit(q, view("big", prompt_tokens=8000, tier=TIER_REALTIME), now=1)
    assert q.assign({"p": [WorkerSlots("a", 8, 10_000)]}, now=1) == [big]
    submit(q, view("c", "1", hop_index=1, prompt_tokens=4000, tier=TIER_REALTIME), now=2)
    (hop,) = q.assign(workers, now=2)
    assert hop.worker_id == "b"


def test_other_tiers_leave_kv_headroom_for_realtime() -> None:
    q = chain_aware(shared_kv_share=0.5)
    workers = {"p": [WorkerSlots("a", 8, 10_000)]}
    submit(q, view("running", prompt_tokens=4000), now=0)
    assert len(q.assign(workers, now=0)) == 1
    submit(q, view("std", prompt_tokens=2000, tier=TIER_STANDARD), now=1)
    submit(q, view("rt", prompt_tokens=2000, tier=TIER_REALTIME), now=2)
    assigned = q.assign(workers, now=3)
    assert [h.run_id for h in assigned] == ["rt"]


def test_new_batch_chains_wait_under_load_and_go_once_starved() -> None:
    q = chain_aware(batch_wait_load=0.5, tier_starvation_s=60)
    workers = {"p": [WorkerSlots("a", 4)]}
    for i in range(3):
        submit(q, view(f"rt{i}", tier=TIER_REALTIME), now=0)
    assert len(q.assign(workers, now=0)) == 3  # 75% of the slots busy
    submit(q, view("batch", tier=TIER_BATCH), now=1)
    submit(q, view("batch-old", "2", tier=TIER_BATCH, hop_index=2), now=1)
    assert [h.run_id for h in q.assign(workers, now=2)] == ["batch-old"]  # under way: goes
    workers = {"p": [WorkerSlots("a", 5)]}
    assert q.assign(workers, now=30) == []
    assert [h.run_id for h in q.assign(workers, now=62)] == ["batch"]


def test_new_batch_chains_are_shed_past_the_threshold_and_realtime_never() -> None:
    q = chain_aware(shed_load=0.9, shed_queue=1, batch_wait_load=0.5, retry_after_s=7)
    workers = {"p": [WorkerSlots("a", 1)]}
    submit(q, view("busy", tier=TIER_REALTIME), now=0)
    q.assign(workers, now=0)
    submit(q, view("b1", tier=TIER_BATCH), now=1)  # first waiting batch hop: accepted
    with pytest.raises(Rejected) as refused:
        submit(q, view("b2", tier=TIER_BATCH), now=2)
    assert refused.value.retry_after_s == 7
    submit(q, view("b3", "4", tier=TIER_BATCH, hop_index=4), now=3)  # under way: kept
    for i in range(5):
        submit(q, view(f"rt{i}", tier=TIER_REALTIME), now=4)


def test_engine_priority_follows_the_policy_order() -> None:
    q = chain_aware()
    submit(q, view("b", tier=TIER_BATCH), now=0)
    submit(q, view("r", tier=TIER_REALTIME), now=0)
    hops = {h.run_id: h for h in q.assign(TWO, now=0)}
    assert hops["r"].engine_priority < hops["b"].engine_priority


def test_baseline_is_fcfs_round_robin_with_one_engine_priority() -> None:
    q = DispatchQueue(policy=make_policy("baseline"))
    assert isinstance(q.policy, BaselinePolicy) and q.policy_name == "round-robin"
    submit(q, view("c", tier=TIER_BATCH), now=0)
    submit(q, view("c", "1", tier=TIER_REALTIME), now=1)
    submit(q, view("c", "2", tier=TIER_REALTIME), now=2)
    workers = {"p": [WorkerSlots("a", 8), WorkerSlots("b", 8), WorkerSlots("c", 8)]}
    hops = q.assign(workers, now=3)
    assert [h.hop_id for h in hops] == ["0", "1", "2"]  # arrival order, tiers ignored
    assert [h.worker_id for h in hops] == ["a", "b", "c"]  # round-robin, no affinity
    assert {h.engine_priority for h in hops} == {0}
    submit(q, view("c", "3"), now=4)
    assert q.assign(workers, now=4)[0].worker_id == "a"


def test_chain_state_expires_after_its_ttl() -> None:
    policy = ChainAwarePolicy(ChainAwareConfig(chain_ttl_s=10))
    q = DispatchQueue(policy=policy)
    submit(q, view("c"), now=0)
    (hop,) = q.assign(TWO, now=0)
    q.finished(hop, 1, context_tokens=500, service_s=1)
    assert policy.chain("c") is not None and policy.resident(hop.worker_id or "") == 500
    submit(q, view("d"), now=20)
    q.assign(TWO, now=20)
    assert policy.chain("c") is None and policy.resident(hop.worker_id or "") == 0


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="chain-aware"):
        make_policy("fastest")


def test_time_scaled_config_shrinks_every_time_constant() -> None:
    from inferx.scheduling.chain_aware import ChainAwareConfig

    base = ChainAwareConfig()
    fast = base.time_scaled(4)
    assert fast.starvation_s == pytest.approx(base.starvation_s / 4)
    assert fast.tier_starvation_s == pytest.approx(base.tier_starvation_s / 4)
    assert fast.max_affinity_wait_s == pytest.approx(base.max_affinity_wait_s / 4)
    assert fast.chain_ttl_s == pytest.approx(base.chain_ttl_s / 4)
    assert fast.prefill_tokens_per_s == pytest.approx(base.prefill_tokens_per_s * 4)
    assert fast.buckets == base.buckets  # sizes are not times


# ----- reuse window, warm KV, chain end, per-pool affinity, look-ahead (issue #7) -----------


def _run_hops(q: DispatchQueue, run: str, hops: int, workers: dict, start: float = 0.0, **kw) -> list[str]:
    """Run `hops` consecutive hops of one chain; the workers they ran on."""
    placed = []
    for k in range(hops):
        now = start + 2 * k
        submit(q, view(run, str(k), hop_index=k, prompt_tokens=1000 * (k + 1), **kw), now=now)
        (hop,) = q.assign(workers, now=now)
        placed.append(hop.worker_id or "")
        q.finished(hop, now + 1, context_tokens=1000 * (k + 1) + 50, service_s=1)
    return placed


def test_affinity_lasts_the_reuse_window_then_the_chain_moves_to_a_freer_worker() -> None:
    q = chain_aware(reuse_window_hops=3, rebalance_margin=0.1)
    workers = {"p": [WorkerSlots("a", 4, 100_000), WorkerSlots("b", 4, 100_000)]}
    placed = _run_hops(q, "c", 3, workers)
    assert len(set(placed)) == 1  # within the window: always its worker
    home = placed[0]
    other = "b" if home == "a" else "a"
    # Load the home worker (two long-running hops of other chains) so the other is freer.
    for i in range(2):
        submit(q, view(f"busy{i}", prompt_tokens=200), now=6)
    assert {h.worker_id for h in q.assign({"p": [WorkerSlots(home, 4, 100_000)]}, now=6)} == {home}
    submit(q, view("c", "3", hop_index=3, prompt_tokens=4000), now=7)
    (hop,) = q.assign(workers, now=7)
    assert hop.worker_id == other  # window over: placed by load


def test_past_the_window_a_chain_stays_home_when_loads_are_close() -> None:
    q = chain_aware(reuse_window_hops=2, rebalance_margin=0.1)
    workers = {"p": [WorkerSlots("a", 4, 100_000), WorkerSlots("b", 4, 100_000)]}
    placed = _run_hops(q, "c", 5, workers)
    assert len(set(placed)) == 1  # its held context makes home look fuller; the margin keeps it


def test_zero_window_means_affinity_without_limit() -> None:
    q = chain_aware(reuse_window_hops=0)
    workers = {"p": [WorkerSlots("a", 4, 100_000), WorkerSlots("b", 4, 100_000)]}
    assert len(set(_run_hops(q, "c", 8, workers))) == 1


def test_an_idle_chains_context_is_held_for_kv_warm_s_only() -> None:
    policy = ChainAwarePolicy(ChainAwareConfig(kv_retention="fixed", kv_warm_s=10, chain_ttl_s=300))
    q = DispatchQueue(policy=policy)
    submit(q, view("c", remaining_hops=3), now=0)
    (hop,) = q.assign(TWO, now=0)
    q.finished(hop, 1, context_tokens=700, service_s=1)
    worker = hop.worker_id or ""
    assert policy.resident(worker) == 700  # a tool call: its KV is kept warm
    submit(q, view("d"), now=12)
    q.assign(TWO, now=12)  # any event past the warm time lets the hold go
    assert policy.resident(worker) == 0
    state = policy.chain("c")
    assert state is not None and state.worker_id == worker  # affinity stays


def test_the_runs_last_hop_lets_its_context_go_at_once_but_a_sessions_is_kept() -> None:
    policy = ChainAwarePolicy(ChainAwareConfig(kv_warm_s=30))
    q = DispatchQueue(policy=policy)
    submit(q, view("done", remaining_hops=0), now=0)
    submit(q, view("turn", remaining_hops=0, session_id="s1"), now=0)
    hops = q.assign(TWO, now=0)
    for hop in hops:
        q.finished(hop, 1, context_tokens=500, service_s=1)
    assert policy.chain("done") is None
    session = policy.chain("s1")
    assert session is not None and policy.resident(session.worker_id or "") == 500


def test_held_context_keeps_new_chains_off_a_worker_that_has_no_room_besides() -> None:
    q = chain_aware(kv_budget=0.9, kv_retention="fixed", kv_warm_s=30)
    workers = {"p": [WorkerSlots("a", 8, 10_000), WorkerSlots("b", 8, 10_000)]}
    submit(q, view("c", remaining_hops=2, prompt_tokens=6000), now=0)
    (first,) = q.assign({"p": [WorkerSlots("a", 8, 10_000)]}, now=0)
    q.finished(first, 1, context_tokens=7000, service_s=1)  # held on "a" during its tool call
    busy = submit(q, view("x", prompt_tokens=100), now=1)
    assert q.assign({"p": [WorkerSlots("b", 8, 10_000)]}, now=1) == [busy]  # "b" has a hop running
    submit(q, view("new", prompt_tokens=3000), now=2)
    (hop,) = q.assign(workers, now=2)
    assert hop.worker_id == "b"  # 3000 + 7000 held would overflow "a"


def test_affinity_is_per_pool_for_chains_that_use_two_models() -> None:
    q = chain_aware()
    pools = {
        "small": [WorkerSlots("s1", 4), WorkerSlots("s2", 4)],
        "big": [WorkerSlots("b1", 4), WorkerSlots("b2", 4)],
    }
    seen: dict[str, set[str | None]] = {}
    for k, pool in enumerate(["small", "big", "small", "big", "small"]):
        v = HopView(pool, "c", str(k), hop_index=k, prompt_tokens=500 * (k + 1), remaining_hops=4 - k)
        q.submit(pool, "c", str(k), k, v)
        (hop,) = q.assign(pools, now=k)
        seen.setdefault(pool, set()).add(hop.worker_id)
        q.finished(hop, k + 0.5, context_tokens=500 * (k + 1) + 20, service_s=0.5)
    assert all(len(workers) == 1 for workers in seen.values()), seen


def test_plan_ahead_holds_room_on_the_next_pool_and_the_hop_lands_there() -> None:
    policy = ChainAwarePolicy(ChainAwareConfig())
    q = DispatchQueue(policy=policy)
    pools = {
        "small": [WorkerSlots("s", 4, 50_000)],
        "big": [WorkerSlots("b1", 4, 50_000), WorkerSlots("b2", 4, 50_000)],
    }
    q.assign(pools, now=0)
    nxt = HopView("big", "c", "answer", prompt_tokens=4000, max_tokens=100)
    target = q.plan_ahead(nxt, until=30, now=0)
    assert target in ("b1", "b2") and policy.resident(target) == 4100
    # Another chain placed meanwhile goes to the other big worker: room is kept.
    submit_big = HopView("big", "other", "0", prompt_tokens=100)
    q.submit("big", "other", "0", 1, submit_big)
    (other,) = q.assign(pools, now=1)
    assert other.worker_id != target
    q.submit("big", "c", "answer", 2, HopView("big", "c", "answer", hop_index=1, prompt_tokens=4000))
    (hop,) = q.assign(pools, now=2)
    assert hop.worker_id == target and policy.resident(target) == 0  # the hold became the hop


def test_plan_ahead_hold_expires_and_can_be_dropped() -> None:
    policy = ChainAwarePolicy(ChainAwareConfig())
    q = DispatchQueue(policy=policy)
    q.assign({"big": [WorkerSlots("b", 4, 50_000)]}, now=0)
    nxt = HopView("big", "c", "answer", prompt_tokens=1000)
    assert q.plan_ahead(nxt, until=5, now=0) == "b" and policy.resident("b") > 0
    q.drop_ahead(nxt)
    assert policy.resident("b") == 0
    assert q.plan_ahead(nxt, until=5, now=1) == "b"
    q.submit("big", "x", "0", 6, HopView("big", "x", "0"))
    q.assign({"big": [WorkerSlots("b", 4, 50_000)]}, now=6)
    assert policy.resident("b") == 0  # the hop never came: the hold ran out


def test_plan_ahead_finds_no_room_when_every_worker_is_full() -> None:
    q = chain_aware(kv_budget=0.9)
    q.assign({"big": [WorkerSlots("b", 4, 1_000)]}, now=0)
    assert q.plan_ahead(HopView("big", "c", "a", prompt_tokens=5_000), until=5, now=0) is None


def test_baseline_does_not_look_ahead() -> None:
    q = DispatchQueue(policy=make_policy("baseline"))
    q.assign({"big": [WorkerSlots("b", 4, 50_000)]}, now=0)
    assert q.plan_ahead(HopView("big", "c", "a", prompt_tokens=100), until=5, now=0) is None
