"""The scheduler's KV-event subscriber against a real in-process worker gRPC server
(sim engine): it follows every registered worker, forgets a worker whose stream is
down, resyncs from the snapshot when the worker is back, and stops asking a worker
whose engine reports no events."""

from __future__ import annotations

import asyncio

import grpc

from inferx.discovery import ChannelPool
from inferx.pools import PoolDirectory
from inferx.scheduling.prefix_index import PrefixIndex
from inferx.server import ErrorMappingInterceptor
from inferx.tls import Transport
from inferx.v1 import common_pb2, worker_pb2_grpc
from inferx_scheduler import kv_events as subscriber_mod
from inferx_scheduler.kv_events import KvEventSubscriber
from inferx_worker.engines.base import EngineRequest
from inferx_worker.engines.sim_engine import SimEngine, SimParams
from inferx_worker.servicer import ModelWorkerServicer
from tests.polling import poll_until


async def _serve(engine, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])  # the services' status mapping
    worker_pb2_grpc.add_ModelWorkerServicer_to_server(ModelWorkerServicer(engine, "w0"), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def _directory(port: int) -> PoolDirectory:
    directory = PoolDirectory()
    info = common_pb2.WorkerInfo(worker_id="w0", pool="p", address=f"127.0.0.1:{port}")
    directory.workers_by_pool = {"p": {"w0": info}}
    return directory


async def test_follows_forgets_and_resyncs(monkeypatch) -> None:
    monkeypatch.setattr(subscriber_mod, "RETRY_S", 0.05)
    engine = SimEngine(SimParams(speed=1000.0))
    await engine.start()
    server, port = await _serve(engine)
    channels = ChannelPool(Transport.plaintext())
    index = PrefixIndex()
    subscriber = KvEventSubscriber(_directory(port), channels, index, reconcile_s=0.05)
    subscriber.start()
    try:
        await poll_until(lambda: index.knows("w0"), timeout_s=10, interval_s=0.02, what="the stream")
        chunks = [c async for c in engine.generate(EngineRequest("r1", "y" * 64 * 5, max_tokens=4))]
        context = chunks[-1].context_blocks
        await poll_until(
            lambda: index.match("w0", context) == 5 * 16, timeout_s=10, interval_s=0.02, what="the blocks"
        )
        await server.stop(0)  # the worker goes away: what it holds is unknown
        await poll_until(lambda: not index.knows("w0"), timeout_s=10, interval_s=0.02, what="forgotten")
        server, _ = await _serve(engine, port)  # back, cache intact: the snapshot resyncs
        await poll_until(
            lambda: index.match("w0", context) == 5 * 16, timeout_s=10, interval_s=0.02, what="resync"
        )
        assert subscriber.subscribed() == {"w0"}
    finally:
        await subscriber.close()
        await channels.close()
        await server.stop(0)
        await engine.stop()


class _NoEvents(SimEngine):
    def kv_events(self):
        return None


async def test_a_worker_without_kv_events_is_not_asked_again() -> None:
    engine = _NoEvents(SimParams(speed=1000.0))
    await engine.start()
    server, port = await _serve(engine)
    channels = ChannelPool(Transport.plaintext())
    index = PrefixIndex()
    subscriber = KvEventSubscriber(_directory(port), channels, index, reconcile_s=0.05)
    subscriber.start()
    try:
        await poll_until(lambda: not subscriber.subscribed(), timeout_s=10, interval_s=0.02, what="given up")
        await asyncio.sleep(0.2)  # reconciles meanwhile: still not asked
        assert not subscriber.subscribed() and not index.knows("w0")
    finally:
        await subscriber.close()
        await channels.close()
        await server.stop(0)
        await engine.stop()
