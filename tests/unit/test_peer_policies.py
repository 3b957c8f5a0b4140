"""The peer policies' defining behaviour on hand-built workers and queues (pure code),
and every registered policy on a small simulated trace."""

import math

import pytest

from inferx.hashring import HashRing
from inferx.scheduling.peers.prefix_aware import ApproxTree, PrefixAwarePolicy
from inferx.scheduling.peers.program_las import ProgramLasPolicy
from inferx.scheduling.peers.session_affinity import SessionAffinityPolicy
from inferx.scheduling.queue import DispatchQueue
from inferx.scheduling.registry import make_policy, policy_info, policy_names
from inferx.scheduling.views import HopView, QueuedHop, WorkerSlots, WorkerView
from inferx.sim.cluster import ClusterSim
from inferx.sim.profile import EngineProfile
from inferx.sim.trace import TraceConfig, generate

PEERS = ("least-loaded", "session-affinity", "prefix-aware", "program-las", "tier-priority", "tier-pools")
TIER_ORDERED = ("program-las", "tier-priority")  # peers whose queue is not plain FCFS (tested below)


def hop(run: str, k: int = 0, *, at: float = 0.0, seq: int = 0, **view) -> QueuedHop:
    return QueuedHop(HopView("p", run, str(k), hop_index=k, **view), at, seq)


def workers(*loads: int, kv: int = 100_000, kv_used: tuple[int, ...] = ()) -> list[WorkerView]:
    used = kv_used or (0,) * len(loads)
    return [WorkerView(f"w{i}", 256, load, kv, used[i]) for i, load in enumerate(loads)]


def test_peers_are_registered_with_what_they_imitate() -> None:
    for name in PEERS:
        assert name in policy_names()
        assert policy_info(name).imitates
        assert make_policy(name).name == name


@pytest.mark.parametrize("name", PEERS)
def test_peers_admit_everything_and_leave_the_engine_fcfs(name: str) -> None:
    policy = make_policy(name)
    queued = [hop(f"r{i}", seq=i) for i in range(5000)]
    assert policy.admit(hop("new").view, workers(256, 256), queued, 0.0).accept
    assert policy.plan_ahead(hop("new").view, workers(0), until=10.0, now=0.0) is None
    if name not in TIER_ORDERED:
        assert list(policy.order(queued[:3], workers(0), 0.0)) == queued[:3]
        assert policy.engine_priority(queued[0], 0.0) == 0


# ----- least-loaded -----------------------------------------------------------------------


def test_least_loaded_picks_fewest_in_flight_then_most_free_kv() -> None:
    policy = make_policy("least-loaded")
    assert policy.choose_worker(hop("c"), workers(3, 1, 2), 0.0) == "w1"
    tied = workers(1, 1, 4, kv_used=(9_000, 2_000, 0))
    assert policy.choose_worker(hop("c"), tied, 0.0) == "w1"
    full = [WorkerView("w0", 2, 2), WorkerView("w1", 8, 5)]
    assert policy.choose_worker(hop("c"), full, 0.0) == "w1"  # w0 has no slot
    assert policy.choose_worker(hop("c"), [WorkerView("w0", 1, 1)], 0.0) is None


def test_least_loaded_has_no_affinity() -> None:
    q = DispatchQueue(policy=make_policy("least-loaded"))
    pool = {"p": [WorkerSlots("a", 4), WorkerSlots("b", 4)]}
    q.submit("p", "c", "0", 0.0)
    (first,) = q.assign(pool, 0.0)
    q.finished(first, 1.0, context_tokens=5000, service_s=1.0)
    q.submit("p", "other", "0", 1.0)
    q.assign(pool, 1.0)  # takes a worker; the chain's next hop goes to the other one
    q.submit("p", "c", "1", 2.0, HopView("p", "c", "1", hop_index=1, prompt_tokens=5100))
    (second,) = q.assign(pool, 2.0)
    assert second.worker_id != first.worker_id


# ----- session-affinity -------------------------------------------------------------------


def test_session_affinity_keeps_a_chain_on_its_hashed_worker() -> None:
    policy = SessionAffinityPolicy()
    pool = workers(2, 2, 2, 2)
    homes = {policy.choose_worker(hop("c", k), pool, float(k)) for k in range(5)}
    assert len(homes) == 1  # every hop of the chain
    # Two runs of one session share a key and so a worker.
    one = policy.choose_worker(hop("run-1", session_id="s"), pool, 0.0)
    two = policy.choose_worker(hop("run-2", session_id="s"), pool, 0.0)
    assert one == two
    spread = {policy.choose_worker(hop(f"r{i}"), pool, 0.0) for i in range(200)}
    assert spread == {"w0", "w1", "w2", "w3"}


def test_session_affinity_falls_back_along_the_ring_past_the_load_bound() -> None:
    policy = SessionAffinityPolicy(load_factor=1.25)
    ring = HashRing([f"w{i}" for i in range(4)], vnodes=160)
    owner, second, third, fourth = ring.walk("c")

    def pool(loads: dict[str, int]) -> list[WorkerView]:
        views = workers(0, 0, 0, 0)
        return [WorkerView(w.worker_id, 256, loads.get(w.worker_id, 0), w.kv_capacity_tokens) for w in views]

    # Under the bound, ceil(1.25 x (3+2+2+2+1) / 4) = 4: the owner, though it is the busiest.
    busiest = pool({owner: 3, second: 2, third: 2, fourth: 2})
    assert policy.bound(busiest) == 4
    assert policy.choose_worker(hop("c"), busiest, 0.0) == owner
    # Owner at ceil(1.25 x (3+1+1) / 4) = 2 or more: full. The next worker clockwise takes
    # the hop although another worker is idle (a walk, not least-loaded).
    loads = {owner: 3, second: 1}
    assert policy.bound(pool(loads)) == 2
    assert policy.choose_worker(hop("c"), pool(loads), 0.0) == second
    # Both full: the third on the ring.
    assert policy.choose_worker(hop("c"), pool({owner: 4, second: 4}), 0.0) == third


def test_session_affinity_keeps_its_owner_when_another_worker_leaves() -> None:
    policy = SessionAffinityPolicy()
    pool = workers(0, 0, 0, 0)
    owner = policy.choose_worker(hop("c"), pool, 0.0)
    smaller = [w for w in pool if w.worker_id != next(x.worker_id for x in pool if x.worker_id != owner)]
    assert policy.choose_worker(hop("c"), smaller, 0.0) == owner


# ----- prefix-aware -----------------------------------------------------------------------


def dispatch(policy, queued: QueuedHop, pool: list[WorkerView], context_tokens: int = 0) -> str:
    worker = policy.choose_worker(queued, pool, 0.0)
    assert worker is not None
    queued.worker_id = worker
    policy.on_dispatch(queued, worker, 0.0)
    if context_tokens:
        policy.on_finish(queued, 1.0, context_tokens, 1.0)
    return worker


def test_prefix_aware_follows_the_longest_prefix_match() -> None:
    policy = PrefixAwarePolicy()
    first = dispatch(
        policy, hop("c", prompt_tokens=1000, prefix_id="tools", prefix_tokens=600), workers(0, 0, 0), 1100
    )
    # Its worker is now the busiest (within the balance thresholds), but holds the context.
    busy = workers(*(30 if f"w{i}" == first else 0 for i in range(3)))
    follow = hop("c", 1, prompt_tokens=1300, prefix_id="tools", prefix_tokens=600)
    assert policy.choose_worker(follow, busy, 2.0) == first
    # A new chain with the same tool specs: 600 of 700 tokens cached there (> 30%).
    other = hop("d", prompt_tokens=700, prefix_id="tools", prefix_tokens=600)
    assert policy.choose_worker(other, busy, 2.0) == first
    # A prompt whose cached part is under the threshold goes to the least-loaded worker.
    short = hop("e", prompt_tokens=3000, prefix_id="tools", prefix_tokens=600)
    assert policy.choose_worker(short, busy, 2.0) != first


def test_prefix_aware_prefers_the_longer_of_two_matches() -> None:
    policy = PrefixAwarePolicy()
    pool = workers(0, 0)
    a = dispatch(policy, hop("x", prompt_tokens=700, prefix_id="tools", prefix_tokens=600), pool, 800)
    other_pool = [w for w in pool if w.worker_id != a]
    b = dispatch(policy, hop("c", prompt_tokens=2000, prefix_id="tools", prefix_tokens=600), other_pool, 2200)
    assert a != b
    # Both hold "tools"; only b holds chain c's context: 2200 of 2400 tokens there.
    follow = hop("c", 1, prompt_tokens=2400, prefix_id="tools", prefix_tokens=600)
    assert policy.choose_worker(follow, workers(0, 0), 3.0) == b


def test_prefix_aware_balances_when_load_is_imbalanced() -> None:
    policy = PrefixAwarePolicy(balance_abs_threshold=64, balance_rel_threshold=1.5)
    home = dispatch(policy, hop("c", prompt_tokens=4000), workers(0, 0), 5000)
    other = "w1" if home == "w0" else "w0"

    def pool(home_load: int, other_load: int) -> list[WorkerView]:
        return [WorkerView(home, 256, home_load, 100_000), WorkerView(other, 256, other_load, 100_000)]

    follow = hop("c", 1, prompt_tokens=5200)
    assert policy.choose_worker(follow, pool(70, 10), 2.0) == home  # 60 apart: not imbalanced
    assert policy.choose_worker(follow, pool(100, 10), 2.0) == other  # 90 apart and 10x
    assert policy.choose_worker(follow, pool(200, 140), 2.0) == home  # 60 apart, 1.4x: cache


def test_approx_tree_evicts_least_recent_contexts_before_the_shared_prefix() -> None:
    tree = ApproxTree(max_tokens=2000)
    for run in ("a", "b", "c"):
        tree.insert(HopView("p", run, "0", prefix_id="sys", prefix_tokens=400), 700)
    assert ("c", "a") not in tree.entries and ("c", "c") in tree.entries
    assert ("p", "sys") in tree.entries and tree.size <= 2000
    assert tree.match(HopView("p", "a", "1", prompt_tokens=1500, prefix_id="sys", prefix_tokens=400)) == 400
    assert tree.match(HopView("p", "c", "1", prompt_tokens=1500, prefix_id="sys", prefix_tokens=400)) == 1100


# ----- program-las ------------------------------------------------------------------------


def served(policy: ProgramLasPolicy, run: str, service_s: float, worker: str = "w0", at: float = 0.0) -> None:
    queued = hop(run, at=at, seq=hash(run) % 10_000)
    queued.worker_id = worker
    policy.on_dispatch(queued, worker, at)
    policy.on_finish(queued, at + service_s, 100, service_s)


def test_program_las_serves_least_attained_program_first() -> None:
    policy = ProgramLasPolicy(quantum_s=1.0, growth=4.0, levels=5, starvation_ratio=100.0)
    served(policy, "much", 10.0)  # level 2: 4 <= 10 < 16
    served(policy, "little", 0.5)  # level 0
    queue = [hop("much", 1, at=20.0, seq=1), hop("new", at=20.5, seq=2), hop("little", 1, at=21.0, seq=3)]
    order = [q.run_id for q in policy.order(queue, workers(0), 22.0)]
    assert order == ["new", "little", "much"]  # level 0 in FCFS order, then level 2
    assert [policy.engine_priority(q, 22.0) for q in queue] == [2, 0, 0]
    # Service of a call still running counts: a program cannot hide it.
    running = hop("new", at=23.0, seq=9)
    policy.on_dispatch(running, "w0", 23.0)
    assert math.isclose(policy.attained("new", 28.0), 5.0)


def test_program_las_starvation_bound_lifts_a_long_waiting_program() -> None:
    policy = ProgramLasPolicy(quantum_s=1.0, growth=4.0, levels=5, starvation_ratio=2.0)
    served(policy, "much", 10.0)
    old = hop("much", 1, at=100.0, seq=1)
    young = hop("new", at=105.0, seq=2)
    assert policy.wake_at(old, 105.0) == 120.0  # waited 2 x its 10 s of service
    assert [q.run_id for q in policy.order([old, young], workers(0), 119.0)] == ["new", "much"]
    assert [q.run_id for q in policy.order([old, young], workers(0), 120.0)] == ["much", "new"]
    assert policy.engine_priority(old, 120.0) == 0
    assert policy.wake_at(old, 120.0) is None


def test_program_las_keeps_long_prompts_on_the_programs_worker() -> None:
    policy = ProgramLasPolicy(locality_tokens=2048)
    served(policy, "c", 1.0, worker="w1")
    pool = workers(0, 5)
    assert policy.choose_worker(hop("c", 1, prompt_tokens=3000), pool, 2.0) == "w1"
    assert policy.choose_worker(hop("c", 1, prompt_tokens=1000), pool, 2.0) == "w0"  # short: least-loaded
    no_slot = [WorkerView("w0", 256, 0), WorkerView("w1", 5, 5)]
    assert policy.choose_worker(hop("c", 1, prompt_tokens=3000), no_slot, 2.0) == "w0"
    policy.on_chain_end("c", 3.0)
    assert policy.program("c") is None


# ----- tier-aware peers -------------------------------------------------------------------


def test_tier_priority_serves_realtime_first_and_tells_the_engine_the_tier() -> None:
    from inferx.scheduling.views import Tier

    policy = make_policy("tier-priority")
    batch = hop("b", at=0.0, seq=0, tier=Tier.BATCH)
    standard = hop("s", at=1.0, seq=1, tier=Tier.STANDARD)
    realtime = hop("r", at=2.0, seq=2, tier=Tier.REALTIME)
    unspecified = hop("u", at=0.5, seq=3)
    order = list(policy.order([batch, standard, realtime, unspecified], workers(0), 3.0))
    assert order == [realtime, unspecified, standard, batch]  # tier, then arrival
    assert [policy.engine_priority(q, 3.0) for q in (realtime, standard, batch, unspecified)] == [0, 1, 2, 1]
    # Placement is session affinity's: the same chain key lands on the same worker.
    pool = workers(0, 0, 0, 0)
    first = policy.choose_worker(hop("r", 0, tier=Tier.REALTIME), pool, 0.0)
    assert all(policy.choose_worker(hop("r", k, tier=Tier.REALTIME), pool, 0.0) == first for k in range(5))


def test_tier_pools_keep_realtime_on_its_own_workers() -> None:
    from inferx.scheduling.peers.tier_aware import TierPoolsPolicy
    from inferx.scheduling.views import Tier

    policy = make_policy("tier-pools", realtime_share=0.5)
    assert isinstance(policy, TierPoolsPolicy)
    pool = workers(0, 0, 0, 0)
    realtime = {policy.choose_worker(hop(f"r{i}", tier=Tier.REALTIME), pool, 0.0) for i in range(60)}
    others = {policy.choose_worker(hop(f"o{i}", tier=Tier.BATCH), pool, 0.0) for i in range(60)}
    assert realtime == {"w0", "w1"} and others == {"w2", "w3"}
    # The realtime side full: a realtime hop waits rather than take the others' workers.
    busy = [WorkerView("w0", 1, 1), WorkerView("w1", 1, 1), WorkerView("w2", 1, 0), WorkerView("w3", 1, 0)]
    assert policy.choose_worker(hop("r0", tier=Tier.REALTIME), busy, 0.0) is None
    # The default share is a quarter (at least one worker each side); one worker serves all.
    default = make_policy("tier-pools")
    assert {default.choose_worker(hop(f"r{i}", tier=Tier.REALTIME), pool, 0.0) for i in range(20)} == {"w0"}
    assert default.choose_worker(hop("x", tier=Tier.REALTIME), workers(0), 0.0) == "w0"
    assert default.choose_worker(hop("x", tier=Tier.BATCH), workers(0), 0.0) == "w0"
    with pytest.raises(ValueError, match="realtime_share"):
        make_policy("tier-pools", realtime_share=1.0)


# ----- in the simulator -------------------------------------------------------------------


@pytest.mark.parametrize("name", policy_names())
def test_every_registered_policy_runs_a_small_trace_to_completion(name: str) -> None:
    trace = generate(TraceConfig(seed=7, duration_s=40, rate_per_s=1.0))
    run = ClusterSim(trace, make_policy(name), EngineProfile(), workers=2).run()
    assert len(run.chains) == len(trace.chains) > 10
    assert all(c.status == "ok" for c in run.chains), name


def test_the_simulator_shows_policies_the_shared_prefix_and_nothing_of_the_future() -> None:
    seen: list[HopView] = []
    policy = make_policy("least-loaded")
    original = policy.on_dispatch

    def spy(queued, worker_id, now):
        seen.append(queued.view)
        original(queued, worker_id, now)

    policy.on_dispatch = spy  # type: ignore[method-assign]
    trace = generate(TraceConfig(seed=7, duration_s=20, rate_per_s=1.0))
    ClusterSim(trace, policy, EngineProfile(), workers=2).run()
    by_id = {c.chain_id: c for c in trace.chains}
    for view in seen:
        chain = by_id[view.run_id]
        assert (view.prefix_id, view.prefix_tokens) == (chain.shared_prefix, chain.shared_tokens)
        assert view.prompt_tokens == chain.prompt_tokens(view.hop_index)
    assert len(seen) == sum(len(c.hops) for c in trace.chains)
