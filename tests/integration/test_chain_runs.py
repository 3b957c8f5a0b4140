"""End-to-end behaviour of the running system on sim workers: the example chain,
tool caching, errors with the right status codes, configs, status, the CLI."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from inferx.client import InferxClient
from inferx.devstack import LocalStack
from inferx.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from inferx.v1 import router_pb2, router_pb2_grpc
from tests.polling import poll_until

pytestmark = pytest.mark.integration

QUERY = {"query": "Where is my order?"}


async def run_to_end(stack: LocalStack, chain: str, inputs: dict[str, str], **kw):
    events = []
    async with InferxClient(stack.router_address) as client:
        async for event in client.run_chain(chain, inputs, **kw):
            events.append(event)
    return events


async def test_example_chain_runs_every_node_in_dependency_order(sim_stack: LocalStack) -> None:
    events = await run_to_end(sim_stack, "customer_service_agent", QUERY)
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[-1] == "chain_finished"
    finished = events[-1].chain_finished
    assert finished.status == "ok", finished.error
    assert [h.node_id for h in finished.hops] == [
        "intent_recognition",
        "knowledge_retrieval",
        "response_generation",
    ]
    hops = {h.node_id: h for h in finished.hops}
    for node_id in ("intent_recognition", "response_generation"):
        hop = hops[node_id]
        assert hop.worker_id.startswith("worker-")
        assert hop.usage.prompt_tokens > 0 and hop.usage.completion_tokens > 0
        assert hop.output
    assert "order" in hops["knowledge_retrieval"].output.lower()
    # response_generation starts only after both of its dependencies finished.
    order = [(e.WhichOneof("event"), getattr(e, e.WhichOneof("event")).node_id) for e in events[:-1]]
    started_at = order.index(("node_started", "response_generation"))
    assert ("node_finished", "intent_recognition") in order[:started_at]
    assert ("node_finished", "knowledge_retrieval") in order[:started_at]
    assert finished.slo_ms == 5000
    assert finished.slo_met == (finished.latency_ms <= 5000)


async def test_final_only_run_sends_one_event_with_every_hop(sim_stack: LocalStack) -> None:
    events = await run_to_end(sim_stack, "customer_service_agent", QUERY, final_only=True)
    assert [e.WhichOneof("event") for e in events] == ["chain_finished"]
    finished = events[0].chain_finished
    assert finished.status == "ok", finished.error
    assert [h.node_id for h in finished.hops] == [
        "intent_recognition",
        "knowledge_retrieval",
        "response_generation",
    ]
    assert all(h.status == "ok" and h.output for h in finished.hops)
    async with InferxClient(sim_stack.router_address) as client:
        result = await client.chain_result("customer_service_agent", QUERY)
    assert result.status == "ok" and len(result.hops) == 3


def event_labels(events) -> list[tuple[str, str]]:
    kinds = [e.WhichOneof("event") for e in events]
    return [(kind, getattr(getattr(e, kind), "node_id", "")) for e, kind in zip(events, kinds, strict=True)]


async def test_batched_events_arrive_in_fewer_messages_and_the_client_unpacks_them(
    sim_stack: LocalStack,
) -> None:
    """RunChainRequest.batch_events over the wire: every event of the unbatched stream, in
    its order, in fewer messages; InferxClient.run_chain (batching by default) yields them
    one by one, each without `following`."""
    unbatched = await run_to_end(sim_stack, "customer_service_agent", QUERY, batch_events=False)
    assert not any(e.following for e in unbatched)
    async with grpc.aio.insecure_channel(sim_stack.router_address) as channel:
        request = router_pb2.RunChainRequest(chain="customer_service_agent", inputs=QUERY, batch_events=True)
        messages = [m async for m in router_pb2_grpc.RouterStub(channel).RunChain(request, timeout=60)]
    batched = [e for m in messages for e in (m, *m.following)]
    assert event_labels(batched) == event_labels(unbatched)
    assert len(messages) < len(batched)
    assert all(e.run_id == messages[0].run_id for e in batched)
    assert batched[-1].chain_finished.status == "ok", batched[-1].chain_finished.error
    unpacked = await run_to_end(sim_stack, "customer_service_agent", QUERY)
    assert event_labels(unpacked) == event_labels(unbatched)
    assert not any(e.following for e in unpacked)


async def test_cacheable_tool_result_is_served_from_cache_the_second_time(
    sim_stack: LocalStack,
) -> None:
    inputs = {"query": "How do I return an item for a refund?"}
    first = (await run_to_end(sim_stack, "customer_service_agent", inputs))[-1].chain_finished
    second = (await run_to_end(sim_stack, "customer_service_agent", inputs))[-1].chain_finished
    tool_first = next(h for h in first.hops if h.node_id == "knowledge_retrieval")
    tool_second = next(h for h in second.hops if h.node_id == "knowledge_retrieval")
    assert not tool_first.cache_hit
    assert tool_second.cache_hit
    assert tool_second.output == tool_first.output


async def test_unknown_chain_is_not_found(sim_stack: LocalStack) -> None:
    with pytest.raises(NotFound, match="no_such_chain"):
        await run_to_end(sim_stack, "no_such_chain", QUERY)


async def test_missing_and_unknown_inputs_are_invalid_argument(sim_stack: LocalStack) -> None:
    with pytest.raises(InvalidArgument, match="input 'query'"):
        await run_to_end(sim_stack, "customer_service_agent", {})
    with pytest.raises(InvalidArgument, match="input 'colour'"):
        await run_to_end(sim_stack, "customer_service_agent", {**QUERY, "colour": "red"})


GHOST_CHAIN = """
agent_chain:
  name: ghost_chain
  slo: {end_to_end_latency_p99: 2s}
  nodes:
    - {id: only, type: model_inference, model: ghost-model, timeout: 1s,
       prompt: "hi {{ inputs.q }}"}
"""


async def test_model_without_workers_is_unavailable_naming_the_model(sim_stack: LocalStack) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        await client.put_chain(GHOST_CHAIN)
    with pytest.raises(Unavailable, match="ghost-model"):
        await run_to_end(sim_stack, "ghost_chain", {"q": "x"})


async def test_concurrent_puts_get_distinct_versions_and_stale_expect_fails(
    sim_stack: LocalStack,
) -> None:
    text = GHOST_CHAIN.replace("ghost_chain", "race_chain")
    async with InferxClient(sim_stack.router_address) as client:
        replies = await asyncio.gather(*(client.put_chain(text, message=f"put {i}") for i in range(12)))
        versions = sorted(r.version for r in replies)
        assert versions == list(range(1, 13))
        with pytest.raises(FailedPrecondition, match="version 12"):
            await client.put_chain(text, expect_version=3)
        assert (await client.get_chain("race_chain")).version == 12
        reply = await client.put_chain(text, expect_version=12, activate=False)
        assert reply.version == 13 and not reply.active
        assert (await client.get_chain("race_chain")).version == 12
        assert (await client.get_chain("race_chain", version=13)).version == 13
        with pytest.raises(NotFound, match="no version 99"):
            await client.get_chain("race_chain", version=99)
        listed = {c.name: c for c in (await client.list_chains()).chains}
        assert listed["race_chain"].latest_version == 13
        assert listed["race_chain"].active_version == 12


async def test_invalid_config_is_rejected_with_the_node_named(sim_stack: LocalStack) -> None:
    bad = GHOST_CHAIN.replace("model: ghost-model, ", "")
    async with InferxClient(sim_stack.router_address) as client:
        with pytest.raises(InvalidArgument, match="only"):
            await client.put_chain(bad)


MEMORY_CHAIN = """
agent_chain:
  name: memory_chain
  slo: {end_to_end_latency_p99: 5s}
  inputs: [query]
  nodes:
    - {id: history, type: memory_retrieval, timeout: 1s, limit: 3}
    - id: answer
      type: model_inference
      model: qwen-7b
      timeout: 2s
      depends_on: [history]
      prompt: "History: {{ nodes.history.output }}\\nUser: {{ inputs.query }}\\nAgent:"
"""


async def test_memory_retrieval_returns_earlier_turns_of_the_session(sim_stack: LocalStack) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        await client.put_chain(MEMORY_CHAIN)
    first = await run_to_end(sim_stack, "memory_chain", {"query": "my parcel id is 4711"}, session_id="s-42")
    assert first[-1].chain_finished.status == "ok"
    assert next(h for h in first[-1].chain_finished.hops if h.node_id == "history").output == "[]"
    second = await run_to_end(sim_stack, "memory_chain", {"query": "and now?"}, session_id="s-42")
    history = next(h for h in second[-1].chain_finished.hops if h.node_id == "history").output
    assert "4711" in history
    other = await run_to_end(sim_stack, "memory_chain", {"query": "hi"}, session_id="s-other")
    assert next(h for h in other[-1].chain_finished.hops if h.node_id == "history").output == "[]"


async def test_status_lists_services_workers_queues_and_memory(sim_stack: LocalStack) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        status = await client.status()
    kinds = sorted({s.kind for s in status.services})
    assert kinds == ["cache", "memory-pool", "router", "scheduler", "worker"]
    assert len(status.workers) == 2
    assert {w.pool for w in status.workers} == {"tiny-llama"}
    assert all(w.kv_capacity_tokens > 0 for w in status.workers)
    assert {m.worker_id for m in status.memory} == {w.worker_id for w in status.workers}
    assert status.kv_headroom_ratio == pytest.approx(0.2)
    assert status.scheduler_policy
    assert {"vector_search", "session_memory"} <= set(status.tools)
    assert not status.problems


def test_every_service_serves_health_and_reflection(sim_stack: LocalStack) -> None:
    expected = {
        "router": "inferx.v1.Router",
        "scheduler": "inferx.v1.Scheduler",
        "memory-pool": "inferx.v1.MemoryPool",
        "cache": "inferx.v1.Cache",
    }
    targets = [(kind, proc.address, expected[kind]) for kind, proc in sim_stack.services.items()]
    targets.append(("worker", sim_stack.workers[0].address, "inferx.v1.ModelWorker"))
    for kind, address, service in targets:
        with grpc.insecure_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            names = {s.name for reply in replies for s in reply.list_services_response.service}
        assert service in names, (kind, names)
        assert "grpc.health.v1.Health" in names


def _cli(stack: LocalStack, *args: str) -> subprocess.CompletedProcess[str]:
    inferx = Path(sys.executable).with_name("inferx")
    env = {**os.environ, "INFERX_ROUTER": stack.router_address}
    return subprocess.run([str(inferx), *args], capture_output=True, text=True, env=env, timeout=60)


def test_cli_run_prints_every_node_and_the_slo_verdict(sim_stack: LocalStack) -> None:
    result = _cli(sim_stack, "run", "customer_service_agent", "--input", "query=Where is my order?")
    assert result.returncode == 0, result.stderr
    for node in ("intent_recognition", "knowledge_retrieval", "response_generation"):
        assert node in result.stdout
    assert "SLO 5,000 ms" in result.stdout
    assert "worker-" in result.stdout


def test_cli_errors_are_one_line_without_traceback(sim_stack: LocalStack) -> None:
    cases = [
        (("run", "nope"), "NOT_FOUND"),
        (("run", "customer_service_agent"), "INVALID_ARGUMENT"),
        (("run", "customer_service_agent", "--input", "novalue"), "KEY=VALUE"),
        (("chain", "put", "/does/not/exist.yaml"), "no such file"),
        (("chain", "get", "nope"), "NOT_FOUND"),
    ]
    for args, needle in cases:
        result = _cli(sim_stack, *args)
        assert result.returncode != 0, args
        assert needle in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr + result.stdout


def test_cli_reports_an_unreachable_router_clearly(tmp_path: Path) -> None:
    inferx = Path(sys.executable).with_name("inferx")
    result = subprocess.run(
        [str(inferx), "status", "--router", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr and "127.0.0.1:1" in result.stderr
    assert "Traceback" not in result.stderr


BUSY_CHAIN = """
agent_chain:
  name: busy_chain
  slo: {end_to_end_latency_p99: 30s}
  inputs: [q]
  nodes:
    - {id: long, type: model_inference, model: qwen-7b, timeout: 20s, max_tokens: 1500,
       prompt: "Write at length about {{ inputs.q }}"}
"""


async def test_memory_pool_reads_kv_usage_from_the_engines(sim_stack: LocalStack) -> None:
    """Usage is what the engines report for requests in flight (as vLLM does), read by
    the memory-pool every second while hops run."""
    async with InferxClient(sim_stack.router_address) as client:
        await client.put_chain(BUSY_CHAIN)
        runs = [asyncio.create_task(run_to_end(sim_stack, "busy_chain", {"q": str(i)})) for i in range(8)]

        async def usage_reported() -> float:
            status = await client.status()
            return max((row.engine_kv_usage_ratio for row in status.memory), default=0.0)

        seen = await poll_until(usage_reported, timeout_s=4, what="engine-reported KV usage")
        await asyncio.gather(*runs)
    assert 0 < seen < 1
