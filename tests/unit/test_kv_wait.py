"""A hop the memory-pool has no KV room for waits for room within its deadline (as an
engine would queue it) instead of failing after a fixed short time."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from inferx.discovery import ChannelPool
from inferx.errors import ResourceExhausted
from inferx.pools import PoolDirectory
from inferx.scheduling.views import HopView, Tier
from inferx.tls import Transport
from inferx.v1 import memory_pool_pb2, memory_pool_pb2_grpc
from inferx_scheduler.dispatcher import HopDispatcher
from inferx_scheduler.servicer import Hold, SchedulerServicer
from tests.polling import poll_until


class FullUntil(memory_pool_pb2_grpc.MemoryPoolServicer):
    """Refuses the first `refusals` reservations (no room), then grants."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.requests: list[memory_pool_pb2.ReserveRequest] = []

    async def Reserve(self, request, context):
        self.requests.append(request)
        if len(self.requests) <= self.refusals:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "worker w1: no KV room")
        return memory_pool_pb2.Reservation(reservation_id=f"r{len(self.requests)}")


class OneAddress:
    def __init__(self, address: str) -> None:
        self.address = address

    def pick(self, kind: str) -> str | None:
        return self.address if kind == "memory-pool" else None


class Deadline:
    def __init__(self, remaining_s: float | None) -> None:
        self.remaining_s = remaining_s

    def time_remaining(self) -> float | None:
        return self.remaining_s


@pytest.fixture
async def memory_pool():
    servicers: list[FullUntil] = []

    async def start(refusals: int) -> tuple[FullUntil, str]:
        servicer = FullUntil(refusals)
        server = grpc.aio.server()
        memory_pool_pb2_grpc.add_MemoryPoolServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servicers.append(servicer)
        started.append(server)
        return servicer, f"127.0.0.1:{port}"

    started: list[grpc.aio.Server] = []
    yield start
    for server in started:
        await server.stop(0)


def scheduler(address: str, channels: ChannelPool, max_kv_wait_s: float) -> SchedulerServicer:
    dispatcher = HopDispatcher(PoolDirectory(), 16)
    return SchedulerServicer(
        dispatcher,
        OneAddress(address),  # type: ignore[arg-type]
        channels,
        reserve_kv=True,
        health=None,  # type: ignore[arg-type]  # not used by _reserve
        max_kv_wait_s=max_kv_wait_s,
    )


HOP = HopView("p", "run1", "answer", tier=Tier.BATCH, prompt_tokens=1000, max_tokens=24)


async def test_a_refused_hop_waits_for_room_beyond_the_old_two_seconds(memory_pool) -> None:
    # 7 refusals with backoff 0.05, 0.1, 0.2, 0.4, 0.5, 0.5, 0.5 s = 2.25 s of waiting:
    # more than the fixed 2 s after which hops used to fail.
    pool, address = await memory_pool(refusals=7)
    channels = ChannelPool(Transport.plaintext())
    try:
        reservation = await scheduler(address, channels, 60.0)._reserve("w1", HOP, Deadline(30.0))
    finally:
        await channels.close()
    assert reservation == Hold("r8", address=address)  # made at the memory-pool: released there
    assert len(pool.requests) == 8
    assert {r.tokens for r in pool.requests} == {HOP.kv_tokens} == {1024}
    assert pool.requests[0].tier == Tier.BATCH and pool.requests[0].hop_id == "answer"


async def test_the_wait_ends_at_the_hops_deadline(memory_pool) -> None:
    pool, address = await memory_pool(refusals=1000)
    channels = ChannelPool(Transport.plaintext())
    try:
        with pytest.raises(ResourceExhausted, match="KV memory"):
            await scheduler(address, channels, 60.0)._reserve("w1", HOP, Deadline(0.5))
    finally:
        await channels.close()
    # Backoff 0.05 + 0.1 + 0.2 fits in 0.5 - 0.1 s; the next 0.4 does not.
    assert len(pool.requests) == 4


async def test_without_a_deadline_the_wait_is_bounded_by_max_kv_wait(memory_pool) -> None:
    pool, address = await memory_pool(refusals=1000)
    channels = ChannelPool(Transport.plaintext())
    try:
        with pytest.raises(ResourceExhausted):
            await scheduler(address, channels, 0.2)._reserve("w1", HOP, Deadline(None))
    finally:
        await channels.close()
    assert len(pool.requests) == 3  # 0.05 + 0.1 fit in 0.2 s; 0.2 more does not


class SlowRelease(memory_pool_pb2_grpc.MemoryPoolServicer):
    """Answers Release only when the test lets it."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.answer = asyncio.Event()

    async def Release(self, request, context):
        self.received.append(request.reservation_id)
        await self.answer.wait()
        return memory_pool_pb2.ReleaseResponse(released=True)


async def test_a_release_is_sent_without_holding_up_the_hop_and_drained_at_shutdown() -> None:
    """The hop's stream must not wait for the memory-pool's answer to Release (one round
    trip per hop, issue #14), yet the release is sent, and shutdown waits for it."""
    pool = SlowRelease()
    server = grpc.aio.server()
    memory_pool_pb2_grpc.add_MemoryPoolServicer_to_server(pool, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channels = ChannelPool(Transport.plaintext())
    try:
        servicer = scheduler(f"127.0.0.1:{port}", channels, max_kv_wait_s=1.0)
        servicer._release_soon(Hold("r1"))  # returns at once, while the pool holds its answer
        servicer._release_soon(None)  # no reservation (KV reservation off): nothing to send
        drained = asyncio.create_task(servicer.drain_releases())
        await poll_until(lambda: pool.received == ["r1"], timeout_s=5, what="the Release to arrive")
        await asyncio.sleep(0.05)
        assert not drained.done()  # shutdown waits for the answer ...
        pool.answer.set()
        await asyncio.wait_for(drained, 5)  # ... and then finishes
        assert servicer._releases == set()
    finally:
        await channels.close()
        await server.stop(0)
