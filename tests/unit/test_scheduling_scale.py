"""Scheduling at cluster scale: the indexed decision path (the queue's `PoolWorkers`,
the chain-aware policy's per-pool indexes) makes exactly the decisions of the plain
scan over the pool, and skipping the passes over pools nothing happened to
(`skip_idle_pools`) exactly those of a pass over every pool at every call, on seeded
simulator replays and on random operation sequences; the simulator splits workers
and chains over pools; `inferx sim --decision-cost` reports per-hop figures (their
values are not asserted: no timed unit tests)."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferx.cli.main import main
from inferx.scheduling.chain_aware import ChainAwareConfig, ChainAwarePolicy
from inferx.scheduling.policy import Policy
from inferx.scheduling.queue import DispatchQueue, QueuedHop, Rejected, WorkerSlots
from inferx.scheduling.registry import make_policy
from inferx.scheduling.views import HopView, PoolWorkers, Tier, WorkerView
from inferx.sim import decision_cost
from inferx.sim.cluster import ClusterSim
from inferx.sim.profile import EngineProfile
from inferx.sim.trace import TraceConfig, generate, write_trace

# Mixed tiers (realtime next to batch exercises the realtime guard and held-back hops).
TIERS = {"chat": {"realtime": 0.6, "batch": 0.4}, "bfcl": "standard", "swe": {"batch": 0.5, "standard": 0.5}}


class LoggingQueue(DispatchQueue):
    """Records every assignment and admission refusal, in order."""

    def __init__(self, policy: Policy, indexed: bool, skip: bool = True) -> None:
        super().__init__(max_queued_per_pool=1 << 30, policy=policy, indexed=indexed, skip_idle_pools=skip)
        self.log: list[tuple] = []
        self.max_depth = 0

    def submit(
        self, pool: str, run_id: str, hop_id: str, now: float, view: HopView | None = None
    ) -> QueuedHop:
        try:
            return super().submit(pool, run_id, hop_id, now, view)
        except Rejected:
            self.log.append(("shed", now, run_id, hop_id))
            raise

    def assign(
        self, workers_by_pool: Mapping[str, Sequence[WorkerSlots]], now: float | None = None
    ) -> list[QueuedHop]:
        self.max_depth = max(self.max_depth, sum(self.queued(p) for p in self.pools()))
        assigned = super().assign(workers_by_pool, now)
        for hop in assigned:
            self.log.append((self._now, hop.pool, hop.run_id, hop.hop_id, hop.worker_id, hop.engine_priority))
        if self.next_wake is not None:
            self.log.append(("wake", self._now, self.next_wake))  # what the simulator ticks on
        return assigned


def replay_log(
    indexed: bool,
    options: dict,
    workers: int = 4,
    pools: int = 2,
    skip: bool = True,
    policy: Policy | None = None,
) -> LoggingQueue:
    trace = generate(TraceConfig(seed=11, duration_s=6, rate_per_s=20.0, tiers=TIERS))
    queues: list[LoggingQueue] = []

    def factory(policy: Policy) -> DispatchQueue:
        queues.append(LoggingQueue(policy, indexed, skip))
        return queues[-1]

    # A small engine (KV for a few long contexts, 16 sequences) so that hops queue, room
    # runs out and realtime hops compete: the cases the indexes must get right.
    profile = EngineProfile(kv_capacity_tokens=120_000, max_num_seqs=16)
    policy = policy or make_policy("chain-aware", **options)
    ClusterSim(trace, policy, profile, workers, pools=pools, queue_factory=factory).run()
    return queues[0]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"tiered_holds": True, "overload_control": True},
        {"strict_holds": True, "progress": "attained", "kv_retention": "fixed"},
        {"realtime_moves": True},
    ],
    ids=["default", "tiered-overload", "strict-attained", "realtime-moves"],
)
def test_indexed_policy_decides_exactly_as_the_scan_over_the_pool(options: dict) -> None:
    indexed = replay_log(True, options)
    scanned = replay_log(False, options)
    assert len(indexed.log) > 500
    assert indexed.max_depth > 10, "the replay must queue hops, or the indexes are barely used"
    assert indexed.log == scanned.log


SKIP_OPTIONS = [
    {},
    {"tiered_holds": True, "overload_control": True},
    {"strict_holds": True, "progress": "attained", "kv_retention": "fixed"},
    {"realtime_guard": False, "reuse_window_hops": 0},
]


@pytest.mark.parametrize(
    "options", SKIP_OPTIONS, ids=["default", "tiered-overload", "strict-attained", "no-guard"]
)
def test_skipping_idle_pools_decides_exactly_as_passing_over_every_pool(options: dict) -> None:
    fast = replay_log(True, options)
    full = replay_log(True, options, skip=False)
    assert fast.skip_idle_pools and not full.skip_idle_pools
    assert full.passes_skipped == 0
    assert fast.passes_skipped > 200, "the replay must leave pools idle, or nothing is skipped"
    assert fast.max_depth > 10, fast.passes_skipped
    assert len(fast.log) > 500
    assert fast.log == full.log  # every assignment, engine priority, shed hop and wake-up


class ForgetsTheGuardsWaits(ChainAwarePolicy):
    """A policy whose `recheck_at` leaves out the realtime guard's time limits (the
    waits, the chain's slack): what a policy that under-reports looks like."""

    def recheck_at(self, queued: QueuedHop, now: float) -> float | None:
        times = [queued.enqueued_at + self.config.tier_starvation_s]
        future = [t for t in times if t > now]
        return min(future) if future else None


def test_the_equivalence_check_catches_a_wake_up_left_unreported() -> None:
    broken = replay_log(True, {}, policy=ForgetsTheGuardsWaits(ChainAwareConfig()))
    full = replay_log(True, {}, skip=False)
    assert broken.log != full.log


def test_a_pool_is_skipped_only_while_nothing_changes() -> None:
    config = ChainAwareConfig(realtime_guard=False, shared_kv_share=1.0)
    fast, full = (DispatchQueue(64, ChainAwarePolicy(config), skip_idle_pools=flag) for flag in (True, False))
    workers = {"a": (WorkerSlots("w0", 1, 100_000),), "b": (WorkerSlots("w1", 2, 10_000),)}
    hops: dict[str, list[QueuedHop]] = {"fast": [], "full": []}

    def submit(pool: str, chain: str, tier: Tier, prompt: int, now: float) -> None:
        view = HopView(pool, chain, "0", tier=tier, prompt_tokens=prompt, max_tokens=10)
        hops["fast"].append(fast.submit(pool, chain, "0", now, view))
        hops["full"].append(full.submit(pool, chain, "0", now, view))

    def assign(now: float) -> list[str]:
        picks = [[h.run_id for h in queue.assign(workers, now)] for queue in (fast, full)]
        assert picks[0] == picks[1]
        assert fast.next_wake == full.next_wake
        return picks[0]

    submit("b", "c4", Tier.REALTIME, 8_490, 0.0)  # 85% of w1's KV: the pool is loaded
    assert assign(0.0) == ["c4"]
    submit("b", "c3", Tier.BATCH, 10, 0.1)  # a new batch chain waits while the pool is loaded
    assert assign(0.1) == [] and fast.passes_skipped == 0
    assert assign(0.2) == [] and fast.passes_skipped == 1  # nothing changed in b
    submit("a", "c0", Tier.REALTIME, 10, 0.3)
    assert assign(0.3) == ["c0"] and fast.passes_skipped == 2  # a's hop does not touch b
    fast.finished(hops["fast"][2], 0.4)
    full.finished(hops["full"][2], 0.4)
    assert assign(0.4) == [] and fast.passes_skipped == 3
    submit("b", "c5", Tier.BATCH, 10, 0.5)  # a hop arrives in b: b is passed again
    assert assign(0.5) == [] and fast.passes_skipped == 3
    assert assign(0.6) == [] and fast.passes_skipped == 4
    assert fast.next_wake == 0.1 + config.tier_starvation_s
    # The tier starvation bound passes with nothing else happening: the batch hop that
    # waited longest is no longer held back, so the pool is passed (not skipped).
    assert assign(0.1 + config.tier_starvation_s + 0.01) == ["c3"] and fast.passes_skipped == 4
    assert full.passes_skipped == 0


# ----- random operation sequences, indexed vs scan, in lockstep -------------------------


def _view(rng: random.Random, pool: str, chain: int, hop: int, now: float) -> HopView:
    return HopView(
        pool,
        f"c{chain}",
        str(hop),
        tier=rng.choice([Tier.REALTIME, Tier.STANDARD, Tier.BATCH, Tier.UNSPECIFIED]),
        prompt_tokens=rng.choice([50, 900, 3000, 12000, 40000]),
        max_tokens=rng.choice([16, 256, 2048]),
        deadline=now + rng.uniform(1, 60) if rng.random() < 0.8 else None,
        hop_index=hop,
        remaining_critical_path_s=rng.uniform(0, 5),
        remaining_hops=rng.choice([None, 0, 1, 3]),
        prefix_id=rng.choice(["", "p1", "p2"]),
        prefix_tokens=rng.choice([0, 500]),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    options=st.sampled_from([{}, {"tiered_holds": True, "strict_holds": True}, {"realtime_moves": True}]),
)
def test_random_operations_give_identical_decisions_and_views(seed: int, options: dict) -> None:
    rng = random.Random(seed)
    # Indexed and skipping idle pools, indexed passing over every pool, the scan.
    queues = [
        DispatchQueue(64, make_policy("chain-aware", **options), indexed=indexed, skip_idle_pools=skip)
        for indexed, skip in ((True, True), (True, False), (False, False))
    ]
    pools = ["a", "b"]
    all_workers = [
        WorkerSlots(f"w{i}", rng.choice([1, 2, 8]), rng.choice([0, 20_000, 60_000])) for i in range(8)
    ]
    membership = {pool: [w for w in all_workers if rng.random() < 0.6] for pool in pools}
    running: list[list[QueuedHop]] = [[], [], []]
    chains = 0
    now = 0.0
    for _ in range(150):
        now += rng.choice([0.0, 0.01, 0.5, 3.0])
        op = rng.random()
        if op < 0.45:
            pool = rng.choice(pools)
            chain = rng.randrange(chains + 1)
            chains = max(chains, chain + 1)
            view = _view(rng, pool, chain, rng.randrange(6), now)
            outcomes = []
            for queue in queues:
                try:
                    queue.submit(pool, view.run_id, view.hop_id, now, view)
                    outcomes.append("queued")
                except Rejected as exc:
                    outcomes.append(str(exc))
            assert outcomes[0] == outcomes[1] == outcomes[2]
        elif op < 0.75 and running[0]:
            n = rng.randrange(len(running[0]))
            context = rng.choice([0, 3000, 20000])
            for side, queue in enumerate(queues):
                queue.finished(running[side].pop(n), now, context_tokens=context, service_s=0.5)
        elif op < 0.8:
            pool = rng.choice(pools)
            membership[pool] = [w for w in all_workers if rng.random() < 0.6]  # workers come and go
        elif op < 0.85:
            pool = rng.choice(pools)
            view = _view(rng, pool, rng.randrange(chains + 1), 1, now)
            targets = [queue.plan_ahead(view, now + 5.0, now) for queue in queues]
            assert targets[0] == targets[1] == targets[2]
        elif op < 0.88:
            ended = f"c{rng.randrange(chains + 1)}"
            for queue in queues:
                queue.policy.on_chain_end(ended, now)
        picks = []
        for side, queue in enumerate(queues):
            assigned = queue.assign({p: list(ws) for p, ws in membership.items()}, now)
            running[side].extend(assigned)
            picks.append([(h.run_id, h.hop_id, h.worker_id, h.engine_priority) for h in assigned])
        assert picks[0] == picks[1] == picks[2]
        assert queues[0].next_wake == queues[1].next_wake == queues[2].next_wake
        for pool in pools:
            # The views kept up to date equal those built afresh from the counts.
            fresh = [
                WorkerView(
                    w.worker_id,
                    w.max_concurrency,
                    queues[1].in_flight(w.worker_id),
                    w.kv_capacity_tokens,
                    queues[1]._kv_in_flight.get(w.worker_id, 0),
                )
                for w in membership[pool]
            ]
            kept = queues[0].pool_workers(pool)
            assert list(kept) == fresh
            assert kept.in_flight == sum(v.in_flight for v in fresh)
            assert kept.kv_in_flight == sum(v.kv_in_flight for v in fresh)
            assert kept.with_slot == sum(v.has_slot for v in fresh)
            policy = queues[0].policy
            assert policy.load(kept) == policy.load(fresh)  # type: ignore[attr-defined]


def test_pool_workers_sums_follow_replacements() -> None:
    pool = PoolWorkers("p", [WorkerView("a", 2, 0, 100, 0), WorkerView("b", 0, 0, 50, 0)])
    assert (pool.slots, pool.kv_capacity_tokens, pool.with_slot) == (3, 150, 2)
    pool.replace(WorkerView("a", 2, 2, 100, 70))
    assert (pool.in_flight, pool.kv_in_flight, pool.with_slot, pool.any_slot) == (2, 70, 1, True)
    pool.replace(WorkerView("b", 0, 1, 50, 10))
    assert not pool.any_slot
    assert [w.worker_id for w in pool] == ["a", "b"] and pool[1].in_flight == 1
    assert pool.get("c") is None and len(pool) == 2


# ----- the benchmark --------------------------------------------------------------------


def test_decision_cost_steady_state_holds_the_queue_near_its_depth() -> None:
    trace = generate(TraceConfig(seed=2, duration_s=60, rate_per_s=1.0))
    figures = decision_cost.steady(trace.chains, workers=2, depth=40, cycles=60)
    assert figures.hops == 60
    assert 30 <= figures.mean_depth <= 60
    assert 0 < figures.p50_us <= figures.p99_us
    assert figures.decisions_per_s > 0


def test_sim_decision_cost_command_reports_every_size(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(generate(TraceConfig(seed=3, duration_s=30, rate_per_s=1.0), EngineProfile()), trace)
    results = tmp_path / "r.json"
    argv = ["sim", "--decision-cost", "--trace", str(trace), "--results", str(results), "--json"]
    argv += ["--cost-workers", "2", "4", "--cost-depths", "5", "--cost-cycles", "20", "--duration", "10"]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code in (0, None)
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["label"], r["workers"]) for r in rows] == [
        ("replay", 2),
        ("replay", 4),
        ("steady 5", 2),
        ("steady 5", 4),
    ]
    assert all(r["hops"] > 0 for r in rows)
    assert json.loads(results.read_text())["complete"] is True


def test_sim_rejects_more_pools_than_workers(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["sim", "--workers", "2", "--pools", "3", "--rate", "1", "--results", str(tmp_path / "r.json")])
    assert exited.value.code not in (0, None)
    assert "--pools" in capsys.readouterr().err


class StampsNothing(ChainAwarePolicy):
    """A policy whose `pass_stamp` never changes: what one that under-reports its state
    changes (here: held room let go when its hold ends) looks like."""

    def pass_stamp(self, pool: str) -> tuple[int, int, int] | None:
        return (0, 0, 0) if pool in self._indexes else None


def _hold_then_expire(policy: ChainAwarePolicy, skip: bool) -> list[tuple[float, str]]:
    """A chain's context held on the pool's only worker keeps a new chain out (strict
    holds) until the hold ends with time alone; the hop must go at the first pass after."""
    queue = DispatchQueue(64, policy, skip_idle_pools=skip)
    workers = {"a": (WorkerSlots("w0", 2, 10_000),)}
    picks: list[tuple[float, str]] = []

    def assign(now: float) -> None:
        picks.extend((now, hop.run_id) for hop in queue.assign(workers, now))

    first = queue.submit("a", "c1", "0", 0.0, HopView("a", "c1", "0", prompt_tokens=6_000, max_tokens=10))
    assign(0.0)
    queue.finished(first, 1.0, context_tokens=6_010)  # held for `kv_warm_s` (5 s): until 6 s
    queue.submit("a", "c2", "0", 1.0, HopView("a", "c2", "0", prompt_tokens=4_000, max_tokens=10))
    for now in (1.0, 2.0, 6.5, 7.0):
        assign(now)
    return picks


def test_state_changed_with_time_alone_is_seen_through_the_stamp() -> None:
    config = ChainAwareConfig(realtime_guard=False, strict_holds=True, kv_retention="fixed", kv_warm_s=5.0)
    reference = _hold_then_expire(ChainAwarePolicy(config), skip=False)
    assert reference == [(0.0, "c1"), (6.5, "c2")]
    assert _hold_then_expire(ChainAwarePolicy(config), skip=True) == reference
    # The check can fail: a stamp that misses the hold's end keeps skipping the pool.
    assert _hold_then_expire(StampsNothing(config), skip=True) != reference
