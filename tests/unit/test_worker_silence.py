"""A worker that stops answering (frozen, hung) has the hops running on it given up as
soon as its health checks say so (`WorkerHealth(on_silent=...)` ->
`StreamPool.abandon`): they fail UNAVAILABLE and the scheduler re-dispatches them, rather
than waiting for the connection's keepalive (30 s + 10 s) to notice."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from inferx.devstack import free_port
from inferx.discovery import ChannelPool
from inferx.pools import PoolDirectory
from inferx.tls import Transport
from inferx.v1 import common_pb2
from inferx_router.executors import scheduler_streams
from inferx_scheduler import health
from inferx_scheduler.health import WorkerHealth
from tests.unit.test_hopstream import Hops, serve, texts


async def test_abandoning_a_peer_fails_its_running_calls_at_once_and_the_next_call_opens_a_new_stream() -> (
    None
):
    channels = ChannelPool(Transport())
    servicer = Hops()
    server, port = await serve(servicer)
    address = f"127.0.0.1:{port}"
    streams = scheduler_streams(channels)
    try:
        stuck = asyncio.create_task(texts(streams, address, "wait", timeout=None))  # never answers
        while not servicer.started:
            await asyncio.sleep(0.01)
        streams.abandon(address, "worker w1 failed 5 health checks in a row")
        with pytest.raises(grpc.aio.AioRpcError) as given_up:
            await asyncio.wait_for(stuck, 5)
        assert given_up.value.code() == grpc.StatusCode.UNAVAILABLE  # what the scheduler re-dispatches
        assert "failed 5 health checks in a row" in (given_up.value.details() or "")
        assert await texts(streams, address, "echo:ok") == "ok"
        assert streams.client(address).opened == 2
        streams.abandon("127.0.0.1:1", "never called")  # a peer with no streams: nothing to do
    finally:
        await streams.close()
        await server.stop(0)
        await channels.close()


async def test_a_worker_silent_for_enough_checks_is_said_once(monkeypatch) -> None:
    monkeypatch.setattr(health, "HEALTH_FAILURES_TO_ABANDON", 3)
    directory = PoolDirectory()
    address = f"127.0.0.1:{free_port()}"  # nobody answers there
    directory.workers_by_pool = {
        "p": {"w1": common_pb2.WorkerInfo(worker_id="w1", pool="p", address=address)}
    }
    channels = ChannelPool(Transport())
    silent: list[tuple[str, str]] = []
    changes: list[None] = []
    watch = WorkerHealth(
        directory,
        channels,
        on_change=lambda: changes.append(None),
        on_silent=lambda where, reason: silent.append((where, reason)),
    )
    watch.start(interval_s=0.05)
    try:
        for _ in range(200):
            if watch._health_failures.get("w1", 0) >= 6:
                break
            await asyncio.sleep(0.02)
        assert watch._health_failures["w1"] >= 6
        assert silent == [(address, "worker w1 failed 3 health checks in a row")]  # once per silence
        assert changes and not watch.usable("w1")
    finally:
        await watch.close()
        await channels.close()


async def test_a_worker_that_leaves_the_directory_leaves_the_breaker_board() -> None:
    """Its breaker is not listed in `inferx status` for ever after (a worker from an
    earlier run, whose lease expired while its breaker was open, was)."""
    directory = PoolDirectory()
    gone = f"127.0.0.1:{free_port()}"  # nobody answers there
    directory.workers_by_pool = {
        "p": {"w-gone": common_pb2.WorkerInfo(worker_id="w-gone", pool="p", address=gone)}
    }
    channels = ChannelPool(Transport())
    watch = WorkerHealth(directory, channels, on_change=lambda: None)
    watch.start(interval_s=0.05)
    try:
        for _ in range(200):
            if watch.states().get("w-gone") == "open":
                break
            await asyncio.sleep(0.02)
        assert watch.states() == {"w-gone": "open"}
        directory.workers_by_pool = {"p": {}}  # its lease expired
        for _ in range(200):
            if not watch.states():
                break
            await asyncio.sleep(0.02)
        assert watch.states() == {} and watch._health_failures == {}
    finally:
        await watch.close()
        await channels.close()


async def test_a_worker_health_checks_took_out_is_closed_when_it_answers_again(monkeypatch) -> None:
    """Frozen, then resumed on an idle pool: no hop comes to probe it, so its answering
    health checks close the breaker (it read "open" for as long as the pool was idle, and
    the test harness's `wait_workers` waited on it in vain). One a failed hop opened waits
    for a hop to probe it."""
    from grpc_health.v1 import health as grpc_health
    from grpc_health.v1 import health_pb2_grpc

    monkeypatch.setattr(health, "OPEN_S", 0.2)
    port = free_port()
    directory = PoolDirectory()
    directory.workers_by_pool = {
        "p": {"w1": common_pb2.WorkerInfo(worker_id="w1", pool="p", address=f"127.0.0.1:{port}")}
    }
    channels = ChannelPool(Transport())
    watch = WorkerHealth(directory, channels, on_change=lambda: None)

    async def state_becomes(state: str) -> None:
        for _ in range(300):
            if watch.states().get("w1") == state:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"w1's breaker is {watch.states().get('w1')}, not {state}")

    watch.start(interval_s=0.05)
    server = grpc.aio.server()
    try:
        await state_becomes("open")  # nobody answers: taken out
        health_pb2_grpc.add_HealthServicer_to_server(grpc_health.aio.HealthServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await state_becomes("closed")
        watch.hop_failed("w1")
        await asyncio.sleep(0.5)  # past the open period, health checks answering all along
        assert watch.states() == {"w1": "open"} and watch.usable("w1")  # half-open on the next hop
    finally:
        await watch.close()
        await server.stop(None)
        await channels.close()
