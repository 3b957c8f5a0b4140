"""A worker's KV offload tier reaches the scheduler's side of the world: a sim worker
whose profile has a host tier registers it in etcd (what the scheduler's directory
reads, shown by `status`) and reports it in GetLoad, over real gRPC and etcd."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from inferx.client import InferxClient
from inferx.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import running_sim_stack

pytestmark = pytest.mark.integration

PROFILE = Path(__file__).resolve().parents[2] / "benchmarks" / "llama3-8b-a100-offload.yaml"


async def check(router_address: str) -> None:
    async with InferxClient(router_address) as client:
        status = await client.status()
    (worker,) = status.workers
    assert worker.host_kv_capacity_tokens == 1_048_576  # 128 GiB / 128 KiB per token
    assert worker.host_kv_load_tokens_per_s == pytest.approx(25e9 / 131_072)
    async with grpc.aio.insecure_channel(worker.address) as channel:
        load = await worker_pb2_grpc.ModelWorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest())
    assert load.host_kv_capacity_tokens == 1_048_576
    assert load.kv_capacity_tokens == worker.kv_capacity_tokens > 0


def test_a_worker_registers_and_reports_its_offload_tier(tmp_path: Path) -> None:
    # running_sim_stack starts its own event loop: the test is sync around it.
    with running_sim_stack(tmp_path, workers=1, worker_args=["--sim-profile", str(PROFILE)]) as stack:
        asyncio.run(check(stack.router_address))
