"""Tiers protected under overload (`inferx.scheduling.overload` and chain-aware's
`overload_control`): the AIMD window of chains per tier, the stretch signal, and
that past the window new chains of lower tiers wait, then are shed, while realtime
and chains already under way go on."""

from __future__ import annotations

import math

import pytest

from inferx.scheduling.chain_aware import ChainAwareConfig, ChainAwarePolicy
from inferx.scheduling.overload import ChainWindow, GuardScale, RecentStretch
from inferx.scheduling.queue import DispatchQueue, Rejected
from inferx.scheduling.views import TIER_BATCH, TIER_REALTIME, TIER_STANDARD, HopView, WorkerSlots

# ----- the window ------------------------------------------------------------------------


def test_the_window_is_open_until_the_first_sign_of_risk_then_halves_what_runs() -> None:
    window = ChainWindow(min_limit=2.0, decrease=0.5, cooldown_s=5.0)
    assert window.admits(1_000) and not window.limited
    window.at_risk(active=20, now=0.0)
    assert window.limit == 10.0 and not window.admits(10) and window.admits(9)
    window.at_risk(active=20, now=3.0)  # within the cooldown: the first cut has not shown yet
    assert window.limit == 10.0
    window.at_risk(active=9, now=6.0)
    assert window.limit == 4.5
    for _ in range(10):
        window.at_risk(active=1, now=100.0 + 10 * _)
    assert window.limit == 2.0  # never below the minimum


def test_hops_on_track_grow_the_window_back_and_finally_open_it() -> None:
    window = ChainWindow(min_limit=2.0)
    window.at_risk(active=8, now=0.0)
    assert window.limit == 4.0
    window.on_track(active=4)
    assert window.limit == pytest.approx(4.25)  # about one chain per window's worth of hops
    for _ in range(200):
        window.on_track(active=4)
    assert math.isinf(window.limit)  # far above what runs: the overload is over


# ----- the signal ------------------------------------------------------------------------


def test_recent_stretch_is_the_median_of_the_latest_hops_once_enough_were_seen() -> None:
    meter = RecentStretch(window=5, min_hops=3)
    assert meter.observe(1.0) is None and meter.observe(1.2) is None
    assert meter.observe(9.0) == pytest.approx(1.2)  # one outlier does not move it
    assert meter.observe(3.0) == pytest.approx(2.1)
    for _ in range(5):  # the window forgets: only the latest five count
        meter.observe(3.0)
    assert meter.observe(1.0) == pytest.approx(3.0)


# ----- in the policy ---------------------------------------------------------------------

WORKERS = {"p": [WorkerSlots("a", 64, 1_000_000)]}


def overloaded_queue(**config) -> DispatchQueue:
    """Chain-aware with overload control, after realtime hops first ran as fast as the
    engine does alone (10 ms a token) and then, most of them, stretched 5x beside 8
    batch chains under way."""
    options = dict(
        overload_control=True, realtime_guard=False, overload_min_chains=2.0, overload_cooldown_s=100.0
    )
    q = DispatchQueue(policy=ChainAwarePolicy(ChainAwareConfig(**{**options, **config})))
    now = 0.0
    for i in range(8):
        hop = q.submit("p", f"b{i}", "0", now, HopView("p", f"b{i}", "0", tier=TIER_BATCH, remaining_hops=3))
        q.assign(WORKERS, now)
        assert hop.worker_id == "a"
    for i in range(24):
        now += 1.0
        slow = i >= 8
        view = HopView("p", f"rt{i}", "0", tier=TIER_REALTIME, prompt_tokens=500, max_tokens=100)
        (hop,) = [q.submit("p", f"rt{i}", "0", now, view)]
        q.assign(WORKERS, now)
        q.finished(hop, now + (5.0 if slow else 1.0), context_tokens=600, service_s=5.0 if slow else 1.0)
    return q


def test_realtime_hops_running_stretched_hold_new_batch_chains_back() -> None:
    q = overloaded_queue()
    new = q.submit("p", "late", "0", 100.0, HopView("p", "late", "0", tier=TIER_BATCH, remaining_hops=3))
    assert q.assign(WORKERS, 100.0) == []  # 8 batch chains under way, the window is 4
    # ... while a hop of a batch chain already under way, and realtime, still go.
    going = q.submit("p", "b0", "1", 100.0, HopView("p", "b0", "1", tier=TIER_BATCH, hop_index=1))
    urgent = q.submit("p", "rt", "0", 100.0, HopView("p", "rt", "0", tier=TIER_REALTIME))
    assert set(q.assign(WORKERS, 100.0)) == {going, urgent}
    assert new.worker_id is None


def queue_after_realtime_hops(services_s: list[float]) -> DispatchQueue:
    """Chain-aware with overload control and 8 batch chains under way, after realtime
    hops of 100 tokens ran one after another taking these times (1 s: the engine's
    speed alone, 10 ms a token)."""
    q = DispatchQueue(policy=ChainAwarePolicy(ChainAwareConfig(overload_control=True, realtime_guard=False)))
    for i in range(8):
        q.submit("p", f"b{i}", "0", 0.0, HopView("p", f"b{i}", "0", tier=TIER_BATCH, remaining_hops=3))
        q.assign(WORKERS, 0.0)
    for i, service in enumerate(services_s):
        now = 1.0 + i
        view = HopView("p", f"rt{i}", "0", tier=TIER_REALTIME, prompt_tokens=500, max_tokens=100)
        hop = q.submit("p", f"rt{i}", "0", now, view)
        q.assign(WORKERS, now)
        q.finished(hop, now + service, context_tokens=600, service_s=service)
    return q


def test_realtime_hops_as_spread_as_under_a_moderate_load_hold_nothing_back() -> None:
    # Half the realtime hops at the engine's speed alone, half 1.5x slower (what a
    # busy engine below capacity does): nothing is at risk, new batch chains still go.
    # (Measured against the fastest recent hops, half of them read 1.5x "stretched".)
    q = queue_after_realtime_hops([1.0, 1.5] * 32)
    new = q.submit("p", "new", "0", 100.0, HopView("p", "new", "0", tier=TIER_BATCH, remaining_hops=3))
    assert q.assign(WORKERS, 100.0) == [new]


def test_one_realtime_hop_far_past_its_time_alone_holds_new_batch_chains_back() -> None:
    # The median of the latest hops is on track, but one ran 5x its time alone: past
    # `overload_hop_stretch`, the window shrinks without waiting for the median.
    q = queue_after_realtime_hops([1.0] * 31 + [5.0])
    q.submit("p", "new", "0", 100.0, HopView("p", "new", "0", tier=TIER_BATCH, remaining_hops=3))
    assert q.assign(WORKERS, 100.0) == []  # 8 batch chains under way, the window is 4


def test_past_the_shed_factor_new_chains_are_refused_with_a_retry_hint() -> None:
    q = overloaded_queue(overload_shed_factor=1.0, retry_after_s=7.0)
    for i in range(4):  # a window's worth of new batch chains may wait
        q.submit("p", f"w{i}", "0", 100.0, HopView("p", f"w{i}", "0", tier=TIER_BATCH))
    with pytest.raises(Rejected) as refused:
        q.submit("p", "one-too-many", "0", 100.0, HopView("p", "one-too-many", "0", tier=TIER_BATCH))
    assert refused.value.retry_after_s == 7.0
    assert "overloaded" in str(refused.value) and "batch" in str(refused.value)
    # Standard chains have their own window (not limited by anything yet).
    q.submit("p", "std", "0", 100.0, HopView("p", "std", "0", tier=TIER_STANDARD))


def test_without_overload_control_nothing_is_held_back() -> None:
    q = overloaded_queue(overload_control=False)
    q.submit("p", "late", "0", 100.0, HopView("p", "late", "0", tier=TIER_BATCH, remaining_hops=3))
    assert [h.run_id for h in q.assign(WORKERS, 100.0)] == ["late"]


def test_the_guard_scale_shrinks_once_per_cooldown_and_recovers_with_time_on_track() -> None:
    scale = GuardScale(min_scale=0.25, max_scale=1.0, decrease=0.5, cooldown_s=5.0, recover_s=60.0)
    scale.at_risk(0.0)
    assert scale.scale == 0.5
    scale.at_risk(1.0)  # within the cooldown: the first decrease has not shown yet
    assert scale.scale == 0.5
    scale.at_risk(6.0)
    assert scale.scale == 0.25
    scale.at_risk(12.0)
    assert scale.scale == 0.25  # the floor
    # Growth is by the clock, not per hop: many hops on track at one instant add nothing.
    for _ in range(1000):
        scale.on_track(12.0)
    assert scale.scale == 0.25
    scale.on_track(42.0)  # half of recover_s: half the way from the floor to the top
    assert abs(scale.scale - 0.625) < 1e-9
    scale.on_track(200.0)
    assert scale.scale == 1.0


def test_a_guard_scale_without_recovery_time_is_back_at_once() -> None:
    scale = GuardScale(recover_s=0.0)
    scale.at_risk(0.0)
    assert scale.scale < 1.0
    scale.on_track(0.1)
    assert scale.scale == 1.0


def test_an_empty_stretch_window_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="overload_stretch_hops"):
        ChainAwareConfig(overload_stretch_hops=0)
