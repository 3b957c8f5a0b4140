"""The tiered tool cache: single flight, invalidation, several cache replicas."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from inferx.client import InferxClient
from inferx.devstack import LocalStack, wait_serving
from inferx.v1 import tool_pb2, tool_pb2_grpc
from tests.integration.faults import ToolServer, describe, run_batch
from tests.polling import poll_until

pytestmark = pytest.mark.integration

CHAIN = """
agent_chain:
  name: lookup_chain
  slo: {end_to_end_latency_p99: 5s}
  inputs: [q]
  nodes:
    - {id: lookup, type: tool_call, tool: kb, timeout: 2s, cacheable: true, cache_ttl: 60s,
       arguments: {q: "{{ inputs.q }}"}}
"""


class CountingTool(tool_pb2_grpc.ToolServiceServicer):
    def __init__(self, delay_s: float = 0.3) -> None:
        self.delay_s = delay_s
        self.calls: list[str] = []

    async def Invoke(self, request, context):
        q = json.loads(request.arguments_json)["q"]
        self.calls.append(q)
        await asyncio.sleep(self.delay_s)
        return tool_pb2.ToolResponse(result_json=json.dumps({"answer": q.upper()}))


async def test_identical_concurrent_misses_call_the_tool_once(sim_stack: LocalStack) -> None:
    tool = CountingTool()
    async with ToolServer(sim_stack, "kb", tool):
        async with InferxClient(sim_stack.router_address) as client:
            await client.put_chain(CHAIN)
        outcomes = await run_batch(sim_stack, "lookup_chain", [{"q": "same question"}] * 20)
        assert all(o.ok for o in outcomes), describe(outcomes)
        assert tool.calls == ["same question"]
        assert sum(o.finished.hops[0].cache_hit for o in outcomes) == 19
        async with InferxClient(sim_stack.router_address) as client:
            stats = await client.tool_cache_stats()
        assert stats.single_flight_joins >= 19 - 0  # the others joined the one call


async def test_invalidation_drops_results_everywhere(sim_stack: LocalStack) -> None:
    tool = CountingTool(delay_s=0)
    async with ToolServer(sim_stack, "kb", tool):
        async with InferxClient(sim_stack.router_address) as client:
            await client.put_chain(CHAIN)
            await client.invalidate_tool_cache("kb")  # start clean: earlier tests cached "kb" results
            await run_batch(sim_stack, "lookup_chain", [{"q": "a"}, {"q": "b"}])
            again = await run_batch(sim_stack, "lookup_chain", [{"q": "a"}, {"q": "b"}])
            assert all(o.finished.hops[0].cache_hit for o in again)
            one = await client.invalidate_tool_cache("kb", json.dumps({"q": "a"}))
            assert one.removed == 1 and one.replicas == 1
            after = await run_batch(sim_stack, "lookup_chain", [{"q": "a"}, {"q": "b"}])
            assert [o.finished.hops[0].cache_hit for o in after] == [False, True]
            everything = await client.invalidate_tool_cache("kb")
            assert everything.removed == 2
            last = await run_batch(sim_stack, "lookup_chain", [{"q": "a"}, {"q": "b"}])
            assert not any(o.finished.hops[0].cache_hit for o in last)
    assert sorted(tool.calls) == ["a", "a", "a", "b", "b"]  # concurrent runs: any order


async def test_keys_shard_over_replicas_and_a_dead_replica_only_costs_hits(sim_stack: LocalStack) -> None:
    extra = sim_stack.start_service("cache", replica=1)
    wait_serving(extra, 30)
    tool = CountingTool(delay_s=0)
    try:
        async with ToolServer(sim_stack, "kb", tool):
            async with InferxClient(sim_stack.router_address) as client:
                await client.put_chain(CHAIN)

                async def both_replicas() -> bool:  # the router sees the new replica through etcd
                    return len((await client.tool_cache_stats()).replicas) == 2

                await poll_until(both_replicas, timeout_s=10, what="the router to see the second replica")
                inputs = [{"q": f"question {i}"} for i in range(40)]
                first = await run_batch(sim_stack, "lookup_chain", inputs)
                assert all(o.ok for o in first), describe(first)
                stats = await client.tool_cache_stats()
                per_replica = [r.stats.entries for r in stats.replicas]
                assert len(per_replica) == 2 and all(n >= 5 for n in per_replica), per_replica
                extra.signal(signal.SIGKILL)
                extra.wait(5)
                # A duration, not a synchronisation: past the router's L1 TTL, so only L2 could answer.
                await asyncio.sleep(6)
                second = await run_batch(sim_stack, "lookup_chain", inputs)
                assert all(o.ok for o in second), describe(second)
                hits = sum(o.finished.hops[0].cache_hit for o in second)
                assert 0 < hits < len(inputs)  # the surviving replica's share still hits
    finally:
        extra.stop()
        del sim_stack.services["cache-1"]
