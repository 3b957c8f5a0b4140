"""KV events on the live stack: sim workers publish their prefix-cache changes over
`ModelWorker.KvEvents`, the scheduler subscribes to every registered worker and its
index says which worker holds the blocks of a prompt it ran (real processes, gRPC)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from inferx.client import InferxClient
from inferx.devstack import LocalStack
from inferx.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.conftest import make_stack, started
from tests.polling import poll_until

pytestmark = pytest.mark.integration

CHAIN = """
agent_chain:
  name: kv_probe
  tier: standard
  slo: {end_to_end_latency_p99: 60s}
  nodes:
    - {id: answer, type: model_inference, model: solo, timeout: 60s, max_tokens: 8,
       prompt: "{{ inputs.q }}"}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # Exact prefix on: the scheduler keeps the chains' contexts only for a policy that reads them.
    def start(stack: LocalStack) -> None:
        stack.start_core()
        stack.load_models({"solo": "solo"})
        for _ in range(2):
            stack.start_worker("solo", "sim", ["--sim-speed", "20"])

    stack = make_stack(tmp_path_factory.mktemp("kvevents"), scheduler_flags=("--exact-prefix",))
    with started(stack, start, guard=True):
        yield stack


async def _workers(scheduler: scheduler_pb2_grpc.SchedulerStub) -> dict[str, scheduler_pb2.WorkerStatus]:
    status = await scheduler.GetSchedulerStatus(scheduler_pb2.SchedulerStatusRequest(), timeout=5)
    return {w.worker.worker_id: w for pool in status.pools for w in pool.workers}


async def test_worker_events_reach_the_schedulers_index(stack: LocalStack) -> None:
    async with grpc.aio.insecure_channel(stack.services["scheduler"].address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)

        async def all_live() -> bool:
            workers = await _workers(scheduler)
            return len(workers) == 2 and all(w.kv_events_live for w in workers.values())

        await poll_until(all_live, timeout_s=30, interval_s=0.2, what="both workers' KV-event streams live")
        assert all(w.kv_blocks_indexed == 0 for w in (await _workers(scheduler)).values())

        # 40 whole 16-token blocks of 4-character sim tokens, and a partial one.
        prompt = "".join(f"{i:04d}" for i in range(16 * 40 + 3))
        async with InferxClient(stack.router_address) as client:
            await client.put_chain(CHAIN)
            ran_on = ""
            async for event in client.run_chain("kv_probe", {"q": prompt}):
                kind = event.WhichOneof("event")
                if kind == "node_finished" and event.node_finished.worker_id:
                    ran_on = event.node_finished.worker_id
                if kind == "chain_finished":
                    assert event.chain_finished.status == "ok", event.chain_finished.error
        assert ran_on

        async def indexed() -> bool:
            return (await _workers(scheduler))[ran_on].kv_tokens_indexed >= 40 * 16

        await poll_until(indexed, timeout_s=15, interval_s=0.1, what="the prompt's blocks in the index")
        # The worker reported the hop's context keys: the chain's next prompt has them.
        status = await scheduler.GetSchedulerStatus(scheduler_pb2.SchedulerStatusRequest(), timeout=5)
        assert status.chain_contexts == 1
        workers = await _workers(scheduler)
        other = next(w for w in workers if w != ran_on)
        assert workers[other].kv_blocks_indexed == 0  # exact: the other worker holds none of it

        # What the scheduler's index holds is what the worker's own stream says it holds.
        address = workers[ran_on].worker.address
        async with grpc.aio.insecure_channel(address) as worker_channel:
            stream = worker_pb2_grpc.ModelWorkerStub(worker_channel).KvEvents(worker_pb2.KvEventsRequest())
            snapshot = await stream.read()
            stream.cancel()
        kinds = [e.kind for e in snapshot.events]
        assert kinds[0] == worker_pb2.KvEvent.KIND_CLEARED
        blocks = {b.key for e in snapshot.events[1:] for b in e.blocks}
        assert len(blocks) == workers[ran_on].kv_blocks_indexed
