"""The chain-aware scheduler on the live stack: a realtime chain overtakes batch chains
that were queued before it (one sim worker with one slot, so hops must queue)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from inferx.client import InferxClient
from inferx.devstack import LocalStack
from inferx.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.conftest import make_stack, started
from tests.polling import poll_until

pytestmark = pytest.mark.integration

CHAIN = """
agent_chain:
  name: {name}
  tier: {tier}
  slo: {{end_to_end_latency_p99: 60s}}
  nodes:
    - {{id: answer, type: model_inference, model: solo, timeout: 60s, max_tokens: {tokens},
       prompt: "{{{{ inputs.q }}}}"}}
"""


@pytest.fixture(scope="module")
def one_slot_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    def start(stack: LocalStack) -> None:
        stack.start_core()
        stack.load_models({"solo": "solo"})
        stack.start_worker("solo", "sim", ["--sim-speed", "5", "--max-num-seqs", "1"])

    with started(make_stack(tmp_path_factory.mktemp("sched")), start, guard=True) as stack:
        yield stack


async def _run(client: InferxClient, chain: str, q: str) -> float:
    async for event in client.run_chain(chain, {"q": q}):
        if event.WhichOneof("event") == "chain_finished":
            assert event.chain_finished.status == "ok", event.chain_finished.error
    return time.monotonic()


async def _solo_queue(scheduler: scheduler_pb2_grpc.SchedulerStub) -> tuple[int, int]:
    """(running, queued) hops of the 'solo' pool, as the scheduler reports them."""
    status = await scheduler.GetSchedulerStatus(scheduler_pb2.SchedulerStatusRequest(), timeout=5)
    pool = next((p for p in status.pools if p.pool == "solo"), None)
    return (pool.running, pool.queued) if pool is not None else (0, 0)


async def test_realtime_chain_overtakes_queued_batch_chains(one_slot_stack: LocalStack) -> None:
    async with grpc.aio.insecure_channel(one_slot_stack.services["scheduler"].address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        status = await scheduler.GetSchedulerStatus(scheduler_pb2.SchedulerStatusRequest())
        assert status.policy == "chain-aware"
        async with InferxClient(one_slot_stack.router_address) as client:
            await client.put_chain(CHAIN.format(name="batch_job", tier="batch", tokens=150))
            await client.put_chain(CHAIN.format(name="rt_job", tier="realtime", tokens=4))
            batch = [asyncio.create_task(_run(client, "batch_job", f"batch {i}")) for i in range(4)]

            # Only with the first batch hop on the only slot and the other three queued
            # does the realtime chain have anything to overtake: wait for exactly that.
            async def three_queued_behind_one() -> bool:
                return await _solo_queue(scheduler) == (1, 3)

            await poll_until(
                three_queued_behind_one, timeout_s=30, interval_s=0.02, what="1 batch hop running, 3 queued"
            )
            realtime_done = await _run(client, "rt_job", "urgent")
            batch_done = sorted(await asyncio.gather(*batch))
    # FCFS would finish the realtime chain last; chain-aware runs it right after the
    # batch hop that held the only slot when it arrived.
    assert realtime_done < batch_done[1], (realtime_done, batch_done)
