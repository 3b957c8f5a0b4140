"""Priced KV retention with a KV offload tier on the worker: a context let go comes
back from host memory at the load rate, so letting go costs the cheaper of that and a
re-prefill, and the scheduler holds for less (`offload_retention`, switchable)."""

from __future__ import annotations

import pytest

from inferx.scheduling.chain_aware import ChainAwareConfig, ChainAwarePolicy
from inferx.scheduling.queue import DispatchQueue
from inferx.scheduling.retention import hold_seconds, offload_fits
from inferx.scheduling.views import HopView, WorkerSlots

RATE = 15_000.0
KV = 450_000  # break-even hold without offload: 30 s


def hold(gaps: list[float], reload: float = 0.0) -> float:
    return hold_seconds(
        sorted(gaps),
        kv_capacity_tokens=KV,
        prefill_tokens_per_s=RATE,
        max_hold_s=600.0,
        reload_tokens_per_s=reload,
    )


def test_with_a_fast_offload_tier_the_break_even_hold_shrinks_by_the_speed_up() -> None:
    assert hold([]) == pytest.approx(30.0)
    assert hold([], reload=150_000.0) == pytest.approx(3.0)  # 10x faster back: 10x shorter
    # A tier slower than re-prefilling changes nothing: the cheaper way back is prefill.
    assert hold([], reload=5_000.0) == pytest.approx(30.0)


def test_gaps_held_through_without_offload_are_let_go_with_it() -> None:
    gaps = [1.0] * 10 + [10.0] * 10
    assert hold(gaps) == 10.0  # under the 30 s break-even: hold through both kinds
    assert hold(gaps, reload=150_000.0) == 1.0  # over the 3 s one: only the short calls
    assert hold([0.5] * 20, reload=150_000.0) == 0.5  # tool calls shorter still: kept


def test_a_context_counts_on_the_tier_only_if_it_takes_a_modest_share_of_it() -> None:
    assert offload_fits(40_000, 100_000, 0.5)
    assert not offload_fits(60_000, 100_000, 0.5)
    assert not offload_fits(1, 0, 0.5)  # no tier


# ----- in the policy ---------------------------------------------------------------------

CAPACITY = 100_000  # break-even hold at 15k tokens/s x (1 / factor 1): 6.7 s


def run_first_hop(workers: dict[str, list[WorkerSlots]], **config: object) -> ChainAwarePolicy:
    chosen = ChainAwarePolicy(ChainAwareConfig(realtime_guard=False, reprefill_cost_factor=1.0, **config))  # type: ignore[arg-type]
    q = DispatchQueue(policy=chosen)
    view = HopView("p", "c", "0", remaining_hops=3, prompt_tokens=19_900, max_tokens=100)
    q.submit("p", "c", "0", 0.0, view)
    (hop,) = q.assign(workers, now=0.0)
    q.finished(hop, 1.0, context_tokens=20_000, service_s=1.0)
    return chosen


def held_until(chosen: ChainAwarePolicy) -> float:
    state = chosen.chain("c")
    assert state is not None
    return state.held_until - 1.0 if state.held_tokens else 0.0


def test_the_policy_holds_for_less_on_a_worker_with_an_offload_tier() -> None:
    plain = {"p": [WorkerSlots("a", 8, CAPACITY)]}
    tier = {"p": [WorkerSlots("a", 8, CAPACITY, 400_000, 150_000)]}  # a tier: tokens, load rate
    without = held_until(run_first_hop(plain))
    with_tier = held_until(run_first_hop(tier))
    assert without == pytest.approx(CAPACITY / RATE * 1.05)
    assert with_tier == pytest.approx(CAPACITY / 150_000 * 1.05)
    # Switched off: the tier is ignored.
    assert held_until(run_first_hop(tier, offload_retention=False)) == pytest.approx(without)


def test_a_tier_reported_without_its_rate_uses_the_configured_one() -> None:
    tier = {"p": [WorkerSlots("a", 8, CAPACITY, host_kv_capacity_tokens=400_000)]}
    seconds = held_until(run_first_hop(tier, host_load_tokens_per_s=50_000.0))
    assert seconds == pytest.approx(CAPACITY / 50_000 * 1.05)


def test_a_context_too_big_for_the_tier_is_priced_as_a_re_prefill() -> None:
    small = {"p": [WorkerSlots("a", 8, CAPACITY, 30_000, 150_000)]}
    assert held_until(run_first_hop(small)) == pytest.approx(CAPACITY / RATE * 1.05)


def test_time_scaling_speeds_the_load_rate_up_with_the_clock() -> None:
    assert ChainAwareConfig().time_scaled(4.0).host_load_tokens_per_s == pytest.approx(4 * 190_000.0)
    # A rate the worker reports is in engine time too: a replay 4x faster holds 4x shorter.
    tier = {"p": [WorkerSlots("a", 8, CAPACITY, 400_000, 150_000)]}
    fast = held_until(run_first_hop(tier, clock_scale=4.0))
    assert fast == pytest.approx(CAPACITY / (4 * 150_000) * 1.05)
