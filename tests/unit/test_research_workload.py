"""DAG chains (`TraceHop.depends_on`) and the `research` workload: the trace format, the
generator's shape, the simulator's and the live replay's DAG semantics (branches in
flight together, the join issued only after every branch and its delay), and what a
policy may know of a DAG chain (its declared structure, never its future)."""

from __future__ import annotations

import asyncio
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from inferx.bench.live import CHARS_PER_TOKEN, TraceReplayer, build_prompt, piece
from inferx.errors import InvalidArgument
from inferx.scheduling.registry import make_policy
from inferx.scheduling.views import HopView
from inferx.sim.cluster import ClusterSim, alone_latency_s, hop_segments
from inferx.sim.engine import EngineModel, SimRequest
from inferx.sim.estimates import RemainingPath
from inferx.sim.profile import EngineProfile
from inferx.sim.records import ChainRecord
from inferx.sim.trace import (
    ChainProgress,
    Trace,
    TraceChain,
    TraceConfig,
    TraceHop,
    TraceMeta,
    generate,
    read_trace,
    ready_at,
    workload,
    write_trace,
)
from inferx.tls import Transport
from inferx.tokens import shared_prefix
from inferx.v1 import common_pb2, scheduler_pb2

ROOT = Path(__file__).resolve().parents[2]

# plan -> branches A (calls 1, 2), B (call 3), C (calls 4, 5) -> join (call 6)
PLAN, A1, A2, B1, C1, C2, JOIN = range(7)


def dag_chain(chain_id: str = "r0", arrival_s: float = 0.0, tier: str = "standard") -> TraceChain:
    hops = [
        TraceHop(new_tokens=200, output_tokens=300, delay_after_s=0.5),
        TraceHop(new_tokens=100, output_tokens=60, delay_after_s=2.0, depends_on=[PLAN]),
        TraceHop(new_tokens=3000, output_tokens=400, delay_after_s=0.2, depends_on=[A1]),
        TraceHop(new_tokens=120, output_tokens=500, delay_after_s=0.1, depends_on=[PLAN]),
        TraceHop(new_tokens=150, output_tokens=80, delay_after_s=5.0, depends_on=[PLAN]),
        TraceHop(new_tokens=2000, output_tokens=300, delay_after_s=0.3, depends_on=[C1]),
        TraceHop(new_tokens=250, output_tokens=1500, depends_on=[A2, B1, C2]),
    ]
    return TraceChain(
        chain_id=chain_id,
        kind="research",
        tier=tier,
        arrival_s=arrival_s,
        slo_s=600.0,
        shared_prefix="research-system",
        shared_tokens=3000,
        hops=hops,
    )


def as_trace(*chains: TraceChain) -> Trace:
    meta = TraceMeta(config=TraceConfig(duration_s=10.0, rate_per_s=0.1), chains=len(chains), profile="test")
    return Trace(meta=meta, chains=list(chains))


# ----- the format ---------------------------------------------------------------------


def test_depends_on_round_trips_and_sequential_hops_are_written_as_before(tmp_path: Path) -> None:
    chain = dag_chain()
    sequential = TraceChain(
        chain_id="s0",
        kind="chat",
        tier="realtime",
        arrival_s=1.0,
        slo_s=30.0,
        shared_prefix="chat-system",
        shared_tokens=400,
        hops=[
            TraceHop(new_tokens=50, output_tokens=20, delay_after_s=3.0),
            TraceHop(new_tokens=9, output_tokens=7),
        ],
    )
    trace = as_trace(chain, sequential)
    path = tmp_path / "dag.jsonl"
    write_trace(trace, path)
    assert read_trace(path) == trace
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[1]["hops"][JOIN]["depends_on"] == [A2, B1, C2]
    assert "depends_on" not in lines[1]["hops"][PLAN]  # None is left out of the file
    assert all("depends_on" not in hop for hop in lines[2]["hops"])


def test_traces_without_the_field_are_sequences() -> None:
    """Traces without the field keep their meaning: each call waits for the previous one."""
    source = ROOT / "benchmarks" / "default_trace.jsonl"
    trace = read_trace(source)
    assert all(h.depends_on is None for c in trace.chains for h in c.hops)
    assert all(c.is_sequence for c in trace.chains)
    chain = trace.chains[0]
    assert [chain.deps(k) for k in range(3)] == [[], [0], [1]]
    assert chain.ancestors(3) == [0, 1, 2]


@pytest.mark.parametrize("bad", [[6], [-1], [7], [2, 2]])
def test_depends_on_must_name_earlier_calls(bad: list[int]) -> None:
    chain = dag_chain("r-bad")
    hops = [*chain.hops[:JOIN], chain.hops[JOIN].model_copy(update={"depends_on": bad})]
    with pytest.raises(ValidationError, match=r"chain r-bad hop 6: depends_on"):
        TraceChain.model_validate({**chain.model_dump(), "hops": [h.model_dump() for h in hops]})


def test_a_bad_dependency_in_a_file_names_the_line_chain_and_hop(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    write_trace(as_trace(dag_chain("r7")), path)
    text = path.read_text().replace('"depends_on":[2,3,5]', '"depends_on":[2,3,9]')
    path.write_text(text)
    with pytest.raises(InvalidArgument, match=r"line 2: .*chain r7 hop 6: depends_on \[2, 3, 9\]"):
        read_trace(path)


def test_prompts_carry_transitive_ancestors_and_the_slo_uses_the_critical_path() -> None:
    chain = dag_chain()
    profile = EngineProfile()
    assert chain.roots() == [PLAN]
    assert chain.dependents(PLAN) == [A1, B1, C1]
    assert chain.ancestors(A2) == [PLAN, A1]
    assert chain.ancestors(JOIN) == [PLAN, A1, A2, B1, C1, C2]
    # The one-pass table the simulator uses: the same lists as the walk per call.
    assert chain.ancestor_table() == [chain.ancestors(k) for k in range(len(chain.hops))]
    for generated in generate(workload("research", 1).model_copy(update={"duration_s": 60})).chains:
        assert generated.ancestor_table() == [generated.ancestors(k) for k in range(len(generated.hops))]
    sizes = {k: h.new_tokens + h.output_tokens for k, h in enumerate(chain.hops)}
    assert chain.prompt_tokens(B1) == 3000 + sizes[PLAN] + 120  # not branch A's tokens
    assert chain.prompt_tokens(JOIN) == 3000 + sum(sizes[k] for k in range(JOIN)) + 250
    # Every path: plan -> A -> join, plan -> B -> join, plan -> C -> join; the model
    # times alone and the delays on the slowest one, not the sums over all calls.
    path = chain.critical_path(profile)
    assert path[0] == PLAN and path[-1] == JOIN and path in ([0, 1, 2, 6], [0, 3, 6], [0, 4, 5, 6])

    def alone(k: int) -> float:
        h = chain.hops[k]
        return profile.alone_hop_s(h.new_tokens, chain.prompt_tokens(k), h.output_tokens)

    paths = ([0, 1, 2, 6], [0, 3, 6], [0, 4, 5, 6])
    totals = {
        tuple(p): sum(alone(k) for k in p) + sum(chain.hops[k].delay_after_s for k in p[:-1]) for p in paths
    }
    assert tuple(path) == max(totals, key=lambda p: totals[p])
    assert path == [0, 4, 5, 6]  # branch C's 5 s tool dominates here
    assert chain.delays_s(profile) == pytest.approx(0.5 + 5.0 + 0.3)
    assert chain.model_alone_s(profile) == pytest.approx(sum(alone(k) for k in path))
    assert chain.model_alone_s(profile) < sum(alone(k) for k in range(len(chain.hops)))


def test_ready_at_waits_for_every_dependency_and_its_delay() -> None:
    chain = dag_chain(arrival_s=7.0)
    assert ready_at(chain, PLAN, {}, arrival=7.0) == 7.0
    assert ready_at(chain, A1, {}, arrival=7.0) is None
    assert ready_at(chain, A1, {PLAN: 10.0}, arrival=7.0) == 10.5
    finished = {PLAN: 10.0, A1: 12.0, A2: 20.0, B1: 11.0, C1: 13.0}
    assert ready_at(chain, JOIN, finished, arrival=7.0) is None  # C2 still running
    finished[C2] = 19.95
    assert ready_at(chain, JOIN, finished, arrival=7.0) == pytest.approx(20.25)  # C2 + 0.3 > A2 + 0.2
    assert ready_at(chain, JOIN, finished, arrival=7.0, speed=10.0) == pytest.approx(20.02)

    progress = ChainProgress(chain)
    assert progress.issue(PLAN) == (0, 6)
    assert progress.finish(PLAN, 1.0) == [(A1, 1.5), (B1, 1.5), (C1, 1.5)]
    assert [progress.issue(k) for k in (A1, B1, C1)] == [(1, 5), (1, 4), (1, 3)]
    assert progress.finish(B1, 2.0) == []  # the join also waits for A2 and C2
    assert progress.finish(A1, 3.0) == [(A2, 5.0)]
    progress.issue(A2)
    assert progress.finish(C1, 3.0) == [(C2, 8.0)]
    progress.issue(C2)
    assert progress.finish(A2, 6.0) == []
    assert progress.finish(C2, 9.0) == [(JOIN, 9.3)]
    assert progress.issue(JOIN) == (6, 0)
    assert not progress.done
    progress.finish(JOIN, 20.0)
    assert progress.done


def test_segment_keys_name_their_whole_prefix() -> None:
    """Branches share the plan's segments; the join shares the first branch's context;
    a later branch's segments after another branch are other content (no false hit)."""
    chain = dag_chain()
    for k in range(len(chain.hops)):
        prompt, _ = hop_segments(chain, k)
        assert sum(s.tokens for s in prompt) == chain.prompt_tokens(k)
    a2, _ = hop_segments(chain, A2)
    b1, _ = hop_segments(chain, B1)
    join, _ = hop_segments(chain, JOIN)
    assert [s.key for s in b1[:3]] == [s.key for s in a2[:3]]  # system, plan in, plan out
    _, a2_out = hop_segments(chain, A2)
    assert [s.key for s in join[: len(a2) + 1]] == [s.key for s in a2] + [a2_out[0].key]
    assert join[len(a2) + 1].key != b1[-1].key  # B's input, now after branch A

    engine = EngineModel(EngineProfile())
    for k in (PLAN, B1, A1, A2):  # B ran before A: its cached input must not match the join's
        prompt, output = hop_segments(chain, k)
        engine.add(SimRequest(str(k), prompt, chain.hops[k].output_tokens, output_segments=output))
        while (plan := engine.plan()) is not None:
            engine.commit(plan, plan.steps, 0.0)
    request = SimRequest("join", join, 1)
    engine.add(request)
    engine.plan()
    assert request.cached_tokens == 3000 + sum(
        chain.hops[j].new_tokens + chain.hops[j].output_tokens for j in (PLAN, A1, A2)
    )


# ----- the research generator -----------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_research_chains_fan_out_and_join(seed: int) -> None:
    trace = generate(workload("research", seed))
    chains = trace.chains
    assert len(chains) > 150 and {c.kind for c in chains} == {"research"}
    fan_outs = []
    for chain in chains:
        last = len(chain.hops) - 1
        assert chain.deps(0) == [] and chain.roots() == [0]
        branch_starts = [k for k in range(1, last) if chain.deps(k) == [0]]
        assert 2 <= len(branch_starts) <= 6
        fan_outs.append(len(branch_starts))
        # Each branch: a run of 1-3 calls, each depending on the one before it.
        ends = [*(s - 1 for s in branch_starts[1:]), last - 1]
        for start, end in zip(branch_starts, ends, strict=True):
            assert 1 <= end - start + 1 <= 3
            assert all(chain.deps(k) == [k - 1] for k in range(start + 1, end + 1))
        assert chain.deps(last) == ends  # the report waits for every branch
        assert set(chain.ancestors(last)) == set(range(last))
        join_prompt = chain.prompt_tokens(last)
        assert all(join_prompt > chain.prompt_tokens(k) for k in range(last))
        assert 1_000 <= chain.hops[last].output_tokens <= 3_000
        # The SLO: the critical path's delays + factor x its model time (< the sum).
        profile = EngineProfile()
        assert chain.model_alone_s(profile) < sum(
            profile.alone_hop_s(h.new_tokens, chain.prompt_tokens(k), h.output_tokens)
            for k, h in enumerate(chain.hops)
        )
    assert set(fan_outs) == {2, 3, 4, 5, 6}
    joins = [c.prompt_tokens(len(c.hops) - 1) for c in chains]
    assert 12_000 <= statistics.median(joins) <= 40_000
    assert set(Counter(c.tier for c in chains)) == {"realtime", "standard", "batch"}
    assert generate(workload("research", seed)) == trace  # deterministic


# ----- the simulator ---------------------------------------------------------------------


class Spy:
    """What the policy saw: each call's view, submit, dispatch and finish times."""

    def __init__(self, policy_name: str = "chain-aware", **options: Any) -> None:
        self.policy = make_policy(policy_name, **options)
        self.views: dict[tuple[str, int], HopView] = {}
        self.submitted: dict[tuple[str, int], float] = {}
        self.dispatched: dict[tuple[str, int], float] = {}
        self.finished: dict[tuple[str, int], float] = {}
        self.order: list[HopView] = []
        dispatch, finish = self.policy.on_dispatch, self.policy.on_finish

        def on_dispatch(queued, worker_id, now):
            key = (queued.run_id, int(queued.hop_id))
            self.views[key], self.submitted[key], self.dispatched[key] = queued.view, queued.enqueued_at, now
            self.order.append(queued.view)
            dispatch(queued, worker_id, now)

        def on_finish(queued, now, context_tokens, service_s):
            self.finished[(queued.run_id, int(queued.hop_id))] = now
            finish(queued, now, context_tokens, service_s)

        self.policy.on_dispatch = on_dispatch  # type: ignore[method-assign]
        self.policy.on_finish = on_finish  # type: ignore[method-assign]


def test_cluster_runs_branches_concurrently_and_the_join_after_all() -> None:
    chain = dag_chain()
    spy = Spy()
    run = ClusterSim(as_trace(chain), spy.policy, EngineProfile(), workers=2).run()
    (record,) = run.chains
    assert record.status == "ok"
    t = {k: (spy.submitted[("r0", k)], spy.finished[("r0", k)]) for k in range(len(chain.hops))}
    # The three branches are issued together, plan finish + its delay.
    assert t[A1][0] == t[B1][0] == t[C1][0] == pytest.approx(t[PLAN][1] + 0.5)
    # Two branches in flight at the same simulated time.
    assert max(t[A1][0], t[B1][0]) < min(t[A1][1], t[B1][1])
    # Within a branch: after the previous call and the tool.
    assert t[A2][0] == pytest.approx(t[A1][1] + 2.0)
    assert t[C2][0] == pytest.approx(t[C1][1] + 5.0)
    # The join: only once every branch finished and its delay passed.
    assert t[JOIN][0] == pytest.approx(max(t[A2][1] + 0.2, t[B1][1] + 0.1, t[C2][1] + 0.3))
    assert record.latency_s == pytest.approx(t[JOIN][1])
    assert record.delays_s == pytest.approx(chain.delays_s(EngineProfile()))
    assert len(record.ttft_s) == len(chain.hops)
    # What the policy was told: calls finished so far, calls not yet issued after it.
    join = spy.views[("r0", JOIN)]
    assert (join.hop_index, join.remaining_hops) == (JOIN, 0)
    assert join.prompt_tokens == chain.prompt_tokens(JOIN)
    branch_views = [spy.views[("r0", k)] for k in (A1, B1, C1)]
    assert {v.hop_index for v in branch_views} == {1}
    assert sorted(v.remaining_hops or 0 for v in branch_views) == [3, 4, 5]
    # Branch A's two calls and branch C's two are the same picture of the chain's
    # structure: when A2 is issued, B1 may be done already, so hop_index counts that.
    a2 = spy.views[("r0", A2)]
    assert a2.hop_index == sum(1 for k in range(len(chain.hops)) if t[k][1] <= t[A2][0])


def test_alone_latency_runs_branches_together_on_one_engine() -> None:
    chain = dag_chain()
    profile = EngineProfile()
    alone = alone_latency_s(chain, profile)
    sequential = chain.model_copy(
        update={"hops": [h.model_copy(update={"depends_on": None}) for h in chain.hops]}
    )
    assert sequential.is_sequence
    # The critical path's delays and model time bound it below; running the branches
    # one after another (the same calls as a sequence) takes longer.
    assert alone >= chain.delays_s(profile) + 0.9 * chain.model_alone_s(profile)
    assert alone < alone_latency_s(sequential, profile)
    # Alone on a one-worker cluster the replay takes about as long: the cluster starts a
    # plan on the first of the branches delivered together, so the others join a step
    # later (a step or two of difference, not a branch's worth).
    run = ClusterSim(as_trace(chain), make_policy("round-robin"), profile, workers=1).run()
    latency = run.chains[0].latency_s or 0.0
    assert alone - 1e-9 <= latency <= alone + 0.1


def test_the_default_trace_replays_exactly_as_before() -> None:
    """Pinned before DAG support (commit 7f180ac): the first 60 s of the default trace
    under chain-aware on 4 workers. Sequential chains take the same path through the new
    code, so nothing may move; if the engine model itself changes, recompute these. (The
    realtime guard, priced, tiered KV holds and placing other tiers apart from realtime
    came after the pin, so they are off: this pins the replay, not the policy.)"""
    trace = read_trace(ROOT / "benchmarks" / "default_trace.jsonl").head(60)
    spy = Spy(
        realtime_guard=False,
        kv_retention="fixed",
        tiered_holds=False,
        overload_control=False,
        realtime_apart=0.0,
    )
    run = ClusterSim(trace, spy.policy, EngineProfile(), workers=4).run()
    latencies = sorted(c.latency_s or 0.0 for c in run.chains)
    assert len(latencies) == 69 and all(c.status == "ok" for c in run.chains)
    assert round(sum(latencies), 6) == 2793.353775
    assert (round(latencies[0], 6), round(latencies[34], 6), round(latencies[-1], 6)) == (
        4.825337,
        16.058641,
        185.978171,
    )
    assert round(sum(t for c in run.chains for t in c.ttft_s), 6) == 43.927502
    assert round(sum(v.remaining_critical_path_s for v in spy.order), 6) == 21656.145978
    assert sum(v.hop_index for v in spy.order) == sum(v.remaining_hops or 0 for v in spy.order) == 5592
    assert sum(c.cached_tokens for c in run.chains) == 5078430


def test_research_replays_with_every_policy() -> None:
    trace = generate(workload("research", 1)).head(120)
    for name in ("round-robin", "session-affinity", "prefix-aware", "program-las", "chain-aware"):
        run = ClusterSim(trace, make_policy(name), EngineProfile(), workers=4).run()
        assert all(c.status == "ok" for c in run.chains), name
        assert all(len(c.ttft_s) == len(s.hops) for c, s in zip(run.chains, trace.chains, strict=True))


# ----- what a policy may know ---------------------------------------------------------------


def test_remaining_path_of_a_dag_is_the_longest_learned_path() -> None:
    deps = [[], [0], [1], [0], [2, 3]]  # plan; branch (1, 2); branch 3; join 4
    path = RemainingPath(alpha=1.0)
    assert path.remaining_s("research", 0, 5, deps) == 0.0  # nothing learned yet
    for index, seconds in enumerate((4.0, 1.0, 6.0, 3.0, 20.0)):
        path.call_finished("research", index, seconds)
    for index, seconds in enumerate((0.5, 2.0, 0.1, 0.4)):
        path.gap_observed("research", index, seconds)
    # From the plan: 4 + 0.5 + max(1 + 2 + 6 + 0.1, 3 + 0.4) + 20
    assert path.remaining_s("research", 0, 5, deps) == pytest.approx(4 + 0.5 + 9.1 + 20)
    assert path.remaining_s("research", 3, 5, deps) == pytest.approx(3 + 0.4 + 20)  # its own path only
    assert path.remaining_s("research", 4, 5, deps) == pytest.approx(20)
    # A sequence's numbers are unchanged: every call and gap after it.
    assert path.remaining_s("research", 0, 5) == pytest.approx(4 + 0.5 + 1 + 2 + 6 + 0.1 + 3 + 0.4 + 20)
    linear = [[], [0], [1], [2], [3]]
    assert path.remaining_s("research", 1, 5, linear) == path.remaining_s("research", 1, 5)


def test_a_dag_chains_future_does_not_reach_the_policy() -> None:
    """Change the last research chain's future (every call after the plan: outputs,
    tool delays): every view the policy saw up to that chain's first call is the same,
    and that first call is told the declared structure (calls left) only."""
    trace = generate(workload("research", 2)).head(150)
    last = trace.chains[-1]
    changed_hops = [last.hops[0]] + [
        h.model_copy(update={"output_tokens": h.output_tokens * 3, "delay_after_s": h.delay_after_s * 7 + 1})
        for h in last.hops[1:]
    ]
    changed = trace.model_copy(
        update={"chains": [*trace.chains[:-1], last.model_copy(update={"hops": changed_hops})]}
    )

    def until_first_call_of_last(t: Trace) -> list[HopView]:
        spy = Spy()
        ClusterSim(t, spy.policy, EngineProfile(), workers=2).run()
        index = next(i for i, v in enumerate(spy.order) if v.run_id == last.chain_id)
        return spy.order[: index + 1]

    before, after = until_first_call_of_last(trace), until_first_call_of_last(changed)
    assert before == after
    assert any(v.remaining_critical_path_s > 0 for v in before)  # something was learned
    first = after[-1]
    assert (first.hop_index, first.remaining_hops) == (0, len(last.hops) - 1)


# ----- the live replay (a fake scheduler: the DAG ordering and the prompts) ----------------


class FakeScheduler:
    """SubmitHop of a scheduler whose every call takes `service_s` wall seconds and
    answers exactly the call's output tokens (the text names the call)."""

    def __init__(self, trace: Trace, service_s: float = 0.05) -> None:
        self.by_id = {c.chain_id: c for c in trace.chains}
        self.service_s = service_s
        self.started: dict[int, float] = {}
        self.ended: dict[int, float] = {}
        self.requests: dict[int, scheduler_pb2.HopRequest] = {}

    async def _stream(self, request: scheduler_pb2.HopRequest):
        loop = asyncio.get_running_loop()
        k = int(request.context.hop_id)
        chain = self.by_id[request.context.run_id]
        self.started[k], self.requests[k] = loop.time(), request
        tokens = request.sampling.stop_after_tokens
        text = f"<out {k}>".ljust(tokens * CHARS_PER_TOKEN, "x")
        half = len(text) // 2
        yield scheduler_pb2.HopEvent(kind=scheduler_pb2.HopEvent.KIND_TOKENS, text=text[:half])
        await asyncio.sleep(self.service_s)
        self.ended[k] = loop.time()
        usage = common_pb2.TokenUsage(prompt_tokens=chain.prompt_tokens(k), completion_tokens=tokens)
        yield scheduler_pb2.HopEvent(kind=scheduler_pb2.HopEvent.KIND_FINISHED, text=text[half:], usage=usage)

    def SubmitHop(self, request: scheduler_pb2.HopRequest):  # noqa: N802 (the gRPC method's name)
        return self._stream(request)


async def test_live_replay_runs_branches_concurrently_and_joins_after_all() -> None:
    speed = 100.0  # delays of seconds become tens of milliseconds
    chain = dag_chain()
    trace = as_trace(chain)
    fake = FakeScheduler(trace, service_s=0.2)  # long beside scheduling jitter
    replayer = TraceReplayer("unused", trace, EngineProfile(), speed, transport=Transport.plaintext())
    record = ChainRecord.start(chain, alone_s=1.0)
    start = asyncio.get_running_loop().time()
    await replayer._chain(fake, chain, record, start)
    assert record.status == "ok" and replayer.errors == {}
    assert set(fake.ended) == set(range(len(chain.hops)))
    s, e = fake.started, fake.ended
    # The branches run together: each started before any of them ended.
    assert max(s[A1], s[B1], s[C1]) < min(e[A1], e[B1], e[C1])
    # Dependencies and their delays (divided by speed) are respected, never skipped.
    slack = 0.001
    for k in range(len(chain.hops)):
        for j in chain.deps(k):
            assert s[k] >= e[j] + chain.hops[j].delay_after_s / speed - slack, (j, k)
    assert s[JOIN] >= max(e[A2] + 0.2 / speed, e[B1] + 0.1 / speed, e[C2] + 0.3 / speed) - slack
    # Prompts: every ancestor's input and actual completion, in index order.
    outputs = {
        k: f"<out {k}>".ljust(h.output_tokens * CHARS_PER_TOKEN, "x") for k, h in enumerate(chain.hops)
    }
    for k in range(len(chain.hops)):
        prompt = fake.requests[k].prompt
        assert prompt == build_prompt(chain, k, outputs)
        assert len(prompt) == chain.prompt_tokens(k) * CHARS_PER_TOKEN
    assert "<out 2>" in fake.requests[JOIN].prompt and "<out 2>" not in fake.requests[B1].prompt
    # The context the router gets: calls finished, calls not yet issued after this one.
    join = fake.requests[JOIN].context
    assert (join.hop_index, join.remaining_hops) == (JOIN, 0)
    assert sorted(fake.requests[k].context.remaining_hops for k in (A1, B1, C1)) == [3, 4, 5]
    assert record.prompt_tokens == sum(chain.prompt_tokens(k) for k in range(len(chain.hops)))
    assert len(record.ttft_s) == len(chain.hops)


async def test_live_replay_of_a_sequence_is_unchanged() -> None:
    trace = generate(TraceConfig(seed=2, duration_s=5, rate_per_s=1.0, mix={"bfcl": 1.0}))
    chain = trace.chains[0]
    fake = FakeScheduler(trace, service_s=0.001)
    replayer = TraceReplayer("unused", trace, EngineProfile(), speed=1000.0, transport=Transport.plaintext())
    record = ChainRecord.start(chain, alone_s=1.0)
    await replayer._chain(fake, chain, record, asyncio.get_running_loop().time() - chain.arrival_s / 1000)
    assert record.status == "ok"
    for k in range(len(chain.hops)):
        context = fake.requests[k].context
        assert (context.hop_index, context.remaining_hops) == (k, len(chain.hops) - 1 - k)
        if k:
            assert fake.started[k] >= fake.ended[k - 1]
    outputs = [f"<out {k}>".ljust(h.output_tokens * CHARS_PER_TOKEN, "x") for k, h in enumerate(chain.hops)]
    assert fake.requests[len(chain.hops) - 1].prompt == build_prompt(chain, len(chain.hops) - 1, outputs)
    # Every call names the system prompt it starts with, as the router names a template's head.
    assert chain.shared_tokens
    head = piece(f"system {chain.shared_prefix}", chain.shared_tokens)
    named = {
        (fake.requests[k].context.prefix_id, fake.requests[k].context.prefix_tokens) for k in fake.requests
    }
    assert named == {shared_prefix(head)} and all(
        fake.requests[k].prompt.startswith(head) for k in fake.requests
    )


def test_a_chain_learns_its_remaining_path_from_chains_of_its_own_tier_only() -> None:
    """What a live router learns per chain config (one tier): a batch chain's finished
    calls (its queueing included) say nothing about a realtime chain of the same kind."""

    def chain(chain_id: str, tier: str, arrival_s: float) -> TraceChain:
        hops = [
            TraceHop(new_tokens=50, output_tokens=20, delay_after_s=1.0),
            TraceHop(new_tokens=9, output_tokens=7),
        ]
        return TraceChain(
            chain_id=chain_id,
            kind="chat",
            tier=tier,
            arrival_s=arrival_s,
            slo_s=60.0,
            shared_prefix="chat-system",
            shared_tokens=400,
            hops=hops,
        )

    spy = Spy()
    trace = as_trace(chain("b", "batch", 0.0), chain("r", "realtime", 30.0), chain("r2", "realtime", 60.0))
    ClusterSim(trace, spy.policy, EngineProfile(), workers=1).run()
    assert spy.views[("r", 0)].remaining_critical_path_s == 0.0  # only a batch chain finished
    assert spy.views[("r2", 0)].remaining_critical_path_s > 0.0  # a realtime one has
