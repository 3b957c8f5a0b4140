"""The KV-event-fed prefix index (`inferx.scheduling.prefix_index`), the simulator's
engines feeding it, and the policies reading it (`exact_prefix`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferx.scheduling.chain_aware import ChainAwareConfig, ChainAwarePolicy
from inferx.scheduling.peers.prefix_aware import PrefixAwarePolicy
from inferx.scheduling.prefix_index import (
    CLEARED,
    REMOVED,
    STORED,
    ChainContexts,
    EngineKeyMap,
    EventKind,
    KvEvent,
    PrefixIndex,
    WorkerFeed,
    chain_keys,
)
from inferx.scheduling.registry import make_policy
from inferx.scheduling.views import HopView, QueuedHop, WorkerView
from inferx.sim.cluster import ClusterSim
from inferx.sim.engine import EngineModel, SimRequest
from inferx.sim.kv import Segment
from inferx.sim.profile import EngineProfile
from inferx.sim.trace import TraceConfig, generate


def test_chain_keys_name_a_block_and_everything_before_it() -> None:
    tokens = list(range(10))
    keys = chain_keys(tokens, 4)
    assert len(keys) == 2  # the partial third block has no key
    assert keys == chain_keys(tokens[:8], 4)  # stable, independent of what follows
    assert chain_keys(tokens[4:8], 4, parent=keys[0]) == keys[1:]  # chaining = the whole sequence
    other = chain_keys([99, 1, 2, 3, 4, 5, 6, 7], 4)
    assert other[1] != keys[1]  # same block tokens after a different prefix: a different key
    with pytest.raises(ValueError):
        chain_keys(tokens, 0)


def test_match_counts_the_leading_run_of_held_blocks() -> None:
    index = PrefixIndex()
    blocks = [("a", 16), ("b", 16), ("c", 8)]
    assert not index.knows("w0")
    index.apply("w0", KvEvent(STORED, (("a", 16), ("b", 16), ("c", 8))))
    index.apply("w1", KvEvent(STORED, (("a", 16), ("c", 8))))
    assert index.match("w0", blocks) == 40
    assert index.match("w1", blocks) == 16  # "c" after a miss is no prefix hit
    assert index.match("w2", blocks) == 0
    assert index.holders("a") == {"w0", "w1"}
    index.apply("w0", KvEvent(REMOVED, (("b", 0),)))
    assert index.match("w0", blocks) == 16
    assert index.tokens_of("w0") == 24 and index.blocks_of("w0") == 2
    index.apply("w1", KvEvent(CLEARED))
    assert index.knows("w1") and index.match("w1", blocks) == 0
    assert index.holders("a") == {"w0"}
    index.forget("w0")
    assert not index.knows("w0") and index.holders("a") == frozenset()
    index.removed("w3", ["zzz"])  # a removal of what was never stored: harmless


_KEYS = st.sampled_from("abcdef")
_Event = tuple[str, tuple[EventKind, list[tuple[str, int]]]]  # (worker, (kind, blocks))
_EVENTS: st.SearchStrategy[list[_Event]] = st.lists(
    st.tuples(
        st.sampled_from(["w0", "w1"]),
        st.one_of(
            st.tuples(st.just(STORED), st.lists(st.tuples(_KEYS, st.sampled_from([8, 16])), max_size=4)),
            st.tuples(st.just(REMOVED), st.lists(st.tuples(_KEYS, st.just(0)), max_size=4)),
            st.tuples(st.just(CLEARED), st.just([])),
        ),
    ),
    max_size=40,
)


@given(_EVENTS)
def test_a_workers_token_total_is_what_its_held_blocks_add_up_to(events: list[_Event]) -> None:
    """`tokens_of` is kept as events arrive (the status asks it twice a second for every
    worker): after any sequence of stores (again, or of a key another worker holds),
    removals (of what is not held too) and clears, it is the sum of the sizes of the
    blocks the worker holds, each counted once."""
    index = PrefixIndex()
    held: dict[str, dict[str, int]] = {"w0": {}, "w1": {}}  # the reference: key -> size
    for worker, (kind, blocks) in events:
        index.apply(worker, KvEvent(kind, tuple(blocks)))
        if kind == STORED:
            held[worker].update(blocks)
        elif kind == REMOVED:
            for key, _ in blocks:
                held[worker].pop(key, None)
        else:
            held[worker].clear()
        for name, blocks_held in held.items():
            assert index.tokens_of(name) == sum(blocks_held.values())
            assert index.blocks_of(name) == len(blocks_held)


def test_engine_key_map_rekeys_vllm_style_events_by_token_ids() -> None:
    keymap = EngineKeyMap()
    tokens = list(range(12))
    first = keymap.stored([101, 102], None, tokens[:8], 4)
    assert first is not None and [k for k, _ in first.blocks] == chain_keys(tokens, 4)[:2]
    second = keymap.stored([103], 102, tokens[8:12], 4)
    # Chained on the parent's key: the prompt's own keys find it.
    assert second is not None and second.blocks == ((chain_keys(tokens, 4)[2], 4),)
    assert keymap.stored([200], 999, [1, 2, 3, 4], 4) is None  # unknown parent: cannot chain
    removed = keymap.removed([101, 555])
    assert removed is not None and removed.blocks == ((chain_keys(tokens, 4)[0], 0),)
    assert keymap.removed([555]) is None
    assert keymap.cleared().kind == CLEARED
    assert keymap.stored([104], 103, [1, 2, 3, 4], 4) is None  # cleared: parents forgotten


def test_chain_contexts_are_bounded_lru() -> None:
    contexts = ChainContexts(max_chains=2)
    contexts.put("p", "a", "A" * 100, [("k1", 16)])
    contexts.put("p", "b", "B" * 100, [("k2", 16)])
    contexts.put("p", "c", "C" * 100, [])  # nothing reported: nothing stored
    assert contexts.get("p", "a", "A" * 150) == (("k1", 16),)  # touched: "b" is now least recent
    contexts.put("p", "d", "D" * 100, [("k3", 16)])
    assert contexts.get("p", "b", "B" * 150) == () and len(contexts) == 2
    assert contexts.get("other", "a", "A" * 150) == ()


SYSTEM = "You are a research agent; cite every source. " * 4


def test_a_prompt_is_described_by_the_longest_context_it_starts_with() -> None:
    """An agent loop's next call extends its latest context; a DAG's parallel branch
    extends the hop it branched from, not the sibling that finished last; a prompt that
    starts anew (a template's) is described by none -- never by blocks it lacks."""
    contexts = ChainContexts()
    plan = SYSTEM + "plan the search" + " -> three queries"
    contexts.put("p", "run", plan, [("plan", 40)])
    branch_a = plan + " search A" + " -> found A"
    contexts.put("p", "run", branch_a, [("plan", 40), ("a", 10)])
    # Branch B finished after A: its prompt starts with the plan's context, not A's.
    assert contexts.get("p", "run", plan + " search B") == (("plan", 40),)
    # The join of A (and more) starts with A's context, the longest that fits.
    assert contexts.get("p", "run", branch_a + " then B's results") == (("plan", 40), ("a", 10))
    assert contexts.get("p", "run", SYSTEM + "a new prompt of the same length or longer " * 3) == ()
    assert contexts.get("p", "run", plan[:-1]) == ()  # shorter than every context
    # Same length, other text at the start only (the tail test alone would pass it).
    assert contexts.get("p", "run", "X" + plan[1:] + " more") == ()


def test_each_chain_keeps_its_latest_contexts_and_one_per_text() -> None:
    contexts = ChainContexts(per_chain=2)
    for i in range(3):
        contexts.put("p", "run", f"context {i} " * 10, [(f"k{i}", 16)])
    assert contexts.get("p", "run", "context 0 " * 10 + "next") == ()  # the oldest dropped
    assert contexts.get("p", "run", "context 2 " * 10 + "next") == (("k2", 16),)
    contexts.put("p", "run", "context 2 " * 10, [("k2-again", 16)])  # the same text: replaced, not doubled
    assert contexts.get("p", "run", "context 1 " * 10 + "next") == (("k1", 16),)
    assert contexts.get("p", "run", "context 2 " * 10 + "next") == (("k2-again", 16),)


def test_nested_contexts_share_their_common_blocks() -> None:
    """A loop's contexts nest: the later one holds the earlier one's block objects (a
    pointer each), also past a last block that was partial then and is full now."""
    contexts = ChainContexts()
    first = [("k0", 16), ("k1", 16), ("k2-partial", 5)]
    contexts.put("p", "run", "first call", [(k, t) for k, t in first])
    earlier = contexts.get("p", "run", "first call, then")
    contexts.put("p", "run", "first call, then more", [("k0", 16), ("k1", 16), ("k2", 16), ("k3", 4)])
    later = contexts.get("p", "run", "first call, then more and more")
    assert later == (("k0", 16), ("k1", 16), ("k2", 16), ("k3", 4))
    assert later[0] is earlier[0] and later[1] is earlier[1]
    assert contexts.get("p", "run", "first call, then") == tuple(first)  # the earlier one kept whole


def test_sim_engine_cache_changes_reach_the_index() -> None:
    """Every entry the engine model stores or evicts is reported, so the index equals
    the engine's cache at every point."""
    profile = EngineProfile(kv_capacity_tokens=200, max_num_seqs=4)
    engine = EngineModel(profile)
    index = PrefixIndex()
    engine.kv.listener = WorkerFeed(index, "w0")
    assert index.knows("w0") and index.blocks_of("w0") == 0

    def run(request: SimRequest) -> None:
        engine.add(request)
        now = 0.0
        while not engine.idle:
            plan = engine.plan()
            assert plan is not None
            now += plan.duration_s
            engine.commit(plan, plan.steps, now)

    prompt = (Segment("sys", 64), Segment("sys/a", 32))
    run(SimRequest("r1", prompt, 8, output_segments=(Segment("sys/a/o", 8),)))
    assert index.match("w0", [("sys", 64), ("sys/a", 32), ("sys/a/o", 8)]) == 104
    # A second, larger request evicts the first one's (unpinned) entries.
    run(SimRequest("r2", (Segment("other", 150),), 4))
    held = {key for key in ("sys", "sys/a", "sys/a/o", "other") if key in engine.kv}
    assert {key for key in ("sys", "sys/a", "sys/a/o", "other") if index.match("w0", [(key, 1)])} == held
    assert "sys/a/o" not in held  # something was evicted, and the index saw it


def _hop(prompt_blocks: tuple[tuple[str, int], ...], prompt_tokens: int, run_id: str = "r") -> QueuedHop:
    view = HopView("p", run_id, "h1", prompt_tokens=prompt_tokens, max_tokens=16, prompt_blocks=prompt_blocks)
    return QueuedHop(view, enqueued_at=0.0)


WORKERS = [WorkerView("w0", 8, 0, 100_000, 0), WorkerView("w1", 8, 0, 100_000, 0)]


def test_prefix_aware_reads_exact_matches_only_when_told() -> None:
    index = PrefixIndex()
    index.apply("w0", KvEvent(CLEARED))
    index.apply("w1", KvEvent(STORED, (("sys", 900),)))
    queued = _hop((("sys", 900), ("q", 100)), 1000)
    exact = PrefixAwarePolicy(exact_prefix=True)
    exact.use_prefix_index(index)
    assert exact.choose_worker(queued, WORKERS, 0.0) == "w1"  # 90% cached there
    guessing = PrefixAwarePolicy()
    guessing.use_prefix_index(index)
    # Its approximate tree has seen nothing: a miss, least loaded, ties by id.
    assert guessing.choose_worker(queued, WORKERS, 0.0) == "w0"
    # A worker the index has no events from falls back to the tree (which knows nothing).
    index.forget("w1")
    assert exact.choose_worker(queued, WORKERS, 0.0) == "w0"
    with pytest.raises(ValueError, match="exact_prefix"):
        make_policy("prefix-aware", exact_prefix="yes")


def test_chain_aware_leaves_a_home_whose_context_was_evicted() -> None:
    """The chain ran on w0 and left 5000 tokens there. Without events the policy sends
    the next hop home; with events saying w0 evicted it and w1 holds the shared
    system prompt, the hop goes to w1 and its prefill estimate is what w1 lacks."""
    blocks = (("sys", 2000), ("ctx", 3000), ("new", 500))

    def placed(exact: bool, index: PrefixIndex) -> tuple[str | None, int]:
        policy = ChainAwarePolicy(ChainAwareConfig(exact_prefix=exact, realtime_guard=False))
        policy.use_prefix_index(index)
        first = _hop((("sys", 2000), ("ctx", 3000)), 5000)
        policy.admit(first.view, WORKERS, [], 0.0)
        policy.on_dispatch(first, "w0", 0.0)
        first.worker_id = "w0"
        policy.on_finish(first, 1.0, context_tokens=5000, service_s=1.0)
        second = QueuedHop(
            HopView("p", "r", "h2", prompt_tokens=5500, max_tokens=16, hop_index=1, prompt_blocks=blocks),
            enqueued_at=2.0,
        )
        policy.admit(second.view, WORKERS, [], 2.0)
        return policy.choose_worker(second, WORKERS, 2.0), policy._prefill_estimate(second.view, "w1")

    index = PrefixIndex()
    index.apply("w0", KvEvent(STORED, (("sys", 2000), ("ctx", 3000))))
    index.apply("w1", KvEvent(STORED, (("sys", 2000),)))
    assert placed(True, index) == ("w0", 3500)  # still cached at home: stays
    index.apply("w0", KvEvent(REMOVED, (("sys", 0), ("ctx", 0))))
    assert placed(False, index) == ("w0", 5500)  # guessing: home, and w1 is thought empty
    assert placed(True, index) == ("w1", 3500)  # exact: w1 holds the system prompt


def test_chain_aware_does_not_pull_new_chains_to_a_shared_system_prompt() -> None:
    """w1 holds the program's system prompt, w0 has more room. A new chain has no
    context of its own anywhere: with exact locations it is placed and estimated as
    without them (by room, whole prompt to prefill). Counting the shared prompt herds
    every new chain of the program onto w1 (0.43x capacity on the simulator's mix)."""
    workers = [WorkerView("w0", 8, 0, 100_000, 0), WorkerView("w1", 8, 4, 100_000, 40_000)]
    index = PrefixIndex()
    index.apply("w0", KvEvent(STORED, ()))
    index.apply("w1", KvEvent(STORED, (("sys", 2000),)))
    for exact in (False, True):
        policy = ChainAwarePolicy(ChainAwareConfig(exact_prefix=exact, realtime_guard=False))
        policy.use_prefix_index(index)
        queued = _hop((("sys", 2000), ("ask", 300)), 2300)
        policy.admit(queued.view, workers, [], 0.0)
        assert policy.choose_worker(queued, workers, 0.0) == "w0"
        assert policy._prefill_estimate(queued.view, "w1") == 2300


def test_chain_aware_counts_only_the_chain_own_context_past_a_named_prefix() -> None:
    """The chain ran on w0; w0 then evicted its own context but kept the shared system
    prompt, which w1 holds too. With the prefix named (prefix_id, prefix_tokens) the
    shared blocks tie the chain to neither worker (placement, home), while its prefill
    estimate counts all a worker holds (the engine's real work); unnamed, what a worker
    holds of the prompt counts for both (the test above)."""
    blocks = (("sys", 2000), ("ctx", 3000), ("new", 500))
    index = PrefixIndex()
    index.apply("w0", KvEvent(STORED, (("sys", 2000), ("ctx", 3000))))
    index.apply("w1", KvEvent(STORED, (("sys", 2000),)))
    workers = [WorkerView("w0", 8, 2, 100_000, 30_000), WorkerView("w1", 8, 0, 100_000, 0)]

    def second_hop(policy: ChainAwarePolicy) -> QueuedHop:
        first = QueuedHop(
            HopView(
                "p",
                "r",
                "h1",
                prompt_tokens=5000,
                max_tokens=16,
                prompt_blocks=blocks[:2],
                prefix_id="sys",
                prefix_tokens=2000,
            ),
            enqueued_at=0.0,
        )
        policy.admit(first.view, workers, [], 0.0)
        policy.on_dispatch(first, "w0", 0.0)
        first.worker_id = "w0"
        policy.on_finish(first, 1.0, context_tokens=5000, service_s=1.0)
        view = HopView(
            "p",
            "r",
            "h2",
            prompt_tokens=5500,
            max_tokens=16,
            hop_index=1,
            prompt_blocks=blocks,
            prefix_id="sys",
            prefix_tokens=2000,
        )
        second = QueuedHop(view, enqueued_at=2.0)
        policy.admit(view, workers, [], 2.0)
        return second

    policy = ChainAwarePolicy(ChainAwareConfig(exact_prefix=True, realtime_guard=False))
    policy.use_prefix_index(index)
    second = second_hop(policy)
    assert policy._prefill_estimate(second.view, "w0") == 500  # the system prompt and its own 3000
    assert policy.choose_worker(second, workers, 2.0) == "w0"  # stays with its context
    index.apply("w0", KvEvent(REMOVED, (("ctx", 0),)))
    policy = ChainAwarePolicy(ChainAwareConfig(exact_prefix=True, realtime_guard=False))
    policy.use_prefix_index(index)
    second = second_hop(policy)
    assert policy._prefill_estimate(second.view, "w0") == 3500
    assert policy._prefill_estimate(second.view, "w1") == 3500
    assert policy.choose_worker(second, workers, 2.0) == "w1"  # nothing of its own left: by room


def test_the_simulator_feeds_the_index_the_policy_reads() -> None:
    """In the simulator, hops carry their prompt's segment keys and the engines' events
    feed the index: the exact peer sees real matches and goes where they are largest."""
    trace = generate(TraceConfig(seed=7, duration_s=40, rate_per_s=1.0))
    policy = PrefixAwarePolicy(exact_prefix=True)
    hits: list[tuple[int, int]] = []  # (match where it went, best match) when it chased the cache
    original = policy.choose_worker

    def spy(queued, workers, now):
        chosen = original(queued, workers, now)
        free = [w for w in workers if w.has_slot]
        assert queued.view.prompt_blocks  # the simulator describes every prompt
        matches = {w.worker_id: policy.match(queued.view, w) for w in free}
        if chosen is not None and matches[chosen] / queued.view.prompt_tokens > policy.cache_threshold:
            hits.append((matches[chosen], max(matches.values())))
        return chosen

    policy.choose_worker = spy  # type: ignore[method-assign]
    run = ClusterSim(trace, policy, EngineProfile(), workers=2).run()
    assert all(c.status == "ok" for c in run.chains)
    assert policy._index is not None and policy._index.events > 0
    assert len(hits) > 10 and all(here == best for here, best in hits)
