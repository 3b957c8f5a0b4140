"""Priced KV retention across tool calls (`inferx.scheduling.retention` and how the
chain-aware policy uses it): how long a chain's context is held between its hops, that
the hold is real (nothing is admitted over it, on the chain's own worker either), that
realtime may use room held for less urgent tiers, and the per-chain budget for giving
way to realtime hops."""

from __future__ import annotations

import math
import random
from collections import deque
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferx.scheduling.chain_aware import ChainAwareConfig, ChainAwarePolicy
from inferx.scheduling.queue import DispatchQueue
from inferx.scheduling.retention import HINT_PRICED, HINT_RELEASED, GapModel, client_hold, hold_seconds
from inferx.scheduling.views import TIER_BATCH, TIER_REALTIME, TIER_STANDARD, HopView, WorkerSlots

RATE = 15_000.0  # prefill tokens/s
BIG_KV = 450_000  # break-even hold: 30 s
SMALL_KV = 60_000  # break-even hold: 4 s


def hold(gaps: list[float], capacity: int = BIG_KV, max_hold_s: float = 600.0) -> float:
    return hold_seconds(
        sorted(gaps), kv_capacity_tokens=capacity, prefill_tokens_per_s=RATE, max_hold_s=max_hold_s
    )


# ----- the price -----------------------------------------------------------------------


def test_with_no_gaps_seen_it_holds_for_the_break_even_time() -> None:
    assert hold([]) == pytest.approx(BIG_KV / RATE)
    assert hold([], max_hold_s=10.0) == 10.0
    assert hold([], capacity=0, max_hold_s=42.0) == 42.0  # unknown memory: nothing to price by


def test_short_tool_calls_are_held_through_and_long_ones_are_not() -> None:
    short = [0.5, 1.0, 1.5, 2.0] * 10
    assert hold(short) == 2.0  # every short call is covered
    assert hold([120.0, 300.0, 90.0] * 10) == 0.0  # minutes: re-prefilling is cheaper
    # A mix (most calls short, one in ten a test run of minutes): hold through the
    # short ones, let go of the context during the long ones.
    assert hold(short + [180.0] * 4) == 2.0


def test_a_small_kv_holds_for_less_time_than_a_large_one() -> None:
    gaps = [1.0] * 10 + [10.0] * 10
    assert hold(gaps, capacity=BIG_KV) == 10.0  # 10 s is under the 30 s break-even
    assert hold(gaps, capacity=SMALL_KV) == 1.0  # ... but over the 4 s one


@given(st.lists(st.floats(0.0, 1_000.0), max_size=50), st.integers(1_000, 2_000_000))
def test_the_hold_is_never_longer_than_the_bound_and_is_an_observed_gap_or_zero(
    gaps: list[float], capacity: int
) -> None:
    seconds = hold(gaps, capacity=capacity, max_hold_s=300.0)
    assert 0.0 <= seconds <= 300.0
    if gaps:
        assert seconds == 0.0 or seconds in gaps


def expected_cost(gaps: list[float], hold_s: float, capacity: int, rate: float) -> float:
    """The module docstring's price of holding for `hold_s`, straight from its definition
    (GPU-seconds per token): E[min(g, T)] / capacity + P(T < g < inf) / rate."""
    held = sum(min(gap, hold_s) for gap in gaps) / len(gaps)  # an end (inf) is held the whole T
    missed = sum(1 for gap in gaps if hold_s < gap < math.inf) / len(gaps)
    return held / capacity + missed / rate


@given(
    st.lists(
        st.one_of(st.floats(0.0, 1_000.0), st.sampled_from([0.0, 0.5, 2.0, 20.0, math.inf])),
        min_size=1,
        max_size=80,
    ),
    st.sampled_from([1_000, 60_000, 450_000, 2_000_000]),
    st.sampled_from([1_000.0, 15_000.0, 50_000.0]),
    st.sampled_from([5.0, 60.0, 600.0, math.inf]),
)
def test_the_hold_is_the_cheapest_choice_by_the_prices_definition(
    gaps: list[float], capacity: int, rate: float, max_hold_s: float
) -> None:
    """Whatever the pricing loop does to be fast, its choice costs what the cheapest of
    the candidates (0, or an observed gap within the bound) costs by the definition;
    ties (equal gaps, round numbers) may go either way."""
    gaps = sorted(gaps)
    seconds = hold_seconds(
        gaps, kv_capacity_tokens=capacity, prefill_tokens_per_s=rate, max_hold_s=max_hold_s
    )
    candidates = [0.0] + [gap for gap in gaps if gap <= max_hold_s and gap < math.inf]
    assert seconds in candidates
    cheapest = min(expected_cost(gaps, t, capacity, rate) for t in candidates)
    assert expected_cost(gaps, seconds, capacity, rate) == pytest.approx(cheapest, rel=1e-9, abs=1e-15)


def test_programs_that_end_without_saying_so_shorten_the_hold() -> None:
    inf = math.inf
    short = [2.0] * 10
    assert hold(short) == 2.0
    # Half of them never came back (an agent's last call): holding for them is waste,
    # and they never re-prefill; still worth holding when the hold is cheap enough ...
    assert hold(short + [inf] * 10) == 2.0
    # ... but not once the ends dominate: 1 in 10 returns, after 20 s on a 30 s break-even.
    assert hold([20.0] + [inf] * 9) == 0.0
    assert hold([20.0] * 10) == 20.0  # the same gaps, every program returning: held
    assert hold([inf] * 5) == 0.0  # nobody comes back: nothing to hold for


@given(
    st.lists(st.floats(0.0, 1_000.0), min_size=1, max_size=30),
    st.integers(0, 30),
    st.integers(1_000, 2_000_000),
)
def test_more_ends_never_lengthen_the_hold(gaps: list[float], ends: int, capacity: int) -> None:
    with_ends = hold(gaps + [math.inf] * ends, capacity=capacity)
    assert 0.0 <= with_ends <= 600.0
    assert with_ends == 0.0 or with_ends in gaps
    # Adding programs that never return only makes holding less worth it.
    assert with_ends <= hold(gaps + [math.inf] * (ends - 1), capacity=capacity) if ends else True


def test_the_gap_model_keeps_a_bounded_window_per_kind() -> None:
    model = GapModel(window=3)
    for seconds in (5.0, 1.0, 3.0, 2.0, -1.0):  # a negative gap (clock skew) is ignored
        model.observe("coding", seconds)
    model.observe("chat", 9.0)
    model.observe_end("chat")
    assert model.samples("coding") == [1.0, 2.0, 3.0]
    assert model.samples("chat") == [9.0, math.inf]
    assert model.samples("unknown") == []


# ----- in the policy -------------------------------------------------------------------

CAPACITY = 100_000  # break-even hold at the default 15k tokens/s: 6.7 s
ONE = {"p": [WorkerSlots("a", 8, CAPACITY)]}


def policy(**config) -> tuple[DispatchQueue, ChainAwarePolicy]:
    chosen = ChainAwarePolicy(ChainAwareConfig(realtime_guard=False, **config))
    return DispatchQueue(policy=chosen), chosen


def submit(q: DispatchQueue, run: str, now: float, hop: str = "0", **kw):
    view = HopView("p", run, hop, **kw)
    return q.submit("p", run, hop, now, view)


def run_first_hop(q: DispatchQueue, run: str, now: float, context: int, **kw) -> None:
    submit(q, run, now, remaining_hops=3, prompt_tokens=context - 100, max_tokens=100, **kw)
    (hop,) = q.assign(ONE, now=now)
    q.finished(hop, now + 1, context_tokens=context, service_s=1.0)


def test_a_strict_priced_hold_is_real_on_the_chains_own_worker_too() -> None:
    q, chosen = policy(strict_holds=True, reprefill_cost_factor=1.0)
    run_first_hop(q, "held", 0.0, 60_000)  # held for the break-even time (6.7 s)
    assert chosen.resident("a") == 60_000
    run_first_hop(q, "other", 1.0, 20_000)  # its own worker is "a" too
    assert chosen.resident("a") == 80_000
    # "other" comes back with a much larger context: it would overflow the room held for
    # "held", so it waits (the engine would otherwise evict "held"'s context) ...
    submit(q, "other", 3.0, "1", hop_index=1, prompt_tokens=40_000, max_tokens=1_000)
    assert q.assign(ONE, now=3.0) == []
    # ... until the hold ends.
    assert [h.run_id for h in q.assign(ONE, now=9.0)] == ["other"]


def test_without_strict_holds_a_hold_only_keeps_other_chains_from_being_placed_there() -> None:
    q, _ = policy(kv_warm_s=30.0)
    run_first_hop(q, "held", 0.0, 60_000)
    run_first_hop(q, "other", 1.0, 20_000)
    submit(q, "other", 3.0, "1", hop_index=1, prompt_tokens=40_000, max_tokens=1_000)
    assert [h.run_id for h in q.assign(ONE, now=3.0)] == ["other"]


def test_a_chain_whose_gaps_are_long_lets_its_context_go_at_once() -> None:
    q, chosen = policy()
    for i in range(5):  # this program's tool calls have taken minutes
        run_first_hop(q, f"c{i}", 1_000.0 * i, 10_000, prefix_id="coding-agent")
        submit(q, f"c{i}", 1_000.0 * i + 200.0, "1", hop_index=1, remaining_hops=0, prefix_id="coding-agent")
        (hop,) = q.assign(ONE, now=1_000.0 * i + 200.0)
        q.finished(hop, 1_000.0 * i + 201.0)
    run_first_hop(q, "next", 10_000.0, 10_000, prefix_id="coding-agent")
    assert chosen.resident("a") == 0
    # Another program (another prefix) has its own gaps: none seen, so break-even.
    run_first_hop(q, "chat", 10_000.0, 10_000, prefix_id="chat-agent")
    assert chosen.resident("a") == 10_000


def _program_call(q: DispatchQueue, program: str, hop: int, now: float, **kw):
    """One call of a dynamic program: remaining hops unknown, as the OpenAI front sends;
    the finished hop."""
    submit(
        q,
        program,
        now,
        str(hop),
        hop_index=hop,
        prompt_tokens=9_000,
        max_tokens=100,
        program="agent/standard",
        **kw,
    )
    (queued,) = q.assign(ONE, now=now)
    q.finished(queued, now + 1, context_tokens=10_000, service_s=1.0)
    return queued


@pytest.mark.parametrize("learn", [True, False])
def test_dynamic_programs_forgotten_idle_teach_the_hold_that_they_ended(learn: bool) -> None:
    """Programs whose end nobody announces (no end mark): after `chain_ttl_s` idle the
    policy forgets them and, learning ends, counts each as a gap of inf -- so once most
    programs of a kind end after a call, it stops holding their last context."""
    q, chosen = policy(chain_ttl_s=100.0, learn_program_ends=learn)
    now = 0.0
    for i in range(10):  # each program: two calls 12 s apart, then silence
        _program_call(q, f"p{i}", 0, now)
        _program_call(q, f"p{i}", 1, now + 13.0)
        now += 1_000.0  # past the TTL: the previous program is forgotten on the next call
    _program_call(q, "last", 0, now)
    held = chosen.resident("a")
    # Learned: 10 gaps of 12 s and (learning ends) 10 programs that never came back.
    # The break-even hold is 20 s (100k tokens at 15k/3 tokens/s: re-prefills count 3x),
    # so holding 12 s pays for a program that returns -- but not when half never do.
    assert held == (0 if learn else 10_000)

    q, _ = policy(strict_holds=True, tiered_holds=True)
    run_first_hop(q, "batch", 0.0, 60_000, tier=TIER_BATCH)
    submit(q, "rt", 1.5, tier=TIER_REALTIME, prompt_tokens=40_000, max_tokens=1_000)
    assert [h.run_id for h in q.assign(ONE, now=1.5)] == ["rt"]

    q, _ = policy(strict_holds=True, tiered_holds=True)
    run_first_hop(q, "rt", 0.0, 60_000, tier=TIER_REALTIME)
    submit(q, "batch", 1.5, tier=TIER_BATCH, prompt_tokens=40_000, max_tokens=1_000)
    assert q.assign(ONE, now=1.5) == []


def test_without_tiered_holds_realtime_waits_for_the_batch_hold_too() -> None:
    q, _ = policy(strict_holds=True, tiered_holds=False)
    run_first_hop(q, "batch", 0.0, 60_000, tier=TIER_BATCH)
    submit(q, "rt", 1.5, tier=TIER_REALTIME, prompt_tokens=40_000, max_tokens=1_000)
    assert q.assign(ONE, now=1.5) == []


# ----- giving way to realtime: a budget per chain ----------------------------------------


def guarded_queue(**config) -> DispatchQueue:
    q = DispatchQueue(
        policy=ChainAwarePolicy(ChainAwareConfig(guard_kv_share=0.25, heavy_prefill_tokens=10**9, **config))
    )
    submit(q, "rt", 0.0, tier=TIER_REALTIME, prompt_tokens=500, max_tokens=100)
    q.assign(ONE, now=0.0)  # a realtime hop runs on "a" throughout
    return q


# 30k tokens of KV: over the guard's 25% share next to the realtime hop.
BIG: dict[str, Any] = dict(
    tier=TIER_STANDARD, prompt_tokens=29_000, max_tokens=1_000, deadline=50.0, remaining_critical_path_s=10.0
)


def test_a_chain_gives_way_to_realtime_for_at_most_its_share_of_slack_in_all() -> None:
    q = guarded_queue(guard_slack_share=0.5)
    submit(q, "std", 0.0, **BIG)  # 40 s of slack on arrival: it may wait 20 s in all
    assert q.assign(ONE, now=5.0) == []
    assert q.assign(ONE, now=19.0) == []
    (first,) = q.assign(ONE, now=21.0)  # before the per-hop bound (30 s): the chain's budget is spent
    assert first.run_id == "std"
    q.finished(first, 22.0, context_tokens=30_000, service_s=1.0)
    # Its next hop does not wait at all: the chain already gave way for its share.
    submit(q, "std", 23.0, "1", hop_index=1, **BIG)
    assert [h.run_id for h in q.assign(ONE, now=23.0)] == ["std"]


def test_each_hop_gives_way_up_to_the_per_hop_bound_while_the_budget_lasts() -> None:
    q = guarded_queue(guard_slack_share=10.0, guard_max_wait_s=5.0)  # a budget of 400 s
    for k in range(3):
        start = 10.0 * k
        submit(q, "std", start, str(k), hop_index=k, **{**BIG, "deadline": 1_000.0})
        assert q.assign(ONE, now=start + 4.0) == []
        (hop,) = q.assign(ONE, now=start + 5.5)
        q.finished(hop, start + 6.0, context_tokens=30_000, service_s=0.5)


def test_a_late_hop_does_not_give_way() -> None:
    q = guarded_queue()
    submit(q, "late", 1.0, **{**BIG, "deadline": 20.0, "remaining_critical_path_s": 25.0})
    assert [h.run_id for h in q.assign(ONE, now=1.0)] == ["late"]


@pytest.mark.parametrize(("factor", "held"), [(1.0, 0), (3.0, 10_000)])
def test_the_reprefill_cost_factor_prices_a_re_prefill_higher(factor: float, held: int) -> None:
    """Gaps of 10 s on a 100k-token worker: re-prefilling at 15k tokens/s breaks even
    with holding after 6.7 s, so the context is let go; a re-prefill counted 3x (it
    stalls the batch beside it) breaks even after 20 s, so it is held."""
    q, chosen = policy(reprefill_cost_factor=factor)
    for i in range(5):
        run_first_hop(q, f"c{i}", 100.0 * i, 10_000, prefix_id="agent")
        submit(q, f"c{i}", 100.0 * i + 11.0, "1", hop_index=1, remaining_hops=0, prefix_id="agent")
        (hop,) = q.assign(ONE, now=100.0 * i + 11.0)
        q.finished(hop, 100.0 * i + 12.0)
    run_first_hop(q, "next", 1_000.0, 10_000, prefix_id="agent")
    assert chosen.resident("a") == held


def test_the_models_sorted_gaps_and_remembered_price_match_pricing_from_scratch() -> None:
    """The gaps are kept sorted as they come and leave the window, and a price is reused
    only until they change: always what `hold_seconds` gives over the window now."""
    rng = random.Random(7)
    model = GapModel(window=16)
    window: deque[float] = deque(maxlen=16)
    for step in range(400):
        gap = math.inf if rng.random() < 0.1 else rng.choice([0.5, 2.0, 20.0, rng.uniform(0, 60)])
        if step % 3:
            if gap == math.inf:
                model.observe_end("k")
            else:
                model.observe("k", gap)
            window.append(gap)
        capacity = rng.choice([SMALL_KV, BIG_KV])
        assert model.samples("k") == sorted(window)
        for _ in range(2):  # the second answer is the remembered one
            assert model.price(
                "k", kv_capacity_tokens=capacity, prefill_tokens_per_s=RATE, max_hold_s=600.0
            ) == hold(list(window), capacity=capacity)
    assert model.price("never", kv_capacity_tokens=BIG_KV, prefill_tokens_per_s=RATE, max_hold_s=5.0) == 5.0


# ----- a client's retention hint (kv_retention_ttl) ------------------------------------


@given(
    st.floats(0.0, 1_000.0),
    st.one_of(st.none(), st.floats(0.0, 1e6)),
    st.sampled_from(["override", "cap", "off"]),
    st.floats(1.0, 1_000.0),
)
def test_a_hint_never_holds_beyond_the_bound_and_zero_lets_go(
    priced: float, hint: float | None, mode: str, max_hold: float
) -> None:
    priced = min(priced, max_hold)  # the price is bounded already
    hold_s, outcome = client_hold(priced, hint, mode=mode, max_hold_s=max_hold)
    assert 0.0 <= hold_s <= max_hold
    if hint is None:
        assert (hold_s, outcome) == (priced, "")
    elif mode == "off":
        assert (hold_s, outcome) == (priced, HINT_PRICED)
    elif hint == 0:
        assert (hold_s, outcome) == (0.0, HINT_RELEASED)
    elif mode == "override":
        assert hold_s == min(hint, max_hold)
    else:  # cap: a hint only shortens the priced hold
        assert hold_s == min(hint, priced)


def _hinted_call(q: DispatchQueue, program: str, hop: int, now: float, hint: float | None, **kw):
    """One call of a dynamic program with the client's retention hint; the finished hop."""
    return _program_call(q, program, hop, now, kv_retention_s=hint, **kw)


def _learn_long_gaps(q: DispatchQueue) -> None:
    """Programs of the kind whose tool calls took minutes: the price is to let go at once."""
    for i in range(5):
        _hinted_call(q, f"old{i}", 0, 1_000.0 * i, None)
        _hinted_call(q, f"old{i}", 1, 1_000.0 * i + 300.0, None, remaining_hops=0)


def test_a_clients_hint_holds_its_program_that_long_where_the_price_would_let_go() -> None:
    q, chosen = policy()
    _learn_long_gaps(q)
    _hinted_call(q, "priced", 0, 10_000.0, None)
    assert chosen.resident("a") == 0  # the price: let go at once
    done = _hinted_call(q, "told", 0, 10_000.0, 30.0)  # "my tool call takes 30 s: keep it"
    state = chosen.chain("told", "p")
    assert state is not None and state.held_until == pytest.approx(10_031.0)  # finished at 10 001
    assert chosen.resident("a") == 10_000 and done.retention_hint == "held"


def test_a_hint_of_zero_lets_go_at_once_where_the_price_would_hold() -> None:
    q, chosen = policy()
    _hinted_call(q, "priced", 0, 0.0, None)  # no gaps seen: held for the break-even time
    assert chosen.resident("a") == 10_000
    done = _hinted_call(q, "done-soon", 0, 0.0, 0.0)
    assert chosen.resident("a") == 10_000  # only the unhinted program's context
    assert done.retention_hint == "released"


def test_a_hint_is_held_no_longer_than_max_hold() -> None:
    q, chosen = policy(max_hold_s=60.0)
    done = _hinted_call(q, "greedy", 0, 0.0, 3_600.0)
    state = chosen.chain("greedy", "p")
    assert state is not None and state.held_until == pytest.approx(61.0)
    assert done.retention_hint == "capped"


def test_in_cap_mode_a_hint_only_shortens_the_priced_hold_and_off_ignores_it() -> None:
    q, chosen = policy(client_retention="cap")
    _learn_long_gaps(q)
    longer = _hinted_call(q, "longer", 0, 10_000.0, 30.0)
    assert chosen.resident("a") == 0 and longer.retention_hint == "released"  # the price (0) wins
    q, chosen = policy(client_retention="cap")  # no gaps seen: the price is the break-even time
    shorter = _hinted_call(q, "shorter", 0, 0.0, 5.0)
    state = chosen.chain("shorter", "p")
    assert state is not None and state.held_until == pytest.approx(6.0) and shorter.retention_hint == "held"
    q, chosen = policy(client_retention="off")
    ignored = _hinted_call(q, "ignored", 0, 0.0, 0.0)
    assert chosen.resident("a") == 10_000 and ignored.retention_hint == "priced"


def test_the_programs_end_mark_wins_over_its_hint() -> None:
    q, chosen = policy()
    done = _hinted_call(q, "ending", 0, 0.0, 30.0, remaining_hops=0)
    assert chosen.resident("a") == 0 and done.retention_hint == "ended"


def test_a_hinted_hold_ends_when_the_hint_says() -> None:
    q, chosen = policy(strict_holds=True)
    _learn_long_gaps(q)
    _hinted_call(q, "told", 0, 10_000.0, 30.0)
    assert chosen.resident("a") == 10_000
    _hinted_call(q, "later", 0, 10_040.0, None)  # past the hint: the hold has expired
    assert chosen.resident("a") == 0
