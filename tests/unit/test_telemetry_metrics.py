"""Metric definitions: values after a known run are what they must be, every family
passes `promtool check metrics`, and labels stay bounded (no run ids)."""

from __future__ import annotations

import shutil
import subprocess
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

import inferx_cache.__main__  # noqa: F401  (registers the cache's metrics)
import inferx_scheduler.metrics  # noqa: F401
import inferx_worker.metrics  # noqa: F401
from inferx.resilience import BreakerState
from inferx.v1 import common_pb2, router_pb2
from inferx_memory_pool import metrics as pool_metrics
from inferx_memory_pool.ledger import WorkerLedger
from inferx_router import metrics


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: run `make setup` (deploy/scripts/ensure-command.sh installs it)")
    return path


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def known_run() -> router_pb2.ChainFinished:
    return router_pb2.ChainFinished(
        run_id="0123456789abcdef",
        status="ok",
        latency_ms=1500,
        slo_ms=2000,
        slo_met=True,
        chain_version=4,
        hops=[
            router_pb2.NodeFinished(
                node_id="think",
                status="ok",
                latency_ms=700,
                model="qwen-7b",
                usage=common_pb2.TokenUsage(prompt_tokens=100, cached_prompt_tokens=60, completion_tokens=20),
            ),
            router_pb2.NodeFinished(node_id="search", status="ok", latency_ms=30, tool="vector_search"),
        ],
    )


def test_a_known_run_moves_each_router_metric_by_exactly_its_numbers() -> None:
    chain, labels = "metrics_demo", {"chain": "metrics_demo", "model": "qwen-7b"}
    before = {
        "count": value(
            "inferx_chain_latency_seconds_count", chain=chain, version="4", tier="realtime", status="ok"
        ),
        "le2": value(
            "inferx_chain_latency_seconds_bucket",
            chain=chain,
            version="4",
            tier="realtime",
            status="ok",
            le="2.0",
        ),
        "le1": value(
            "inferx_chain_latency_seconds_bucket",
            chain=chain,
            version="4",
            tier="realtime",
            status="ok",
            le="1.0",
        ),
        "met": value("inferx_chain_slo_runs_total", chain=chain, tier="realtime", result="met"),
        "prompt": value("inferx_model_prompt_tokens_total", **labels),
        "cached": value("inferx_model_cached_prompt_tokens_total", **labels),
        "out": value("inferx_model_completion_tokens_total", **labels),
    }
    finished = known_run()
    metrics.observe_chain(chain, "realtime", finished, slo_target=0.995)
    for hop in finished.hops:
        metrics.observe_node(chain, hop.node_id, hop)
    assert value(
        "inferx_chain_latency_seconds_count", chain=chain, version="4", tier="realtime", status="ok"
    ) == (before["count"] + 1)
    # 1.5 s lands in the 2 s bucket, not the 1 s one.
    assert value(
        "inferx_chain_latency_seconds_bucket",
        chain=chain,
        version="4",
        tier="realtime",
        status="ok",
        le="2.0",
    ) == (before["le2"] + 1)
    assert (
        value(
            "inferx_chain_latency_seconds_bucket",
            chain=chain,
            version="4",
            tier="realtime",
            status="ok",
            le="1.0",
        )
        == (before["le1"])
    )
    assert (
        value("inferx_chain_slo_runs_total", chain=chain, tier="realtime", result="met") == before["met"] + 1
    )
    assert value("inferx_chain_slo_target_ratio", chain=chain) == 0.995
    assert value("inferx_chain_slo_latency_seconds", chain=chain) == 2.0
    assert value("inferx_model_prompt_tokens_total", **labels) == before["prompt"] + 100
    assert value("inferx_model_cached_prompt_tokens_total", **labels) == before["cached"] + 60
    assert value("inferx_model_completion_tokens_total", **labels) == before["out"] + 20
    assert value("inferx_node_latency_seconds_sum", chain=chain, node="think", status="ok") >= 0.7


def test_hop_queue_wait_tool_cache_retries_and_degradations() -> None:
    wait = value("inferx_hop_queue_wait_seconds_count", pool="p1", tier="batch")
    metrics.observe_hop("batch", SimpleNamespace(pool="p1", queue_ms=40.0))
    assert value("inferx_hop_queue_wait_seconds_count", pool="p1", tier="batch") == wait + 1
    for hit, unavailable, result in (
        (True, False, "hit"),
        (False, False, "miss"),
        (False, True, "unavailable"),
    ):
        before = value("inferx_tool_cache_lookups_total", tool="t1", result=result)
        metrics.observe_tool_cache("t1", hit=hit, unavailable=unavailable)
        assert value("inferx_tool_cache_lookups_total", tool="t1", result=result) == before + 1
    metrics.observe_retry("c1", "n1", "timeout")
    metrics.observe_degradation("c1", "n1", "fallback_model")
    assert value("inferx_retries_total", chain="c1", node="n1", reason="timeout") >= 1
    assert value("inferx_degradations_total", chain="c1", node="n1", kind="fallback_model") >= 1


def test_tier_names() -> None:
    assert [metrics.tier_name(t) for t in (1, 2, 3, 0, 42)] == [
        "realtime",
        "standard",
        "batch",
        "unspecified",
        "unknown",
    ]


def test_breaker_states_are_read_at_scrape_time() -> None:
    states = {"tool:search@a:1": BreakerState.CLOSED}
    registry = CollectorRegistry()
    metrics.watch_breakers(lambda: states, registry=registry)
    assert registry.get_sample_value("inferx_circuit_breaker_state", {"target": "tool:search@a:1"}) == 0
    states["tool:search@a:1"] = BreakerState.OPEN
    states["tool:mail@b:2"] = BreakerState.HALF_OPEN
    assert registry.get_sample_value("inferx_circuit_breaker_state", {"target": "tool:search@a:1"}) == 2
    assert registry.get_sample_value("inferx_circuit_breaker_state", {"target": "tool:mail@b:2"}) == 1


def test_memory_pool_usage_ratios_and_departed_workers() -> None:
    pool_metrics.publish(
        [
            WorkerLedger("w1", "kvpool", 1000, 900, 0, 3),
            WorkerLedger("w2", "kvpool", 1000, 100, 700, 1),
        ]
    )
    assert value("inferx_memory_kv_usage_ratio", pool="kvpool") == 0.5
    assert value("inferx_memory_worker_kv_usage_ratio", pool="kvpool", worker="w1") == 0.9
    assert value("inferx_memory_active_reservations", pool="kvpool") == 4
    pool_metrics.publish([WorkerLedger("w2", "kvpool", 1000, 0, 800, 0)])
    assert (
        REGISTRY.get_sample_value("inferx_memory_worker_kv_usage_ratio", {"pool": "kvpool", "worker": "w1"})
        is None
    )
    assert value("inferx_memory_kv_capacity_tokens", pool="kvpool") == 1000


def test_every_family_passes_promtool_and_no_label_is_a_run_id() -> None:
    # Make sure every labelled family has a child, so promtool sees its samples.
    metrics.observe_chain("lint", "standard", known_run())
    for hop in known_run().hops:
        metrics.observe_node("lint", hop.node_id, hop)
    # Only our own families: an engine running in this process (the vLLM e2e tests
    # start one) adds its `vllm:*` metrics to the same registry, named by its rules.
    ours = CollectorRegistry()
    ours.register(_OnlyInferx(REGISTRY))
    page = generate_latest(ours)
    checked = subprocess.run([promtool(), "check", "metrics"], input=page, capture_output=True, timeout=60)
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()
    assert b"inferx_chain_latency_seconds_bucket" in page
    forbidden = {"run_id", "run", "session", "session_id", "request_id", "hop_id"}
    for family in REGISTRY.collect():
        for sample in family.samples:
            assert not forbidden & set(sample.labels), (family.name, sample.labels)
    assert b"0123456789abcdef" not in page


class _OnlyInferx:
    """A collector that re-exports the `inferx_*` families of another registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self):
        return [family for family in self._registry.collect() if family.name.startswith("inferx_")]
