"""Degradation paths end to end: fallback model on a timeout, a non-critical node
skipped after its retries, the last cached result when a tool fails, degradation
under load before the SLO is missed, and backpressure at the router."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from inferx.client import InferxClient
from inferx.devstack import LocalStack, wait_serving
from inferx.errors import ResourceExhausted
from inferx.v1 import tool_pb2, tool_pb2_grpc
from tests.conftest import wait_workers_routed
from tests.integration.faults import ToolServer, describe, run_batch
from tests.polling import poll_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def slow_pool(sim_stack: LocalStack) -> LocalStack:
    """A pool 'slow-pool' whose only worker takes 0.5 s per token, one request at a time."""
    worker = sim_stack.start_worker(
        "slow-pool", "sim", ["--sim-decode-step-ms", "500", "--max-num-seqs", "1", "--no-warm-up"]
    )
    wait_workers_routed(sim_stack, workers=[worker])
    return sim_stack


class SwitchableTool(tool_pb2_grpc.ToolServiceServicer):
    def __init__(self) -> None:
        self.failing = False
        self.calls = 0

    async def Invoke(self, request, context):
        self.calls += 1
        if self.failing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "backend down")
        return tool_pb2.ToolResponse(result_json=json.dumps({"fresh": json.loads(request.arguments_json)}))


LADDER = """
agent_chain:
  name: ladder_chain
  slo: {end_to_end_latency_p99: 5s}
  inputs: [q]
  nodes:
    - {id: primary, type: model_inference, model: slow-pool, fallback_model: qwen-7b, timeout: 400ms,
       max_tokens: 4, prompt: "Answer {{ inputs.q }}"}
    - {id: extras, type: tool_call, tool: switchable, critical: false, timeout: 1s,
       arguments: {q: "{{ inputs.q }}"}}
    - {id: lookup, type: tool_call, tool: switchable, cacheable: true, cache_ttl: 1s, timeout: 1s,
       arguments: {topic: "{{ inputs.q }}"}}
    - {id: final, type: model_inference, model: qwen-7b, timeout: 2s, max_tokens: 4,
       depends_on: [primary, extras, lookup],
       prompt: "{{ nodes.primary.output }} {{ nodes.extras.output }} {{ nodes.lookup.output }}"}
"""


async def test_degradation_ladder(slow_pool: LocalStack) -> None:
    tool = SwitchableTool()
    async with ToolServer(slow_pool, "switchable", tool):
        async with InferxClient(slow_pool.router_address) as client:
            await client.put_chain(LADDER)
        (warm,) = await run_batch(slow_pool, "ladder_chain", [{"q": "refunds"}])
        hops = {h.node_id: h for h in warm.finished.hops}
        assert warm.ok, describe([warm])
        # The slow pool cannot answer within 400 ms: the smaller model does.
        assert hops["primary"].degradation == "fallback_model"
        assert hops["primary"].degradation_reason == "timeout"
        assert hops["primary"].model == "qwen-7b" and hops["primary"].output
        assert hops["lookup"].degradation == "" and not hops["lookup"].cache_hit

        tool.failing = True
        # A duration, not a synchronisation: the 1 s cache_ttl must pass (the stale copy stays).
        await asyncio.sleep(1.5)
        (degraded,) = await run_batch(slow_pool, "ladder_chain", [{"q": "refunds"}])
    assert degraded.ok, describe([degraded])
    hops = {h.node_id: h for h in degraded.finished.hops}
    assert hops["extras"].status == "skipped" and hops["extras"].degradation == "skipped"
    assert hops["extras"].retries >= 1  # retried, then skipped because it is not critical
    assert hops["lookup"].degradation == "stale_cache"
    assert json.loads(hops["lookup"].output) == {"fresh": {"topic": "refunds"}}
    assert hops["final"].status == "ok"
    # Both failing nodes retried from one budget (3 per run), which ran out.
    assert degraded.finished.retries_used == 3
    assert hops["extras"].retries + hops["lookup"].retries == 3


OVERLOAD = """
agent_chain:
  name: overload_chain
  slo: {end_to_end_latency_p99: 10s}
  inputs: [q]
  nodes:
    - {id: answer, type: model_inference, model: slow-pool, fallback_model: qwen-7b, timeout: 8s,
       max_tokens: 2, prompt: "Answer {{ inputs.q }}"}
    - {id: garnish, type: model_inference, model: slow-pool, critical: false, timeout: 8s,
       max_tokens: 2, prompt: "Decorate {{ inputs.q }}"}
"""

LOAD_POLL_S = 0.5  # inferx_router.load.LoadMonitor's default interval
HOG_S = 4 * 0.5  # a hog: 4 tokens at 500 ms a token on slow-pool

HOG = """
agent_chain:
  name: hog_chain
  slo: {end_to_end_latency_p99: 20s}
  inputs: [q]
  nodes:
    - {id: hog, type: model_inference, model: slow-pool, timeout: 15s, max_tokens: 4,
       prompt: "Hog {{ inputs.q }}"}
"""


async def test_load_above_the_threshold_degrades_before_the_slo_is_missed(slow_pool: LocalStack) -> None:
    async with InferxClient(slow_pool.router_address) as client:
        await client.put_chain(OVERLOAD)
        await client.put_chain(HOG)
    hogs = asyncio.create_task(run_batch(slow_pool, "hog_chain", [{"q": str(i)} for i in range(4)]))

    async def hogs_in() -> bool:  # 1 running + 3 queued on the pool's one slot
        async with InferxClient(slow_pool.router_address) as client:
            queues = {q.pool: (q.running, q.queued) for q in (await client.status()).queues}
        running, queued = queues.get("slow-pool", (0, 0))
        return running == 1 and queued >= 3

    await poll_until(hogs_in, timeout_s=30, interval_s=0.05, what="the hogs to fill slow-pool")
    # The router's load monitor polls the scheduler every LOAD_POLL_S and its view is
    # not observable from outside: give it a few of its polls. The pool stays this
    # full for seconds more (every hog takes 4 tokens x 0.5 s), so this is not a race.
    await asyncio.sleep(3 * LOAD_POLL_S)
    (run,) = await run_batch(slow_pool, "overload_chain", [{"q": "now"}])
    await hogs
    assert run.ok, describe([run])
    hops = {h.node_id: h for h in run.finished.hops}
    assert (hops["answer"].degradation, hops["answer"].degradation_reason) == ("fallback_model", "overload")
    assert hops["answer"].model == "qwen-7b"
    assert (hops["garnish"].status, hops["garnish"].degradation_reason) == ("skipped", "overload")
    # It did not wait behind the hogs: even one hog takes HOG_S on the slow pool.
    assert run.finished.latency_ms < HOG_S * 1000


async def test_router_refuses_runs_beyond_its_limit_with_a_retry_hint(slow_pool: LocalStack) -> None:
    router = slow_pool.start_service("router", ["--max-active-runs", "2"], replica=1)
    wait_serving(router, 30)
    try:
        async with InferxClient(slow_pool.router_address) as client:
            await client.put_chain(HOG)

        async def one(i: int):
            async with InferxClient(router.address) as client:
                try:
                    return [e async for e in client.run_chain("hog_chain", {"q": f"b{i}"})][-1]
                except ResourceExhausted as exc:
                    return exc

        results = await asyncio.gather(*(one(i) for i in range(5)))
    finally:
        router.stop()
        del slow_pool.services["router-1"]
    refused = [r for r in results if isinstance(r, ResourceExhausted)]
    assert len(refused) == 3
    assert all(r.retry_after_s and r.retry_after_s > 0 for r in refused)
    assert all("limit" in r.message for r in refused)
