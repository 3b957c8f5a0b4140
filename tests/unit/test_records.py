"""The router's recent-run store: node timings, the critical path, percentiles and the
node that makes a chain's P99."""

from __future__ import annotations

import pytest

from inferx.chain.schema import ChainConfig
from inferx.errors import InvalidArgument, NotFound
from inferx.v1 import router_pb2
from inferx_router import records
from inferx_router.records import Percentiles, RunRecord, RunStore, chain_stats, node_timings

# a -> c, b -> c: `a` and `b` run in parallel, `c` after both.
DEPS = {"a": (), "b": (), "c": ("a", "b")}


def hop(node_id: str, latency_ms: float, **kw) -> router_pb2.NodeFinished:
    kw.setdefault("status", "ok")
    return router_pb2.NodeFinished(node_id=node_id, latency_ms=latency_ms, **kw)


def run(run_id: str, a: float, b: float, c: float, chain: str = "demo") -> RunRecord:
    hops = [hop("a", a, node_type="model_inference", model="m"), hop("b", b), hop("c", c)]
    total = max(a, b) + c
    finished = router_pb2.ChainFinished(
        run_id=run_id, status="ok", latency_ms=total, slo_ms=1000, slo_met=total <= 1000, hops=hops
    )
    return RunRecord(chain, "standard", 0, "", DEPS, finished)


# ----- timings and the critical path ---------------------------------------------------


def test_nodes_start_when_their_last_dependency_ends_and_the_slow_branch_is_critical() -> None:
    timings = {t.node_id: t for t in node_timings([hop("a", 100), hop("b", 30), hop("c", 50)], DEPS)}
    assert (timings["a"].start_ms, timings["a"].end_ms) == (0, 100)
    assert (timings["b"].start_ms, timings["b"].end_ms) == (0, 30)
    assert (timings["c"].start_ms, timings["c"].end_ms) == (100, 150)
    assert [n for n, t in timings.items() if t.critical] == ["a", "c"]


def test_the_critical_path_follows_whichever_branch_was_slower_in_this_run() -> None:
    timings = node_timings([hop("a", 10), hop("b", 80), hop("c", 50)], DEPS)
    assert [t.node_id for t in timings if t.critical] == ["b", "c"]


def test_a_parallel_leaf_that_ends_last_is_the_critical_path_on_its_own() -> None:
    deps = {"a": (), "slow_leaf": (), "c": ("a",)}
    timings = node_timings([hop("a", 10), hop("slow_leaf", 500), hop("c", 20)], deps)
    assert [t.node_id for t in timings if t.critical] == ["slow_leaf"]


def test_skipped_nodes_take_no_time() -> None:
    timings = node_timings([hop("a", 40, status="error"), hop("b", 10), hop("c", 0, status="skipped")], DEPS)
    c = next(t for t in timings if t.node_id == "c")
    assert c.start_ms == c.end_ms == 40


# ----- percentiles ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([7], (7, 7, 7, 7)),
        ([1, 2, 3, 4], (2.5, 3.7, 3.97, 4)),
        (list(range(1, 101)), (50.5, 90.1, 99.01, 100)),
    ],
)
def test_node_percentiles_interpolate_between_ranks(values, expected) -> None:
    p = Percentiles.of(values)
    assert (p.p50, p.p90, p.p99, p.max) == pytest.approx(expected)


def test_no_samples_gives_zeros_for_the_wire_message() -> None:
    # The shared percentile says NaN for "no values"; the router's message has no
    # "absent", so the router turns it into zeros (and sends the sample count).
    assert Percentiles.of([]) == Percentiles(0.0, 0.0, 0.0, 0.0)


# ----- stats: who makes the P99 -----------------------------------------------------------


def test_the_node_whose_jitter_is_on_the_critical_path_makes_the_p99() -> None:
    # `b` is far noisier than `a` but always finishes well before `a`, so it never
    # delays `c`; `a` has one slow run, and that run is the chain's tail.
    kept = [run(f"r{i}", a=100, b=10 + (i % 7) * 10, c=50) for i in range(99)]
    kept.append(run("tail", a=600, b=80, c=50))
    stats = chain_stats("demo", kept)
    by_node = {n.node_id: n for n in stats.nodes}
    assert stats.runs == 100 and stats.top_node == "a"
    assert by_node["b"].latency.p99 - by_node["b"].latency.p50 > 0
    assert by_node["b"].p99_share == 0.0
    assert by_node["a"].p99_share == pytest.approx(1.0)
    assert by_node["a"].p99_contribution_ms == pytest.approx(500)
    assert by_node["a"].critical_ratio == pytest.approx(1.0) and by_node["b"].critical_ratio == 0.0
    assert stats.latency.max == 650


def test_excess_is_shared_between_the_critical_nodes_of_the_tail() -> None:
    kept = [run(f"r{i}", a=100, b=10, c=50) for i in range(50)]
    kept.append(run("tail", a=400, b=10, c=150))  # a: +300 over its median, c: +100
    by_node = {n.node_id: n for n in chain_stats("demo", kept).nodes}
    assert by_node["a"].p99_share == pytest.approx(0.75)
    assert by_node["c"].p99_share == pytest.approx(0.25)


def test_identical_runs_blame_no_one() -> None:
    stats = chain_stats("demo", [run(f"r{i}", 100, 10, 50) for i in range(10)])
    assert stats.top_node == ""
    assert all(n.p99_share == 0 for n in stats.nodes)


def test_counts_errors_retries_degradations_and_cache_hits() -> None:
    record = run("x", 100, 10, 50)
    record.finished.hops[0].retries = 2
    record.finished.hops[1].cache_hit = True
    record.finished.hops[2].status = "error"
    record.finished.hops[2].degradation = "fallback_model"
    by_node = {n.node_id: n for n in chain_stats("demo", [record]).nodes}
    assert (by_node["a"].retries, by_node["b"].cache_hits) == (2, 1)
    assert (by_node["c"].errors, by_node["c"].degraded) == (1, 1)


# ----- the store ----------------------------------------------------------------------------


def test_store_keeps_the_newest_runs_and_finds_by_unique_prefix() -> None:
    store = RunStore(capacity=3)
    for run_id in ("aaaa1111", "aaaa2222", "bbbb3333", "cccc4444"):
        store.add(run(run_id, 1, 1, 1))
    assert len(store) == 3
    with pytest.raises(NotFound, match="last 3 runs"):
        store.find("aaaa1111")  # evicted
    assert store.find("aaaa").finished.run_id == "aaaa2222"
    assert store.find("cccc4444").finished.run_id == "cccc4444"
    with pytest.raises(InvalidArgument, match="at least 4"):
        store.find("cc")
    store.add(run("cccc5555", 1, 1, 1))
    with pytest.raises(InvalidArgument, match="matches 2 runs"):
        store.find("cccc")
    store.capacity = 1
    assert [r.finished.run_id for r in store.of_chain("demo")] == ["cccc5555"]


def test_latest_run_overall_and_per_chain() -> None:
    store = RunStore()
    store.add(run("r1", 1, 1, 1, chain="one"))
    store.add(run("r2", 1, 1, 1, chain="two"))
    assert store.find().finished.run_id == "r2"
    assert store.find(chain="one").finished.run_id == "r1"
    with pytest.raises(NotFound, match="chain 'three'"):
        store.find(chain="three")
    assert [r.finished.run_id for r in store.of_chain("two", last=5)] == ["r2"]


def test_record_run_keeps_dependencies_and_shortens_outputs() -> None:
    config = ChainConfig.model_validate(
        {
            "name": "demo",
            "slo": {"end_to_end_latency_p99": "1s"},
            "nodes": [
                {"id": "a", "type": "tool_call", "tool": "t"},
                {"id": "c", "type": "tool_call", "tool": "t", "depends_on": ["a"]},
            ],
        }
    )
    finished = router_pb2.ChainFinished(
        run_id="r1",
        latency_ms=10,
        output="x" * 5000,
        hops=[hop("a", 5, output="y" * 5000, reasoning="z" * 5000), hop("c", 5)],
    )
    store = RunStore()
    record = records.record_run(config, finished, tier="batch", trace_id="ab" * 16, store=store)
    assert store.find("r1") is record
    assert record.depends_on == {"a": (), "c": ("a",)}
    assert len(record.finished.output) == records.KEEP_OUTPUT_CHARS
    assert len(record.finished.hops[0].output) == records.KEEP_OUTPUT_CHARS
    assert len(record.finished.hops[0].reasoning) == records.KEEP_OUTPUT_CHARS
    assert len(finished.output) == 5000  # the caller's message is not touched
    trace = records.run_trace_message(record)
    assert [(t.node_id, t.start_ms, t.end_ms, t.critical) for t in trace.timings] == [
        ("a", 0, 5, True),
        ("c", 5, 10, True),
    ]
    assert list(trace.timings[1].depends_on) == ["a"]
    assert trace.trace_id == "ab" * 16 and trace.tier == "batch"


def test_stats_message_carries_every_field() -> None:
    kept = [run(f"r{i}", a=100, b=10, c=50) for i in range(9)] + [run("t", a=300, b=10, c=50)]
    message = records.chain_stats_message(chain_stats("demo", kept))
    assert message.runs == 10 and message.top_node == "a" and message.slo_met == 10
    a = next(n for n in message.nodes if n.node_id == "a")
    assert a.latency.max_ms == 300 and a.samples == 10 and a.p99_share == pytest.approx(1.0)
    assert a.node_type == "model_inference" and a.queue.p50_ms == 0
