"""A finished hop's context blocks (GenerateChunk.context_blocks: a key per KV block of
the whole context) are worked out and sent only for a scheduler whose policy places by
exact prefix: for any other the worker skips the hash chain and ~16 KB per 8K-token
reply, and the scheduler the decoding (GenerateRequest.skip_context_blocks)."""

from __future__ import annotations

import grpc
import pytest

from inferx.server import ErrorMappingInterceptor
from inferx.v1 import worker_pb2, worker_pb2_grpc
from inferx_worker.engines.sim_engine import SimEngine, SimParams
from inferx_worker.servicer import ModelWorkerServicer
from tests.unit.test_hop_end_bookkeeping import hop, scheduler


@pytest.mark.parametrize("exact_prefix", [False, True])
async def test_the_scheduler_asks_for_the_blocks_only_when_its_policy_reads_them(exact_prefix: bool) -> None:
    peer, dispatcher, engine = scheduler(exact_prefix=exact_prefix)
    assert dispatcher.reads_prompt_blocks == exact_prefix
    [event async for event in peer.call(hop("h1"), timeout=5.0)]
    assert engine.skipped_blocks == [not exact_prefix]


@pytest.mark.parametrize("skip", [False, True])
async def test_the_worker_sends_the_blocks_unless_told_to_skip_them(skip: bool) -> None:
    engine = SimEngine(SimParams(speed=1000.0))
    await engine.start()
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])
    worker_pb2_grpc.add_ModelWorkerServicer_to_server(ModelWorkerServicer(engine, "w0"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        request = worker_pb2.GenerateRequest(prompt="y" * 64 * 5, skip_context_blocks=skip)
        request.sampling.max_tokens = 4
        chunks = [chunk async for chunk in worker_pb2_grpc.ModelWorkerStub(channel).Generate(request)]
        blocks = chunks[-1].context_blocks
        assert chunks[-1].finished
        assert (len(blocks) == 0) == skip  # 5 prompt blocks of 16 tokens otherwise
        if not skip:
            assert len(blocks) >= 5 and all(block.tokens == 16 for block in blocks)
    finally:
        await channel.close()
        await server.stop(0)
        await engine.stop()
