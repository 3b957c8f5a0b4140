"""Chain-aware's realtime guard: every decode step carries the prefill chunks admitted
with it and reads the KV of every running sequence, so next to a realtime hop the
policy keeps long prefills and large contexts of other tiers away, and sends realtime
hops where they would be slowed least."""

from __future__ import annotations

import pytest

from inferx.scheduling.chain_aware import ChainAwareConfig, ChainAwarePolicy
from inferx.scheduling.queue import DispatchQueue
from inferx.scheduling.registry import make_policy
from inferx.scheduling.views import TIER_BATCH, TIER_REALTIME, HopView, WorkerSlots

CAPACITY = 100_000
ONE = {"p": [WorkerSlots("a", 8, CAPACITY)]}
TWO = {"p": [WorkerSlots("a", 8, CAPACITY), WorkerSlots("b", 8, CAPACITY)]}


def queue(**config) -> DispatchQueue:
    return DispatchQueue(policy=ChainAwarePolicy(ChainAwareConfig(**config)))


def submit(q: DispatchQueue, run: str, now: float, hop: str = "0", **kw):
    view = HopView("p", run, hop, **kw)
    return q.submit("p", run, hop, now, view)


def realtime_running_on_a(q: DispatchQueue) -> None:
    submit(q, "rt", 0.0, tier=TIER_REALTIME, prompt_tokens=500, max_tokens=100)
    (hop,) = q.assign(ONE, now=0.0)
    assert hop.worker_id == "a"


def test_a_long_prefill_waits_while_a_realtime_hop_decodes_there() -> None:
    q = queue(guard_wait_s=3.0)
    realtime_running_on_a(q)
    submit(q, "big", 1.0, tier=TIER_BATCH, prompt_tokens=5_000, max_tokens=100)
    assert q.assign(ONE, now=1.0) == []
    assert q.next_wake is not None and q.next_wake <= 1.0 + 3.0
    # A short hop of another tier is not held back: its prefill is cheap.
    submit(q, "small", 1.5, tier=TIER_BATCH, prompt_tokens=300, max_tokens=50)
    assert [h.run_id for h in q.assign(ONE, now=1.5)] == ["small"]
    # The bound: after guard_wait_s the long prefill goes anyway.
    assert [h.run_id for h in q.assign(ONE, now=4.1)] == ["big"]


def test_the_long_prefill_goes_as_soon_as_the_realtime_hop_is_done() -> None:
    q = queue()
    submit(q, "rt", 0.0, tier=TIER_REALTIME, prompt_tokens=500, max_tokens=100)
    (rt,) = q.assign(ONE, now=0.0)
    submit(q, "big", 0.5, tier=TIER_BATCH, prompt_tokens=5_000, max_tokens=100)
    assert q.assign(ONE, now=0.5) == []
    q.finished(rt, 1.0)
    assert [h.run_id for h in q.assign(ONE, now=1.0)] == ["big"]


def test_other_tiers_kv_next_to_realtime_stays_under_its_share_while_they_have_slack() -> None:
    q = queue(guard_kv_share=0.25, heavy_prefill_tokens=1_000_000)  # only the KV rule here
    realtime_running_on_a(q)
    # 30k tokens of KV next to the realtime hop: over 25% of 100k.
    submit(q, "slack", 1.0, tier=TIER_BATCH, prompt_tokens=29_000, max_tokens=1_000, deadline=100.0)
    assert q.assign(ONE, now=1.0) == []
    # The same hop with no slack left (deadline - now - remaining path <= 0) goes.
    submit(
        q,
        "late",
        1.0,
        tier=TIER_BATCH,
        prompt_tokens=29_000,
        max_tokens=1_000,
        deadline=20.0,
        remaining_critical_path_s=25.0,
    )
    assert [h.run_id for h in q.assign(ONE, now=1.0)] == ["late"]


def test_on_a_large_memory_the_cap_is_what_reading_the_kv_adds_to_a_decode_step() -> None:
    """A worker with 1M tokens of KV: 25% of it would be 250k tokens next to the realtime
    hop, 20 ms of reading added to a 10 ms step at 8e-8 s per token; one bare step's
    worth (0.010 / 8e-8 = 125k tokens) is the cap."""
    big = {"p": [WorkerSlots("a", 8, 1_000_000)]}
    config = {"guard_kv_share": 0.25, "heavy_prefill_tokens": 10**9, "kv_read_s_per_token": 8e-8}
    for prompt, steps, goes in ((150_000, 1.0, False), (100_000, 1.0, True), (150_000, 2.0, True)):
        q = queue(decode_step_s=0.010, guard_kv_read_steps=steps, **config)
        submit(q, "rt", 0.0, tier=TIER_REALTIME, prompt_tokens=500, max_tokens=100)
        assert [h.worker_id for h in q.assign(big, now=0.0)] == ["a"]
        submit(q, "batch", 1.0, tier=TIER_BATCH, prompt_tokens=prompt, max_tokens=1_000, deadline=500.0)
        assert [h.run_id for h in q.assign(big, now=1.0)] == (["batch"] if goes else []), (prompt, steps)


@pytest.mark.parametrize("moves", [True, False], ids=["realtime_moves", "default"])
def test_a_realtime_hop_moves_away_from_a_prefill_backlog_only_with_realtime_moves(moves: bool) -> None:
    q = queue(realtime_moves=moves)
    big = {w: WorkerSlots(w, 8, 1_000_000) for w in ("a", "b")}
    # The realtime chain ran once on its home worker: affinity says home.
    submit(q, "chat", 0.0, tier=TIER_REALTIME, prompt_tokens=600, max_tokens=100)
    (first,) = q.assign({"p": list(big.values())}, now=0.0)
    assert first.worker_id is not None
    home, other = first.worker_id, "a" if first.worker_id == "b" else "b"
    q.finished(first, 1.0, context_tokens=700, service_s=1.0)
    # A batch hop with a 60k-token prefill (4 s at 15k tokens/s) lands on home.
    submit(q, "swe", 1.1, tier=TIER_BATCH, prompt_tokens=60_000, max_tokens=100)
    (swe,) = q.assign({"p": [big[home]]}, now=1.1)
    assert swe.worker_id == home
    # The chat's next turn: re-prefilling its 800 tokens elsewhere costs 0.05 s, waiting
    # behind 4 s of prefill at home much more.
    submit(q, "chat", 2.0, "1", tier=TIER_REALTIME, prompt_tokens=800, max_tokens=100, hop_index=1)
    # By default it stays where its context is cached.
    (second,) = q.assign({"p": list(big.values())}, now=2.0)
    assert second.worker_id == (other if moves else home)


def test_a_realtime_hop_keeps_its_worker_when_moving_would_cost_more() -> None:
    q = queue(realtime_moves=True)
    submit(q, "chat", 0.0, tier=TIER_REALTIME, prompt_tokens=30_000, max_tokens=100)
    (first,) = q.assign(TWO, now=0.0)
    q.finished(first, 3.0, context_tokens=30_100, service_s=3.0)
    submit(q, "chat", 4.0, "1", tier=TIER_REALTIME, prompt_tokens=30_200, max_tokens=100, hop_index=1)
    (second,) = q.assign(TWO, now=4.0)
    assert second.worker_id == first.worker_id  # re-prefilling 30k tokens elsewhere costs 2 s


def test_without_the_guard_the_long_prefill_goes_at_once() -> None:
    q = queue(realtime_guard=False)
    realtime_running_on_a(q)
    submit(q, "big", 1.0, tier=TIER_BATCH, prompt_tokens=5_000, max_tokens=100)
    assert [h.run_id for h in q.assign(ONE, now=1.0)] == ["big"]


def test_stretched_realtime_hops_shrink_the_kv_cap_and_time_on_track_restores_it() -> None:
    """What other tiers' KV may run beside realtime hops follows how realtime hops fare:
    one that took far longer than alone (queueing + service over `guard_max_stretch`
    times its prefill plus its tokens at the engine's bare step and KV reads, or at the
    fastest the engine was seen to run a token, if slower) shrinks the cap; realtime
    hops on track grow it back with time."""

    def realtime_hop(q: DispatchQueue, run: str, start: float, took: float) -> None:
        submit(q, run, start, tier=TIER_REALTIME, prompt_tokens=500, max_tokens=100)
        (hop,) = q.assign(ONE, now=start)
        q.finished(hop, start + took, context_tokens=600, service_s=took)

    def batch_goes_after(*took: float, adaptive: bool = True, recovered_at: float | None = None) -> bool:
        q = queue(guard_kv_share=0.25, heavy_prefill_tokens=10**9, guard_adaptive=adaptive)  # cap 25k of 100k
        now = 0.0
        for seconds in took:  # realtime hops one after another, 100 tokens each
            realtime_hop(q, f"rt{now}", now, seconds)
            now += seconds
        if recovered_at is not None:  # a realtime hop on track, much later
            realtime_hop(q, "later", recovered_at - 1.5, 1.5)
            now = recovered_at
        submit(q, "rt", now, tier=TIER_REALTIME, prompt_tokens=500, max_tokens=100)
        assert [h.run_id for h in q.assign(ONE, now=now)] == ["rt"]
        # 21k tokens beside the realtime hop's 600: under the 25k cap, over 70% of it.
        submit(
            q, "batch", now + 0.1, tier=TIER_BATCH, prompt_tokens=20_000, max_tokens=1_000, deadline=10_000.0
        )
        return [h.run_id for h in q.assign(ONE, now=now + 0.1)] == ["batch"]

    # 100 tokens alone at the told 10 ms step: ~1 s; 1.5 s is on track, 30 s stretched.
    assert batch_goes_after(1.5, 1.5)
    assert not batch_goes_after(1.5, 30.0)
    assert batch_goes_after(1.5, 30.0, adaptive=False)
    assert batch_goes_after(1.5, 30.0, recovered_at=31.5 + 60.0)
    # An engine 20x slower than told (another GPU or model, no profile): its hops are
    # not stretched against the fastest it has run.
    assert batch_goes_after(20.0, 20.0, 25.0)


def test_nonsensical_adaptive_guard_options_are_refused_by_name() -> None:
    for option, value in (
        ("guard_scale_min", 0.0),
        ("guard_scale_min", 2.0),
        ("guard_max_stretch", 0.5),
        ("realtime_apart", -1.0),
    ):
        with pytest.raises(ValueError, match=option):
            make_policy("chain-aware", **{option: value})


def test_other_tiers_new_chains_go_where_realtime_runs_least() -> None:
    """`realtime_apart`: placing a chain of another tier, a worker's room score loses
    that much times the share of the pool's hops in flight that are realtime hops there,
    so other tiers' contexts gather away from realtime decodes (which read every context
    in their batch). Off (0), the worker with the most room wins."""

    def batch_lands_on(**apart: float) -> str:
        q = queue(realtime_guard=False, **apart)
        workers = {"p": [WorkerSlots("a", 64, CAPACITY), WorkerSlots("b", 64, CAPACITY)]}
        submit(q, "rt", 0.0, tier=TIER_REALTIME, prompt_tokens=500, max_tokens=100)
        (rt,) = q.assign(workers, now=0.0)
        other = "b" if rt.worker_id == "a" else "a"
        # The other worker runs a batch chain's 10k tokens: less room than where the
        # realtime hop (600 tokens) runs.
        submit(q, "std", 0.1, tier=TIER_BATCH, prompt_tokens=10_000, max_tokens=100)
        (std,) = q.assign({"p": [w for w in workers["p"] if w.worker_id == other]}, now=0.1)
        assert std.worker_id == other
        submit(q, "new", 0.2, tier=TIER_BATCH, prompt_tokens=2_000, max_tokens=100)
        (new,) = q.assign(workers, now=0.2)
        return "realtime's" if new.worker_id == rt.worker_id else "other"

    # Room: 98.4% where the realtime hop runs (a slot of 64), 90% on the other (10k of
    # 100k tokens of KV). One of the two hops in flight is realtime, there: the default
    # 2.0 takes 1.0 off that worker's score, 0.05 would take 0.025 (less than the 8.4
    # points of room between them).
    assert batch_lands_on() == "other"
    assert batch_lands_on(realtime_apart=0.05) == "realtime's"
    assert batch_lands_on(realtime_apart=0.0) == "realtime's"
