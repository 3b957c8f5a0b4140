"""Look-ahead KV reservations on the live stack (issue #7): while a chain's small-model
hop runs, room is reserved for its next hop on the big model's pool; the hop then runs
where the room was kept and replaces the reservation. A look-ahead whose hop never
comes expires with its lease; a dead scheduler's reservations go with its etcd lease."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from inferx.client import InferxClient
from inferx.devstack import LocalStack, wait_serving
from inferx.v1 import common_pb2, memory_pool_pb2, memory_pool_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.conftest import make_stack, started, wait_workers_routed
from tests.integration.test_observability import metrics_addresses, scrape, total
from tests.polling import poll_until

pytestmark = pytest.mark.integration

CHAIN = """
agent_chain:
  name: plan_then_answer
  tier: standard
  slo: {end_to_end_latency_p99: 60s}
  nodes:
    - {id: plan, type: model_inference, model: small, timeout: 30s, max_tokens: 48,
       prompt: "Plan the answer to: {{ inputs.q }}"}
    - {id: lookup, type: tool_call, tool: vector_search, timeout: 5s, depends_on: [plan],
       arguments: {query: "{{ inputs.q }}"}}
    - {id: answer, type: model_inference, model: big, timeout: 30s, max_tokens: 16,
       depends_on: [lookup], prompt: "{{ nodes.plan.output }} {{ nodes.lookup.output }} Answer:"}
"""
LEASE_S = 4.0


@pytest.fixture(scope="module")
def two_pool_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("lookahead")

    def start(stack: LocalStack) -> None:
        stack.start_etcd()
        stack.start_service("scheduler", ["--lookahead-lease-s", str(LEASE_S)])
        stack.start_core()
        stack.load_models({"small": "small", "big": "big"})
        stack.start_worker("small", "sim", ["--sim-speed", "2"])
        for _ in range(2):
            stack.start_worker("big", "sim", ["--sim-speed", "5"])
        chain = tmp / "plan_then_answer.yaml"
        chain.write_text(CHAIN)
        stack.put_chains([chain])

    # Guarded: the test that kills the scheduler starts another before it ends.
    with started(make_stack(tmp), start, guard=True) as stack:
        yield stack


async def _usage(stack: LocalStack) -> memory_pool_pb2.PoolUsage:
    async with grpc.aio.insecure_channel(stack.services["memory-pool"].address) as channel:
        return await memory_pool_pb2_grpc.MemoryPoolStub(channel).GetUsage(memory_pool_pb2.GetUsageRequest())


def _lookahead_tokens(usage: memory_pool_pb2.PoolUsage) -> int:
    return sum(w.lookahead_tokens for w in usage.workers)


async def test_next_big_model_hop_runs_where_room_was_reserved(two_pool_stack: LocalStack) -> None:
    runs = 4
    async with InferxClient(two_pool_stack.router_address) as client:
        for i in range(runs):
            async for event in client.run_chain("plan_then_answer", {"q": f"question {i}"}):
                if event.WhichOneof("event") == "chain_finished":
                    assert event.chain_finished.status == "ok", event.chain_finished.error
    (address,) = (await metrics_addresses(two_pool_stack))["scheduler"]
    scheduler = scrape(address)
    reserved = total(scheduler, "inferx_scheduler_lookahead_total", pool="big", outcome="reserved")
    used = total(scheduler, "inferx_scheduler_lookahead_total", pool="big", outcome="used")
    assert reserved == runs, scheduler
    assert used == runs  # every answer hop ran on the worker its room was kept on
    # The hops' own reservations replaced the look-ahead ones, then were released: a
    # release is sent as the hop ends, not awaited before its stream closes, so poll.

    async def all_released() -> bool:
        usage = await _usage(two_pool_stack)
        return _lookahead_tokens(usage) == 0 and sum(w.reserved_tokens for w in usage.workers) == 0

    await poll_until(all_released, timeout_s=5, what="every reservation to be released")


async def _submit_with_successor(stack: LocalStack, run_id: str) -> None:
    """One small-model hop announcing a big-model successor that never comes."""
    request = scheduler_pb2.HopRequest(
        context=common_pb2.HopContext(
            run_id=run_id,
            hop_id="plan",
            next_hops=[common_pb2.NextHop(hop_id="answer", model="big", prompt_tokens=300, max_tokens=16)],
        ),
        model="small",
        prompt="Plan something.",
        sampling=common_pb2.SamplingOptions(max_tokens=8),
    )
    async with grpc.aio.insecure_channel(stack.services["scheduler"].address) as channel:
        async for _ in scheduler_pb2_grpc.SchedulerStub(channel).SubmitHop(request, timeout=30):
            pass


async def test_unused_lookahead_expires_with_its_lease(two_pool_stack: LocalStack) -> None:
    submitted_at = time.monotonic()  # the look-ahead's lease cannot start before this
    await _submit_with_successor(two_pool_stack, "orphan-1")

    async def held() -> bool:
        return _lookahead_tokens(await _usage(two_pool_stack)) > 0

    await poll_until(held, timeout_s=5, what="the look-ahead reservation")
    held_at = time.monotonic()  # ... nor after this
    async with InferxClient(two_pool_stack.router_address) as client:  # what `inferx status` shows
        status = await client.status()
    assert sum(row.lookahead_tokens for row in status.memory) > 0

    async def gone() -> bool:
        return _lookahead_tokens(await _usage(two_pool_stack)) == 0

    await poll_until(gone, timeout_s=LEASE_S + 5, what="the look-ahead to expire")
    gone_at = time.monotonic()
    # It lasted its whole lease: not dropped when its hop ended (lower bound; the pool
    # and this test read the same monotonic clock) ...
    assert gone_at - submitted_at >= LEASE_S
    # ... and ended with it, not later: slack for the pool's lazy expiry, the 0.1 s
    # polling and a loaded machine.
    assert gone_at - held_at <= LEASE_S + 3


async def test_dead_schedulers_lookaheads_are_dropped_with_its_lease(two_pool_stack: LocalStack) -> None:
    # A scheduler with a long look-ahead lease: only its death can end this one early.
    stack = two_pool_stack
    stack.services["scheduler"].stop()
    stack.start_service("scheduler", ["--lookahead-lease-s", "120"])
    wait_serving(stack.services["scheduler"], 60)
    wait_workers_routed(stack)  # the new scheduler owns the pools and sees their workers
    await _submit_with_successor(stack, "orphan-2")

    async def held() -> bool:
        return _lookahead_tokens(await _usage(stack)) > 0

    await poll_until(held, timeout_s=5, what="the look-ahead reservation")
    stack.services["scheduler"].signal(9)  # no goodbye: only its etcd lease ends

    async def gone() -> bool:
        return _lookahead_tokens(await _usage(stack)) == 0

    await poll_until(gone, timeout_s=stack.lease_ttl_s + 10, what="the dead holder's reservations to go")
    stack.services["scheduler"].stop()
    stack.start_service("scheduler", ["--lookahead-lease-s", str(LEASE_S)])
    wait_serving(stack.services["scheduler"], 60)
    wait_workers_routed(stack)
