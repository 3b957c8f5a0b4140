"""LookAhead: which next hops get KV reserved ahead, how holds are taken, and how a
reservation goes through (or is refused by) the memory-pool."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest

from inferx.discovery import ChannelPool, ServiceLocator
from inferx.scheduling.chain_aware import ChainAwarePolicy
from inferx.scheduling.queue import DispatchQueue, WorkerSlots
from inferx.scheduling.registry import make_policy
from inferx.scheduling.views import HopView, Tier
from inferx.v1 import memory_pool_pb2
from inferx.wire import tier_to_proto
from inferx_scheduler import lookahead
from inferx_scheduler.lookahead import AheadHold, LookAhead

NOW = 100.0
CURRENT = HopView("pool-small", "run-1", "a", session_id="", tier=Tier.REALTIME, prompt_tokens=100)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    """The look-ahead module's monotonic clock, set by the test."""
    fake = Clock(NOW)
    monkeypatch.setattr(lookahead, "time", SimpleNamespace(monotonic=fake.monotonic))
    return fake


class FakeServices:
    def __init__(self, address: str | None) -> None:
        self.address = address
        self.asked: list[str] = []

    def pick(self, kind: str) -> str | None:
        self.asked.append(kind)
        return self.address


class FakeChannels:
    """Channels whose unary calls go to `reply(method, request)`: a reply or an exception."""

    def __init__(self, reply) -> None:
        self.reply = reply
        self.addresses: list[str] = []
        self.calls: list[tuple[str, Any, float | None]] = []

    def get(self, address: str):
        self.addresses.append(address)
        return self

    def unary_unary(self, method: str, *args, **kwargs):
        async def call(request, timeout=None, **_):
            self.calls.append((method, request, timeout))
            result = self.reply(method, request)
            if isinstance(result, BaseException):
                raise result
            return result

        return call


def granted(method, request) -> memory_pool_pb2.Reservation:
    return memory_pool_pb2.Reservation(reservation_id=f"res-{request.hop_id}", worker_id=request.worker_id)


def refused(method, request) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(), details="worker full"
    )


def chain_aware_queue() -> DispatchQueue:
    """A chain-aware queue that knows one worker in pool-big (10k KV tokens)."""
    queue = DispatchQueue(policy=make_policy("chain-aware"))
    queue.assign({"pool-big": [WorkerSlots("w1", 4, kv_capacity_tokens=10_000)]}, now=0.0)
    return queue


def policy_of(queue: DispatchQueue) -> ChainAwarePolicy:
    assert isinstance(queue.policy, ChainAwarePolicy)
    return queue.policy


def make(queue=None, services=None, channels=None, *, growth: float = 2.0) -> LookAhead:
    return LookAhead(
        queue or DispatchQueue(),
        cast(ServiceLocator, services or FakeServices("mp:1")),
        cast(ChannelPool, channels or FakeChannels(granted)),
        holder="sched-1",
        lease_s=5.0,
        growth=growth,
    )


def nxt(hop_id: str, pool: str, prompt_tokens: int, max_tokens: int = 64) -> HopView:
    return HopView(
        pool, "run-1", hop_id, tier=Tier.REALTIME, prompt_tokens=prompt_tokens, max_tokens=max_tokens
    )


async def settle(la: LookAhead) -> None:
    """Wait for the background reservations that start() launched."""
    await asyncio.gather(*list(la._tasks))


def test_wanted_other_pool_or_grown_context() -> None:
    """Another pool always counts; the same pool only from growth x the current prompt."""
    la = make(growth=2.0)
    other = nxt("b", "pool-big", 10)
    same_small = nxt("c", "pool-small", 199)
    same_grown = nxt("d", "pool-small", 200)
    assert la.wanted(CURRENT, [other, same_small, same_grown]) == [other, same_grown]
    assert la.wanted(CURRENT, []) == []


def test_wanted_counts_an_empty_prompt_as_one_token() -> None:
    """A current hop of 0 tokens is treated as 1, so growth is measured from 1."""
    la = make(growth=3.0)
    empty = HopView("pool-small", "run-1", "a", prompt_tokens=0)
    assert la.wanted(empty, [nxt("b", "pool-small", 2), nxt("c", "pool-small", 3)]) == [
        nxt("c", "pool-small", 3)
    ]


def test_wanted_skips_hops_already_held() -> None:
    """A next hop with a hold already is not reserved again."""
    la = make()
    la._held[("run-1", "b")] = AheadHold("w1", "res-b", NOW + 5)
    assert la.wanted(CURRENT, [nxt("b", "pool-big", 10), nxt("c", "pool-big", 10)]) == [
        nxt("c", "pool-big", 10)
    ]


async def test_wanted_skips_hops_being_reserved(clock) -> None:
    """While start()'s reservation is pending, the same next hop is not wanted again."""
    la = make(chain_aware_queue())
    la.start(CURRENT, [nxt("b", "pool-big", 10)], deadline_s=None)
    assert la.wanted(CURRENT, [nxt("b", "pool-big", 10)]) == []
    await settle(la)
    assert la._pending == set()


def test_take_returns_a_hold_once(clock) -> None:
    """take() hands out the hold kept for the hop, then it is gone."""
    la = make()
    hold = AheadHold("w1", "res-b", NOW + 1)
    la._held[("run-1", "b")] = hold
    assert la.take(nxt("b", "pool-big", 10)) is hold
    assert la.take(nxt("b", "pool-big", 10)) is None


def test_take_drops_expired_holds(clock) -> None:
    """Expired holds (expires_at <= now) are never handed out, and are dropped on any take()."""
    la = make()
    la._held[("run-1", "b")] = AheadHold("w1", "res-b", NOW)
    la._held[("run-1", "c")] = AheadHold("w1", "res-c", NOW - 1)
    la._held[("run-1", "d")] = AheadHold("w1", "res-d", NOW + 0.5)
    assert la.take(nxt("b", "pool-big", 10)) is None
    assert list(la._held) == [("run-1", "d")]
    clock.now = NOW + 0.5
    assert la.take(nxt("d", "pool-big", 10)) is None


async def test_start_reserves_through_plan_ahead_and_records_the_hold(clock) -> None:
    """start() plans the worker with the policy, reserves it as LOOKAHEAD and keeps the hold."""
    queue, services, channels = chain_aware_queue(), FakeServices("mp:1"), FakeChannels(granted)
    la = make(queue, services, channels)
    view = nxt("b", "pool-big", 900, max_tokens=100)
    la.start(CURRENT, [view, nxt("c", "pool-small", 50)], deadline_s=None)  # c: same pool, no growth
    await settle(la)
    assert (services.asked, channels.addresses) == (["memory-pool"], ["mp:1"])
    ((method, request, timeout),) = channels.calls
    assert (method, timeout) == ("/inferx.v1.MemoryPool/Reserve", 2.0)
    assert request == memory_pool_pb2.ReserveRequest(
        worker_id="w1",
        tokens=1000,
        run_id="run-1",
        hop_id="b",
        tier=tier_to_proto(Tier.REALTIME),
        holder="sched-1",
        lease_s=5.0,
        kind=memory_pool_pb2.RESERVATION_KIND_LOOKAHEAD,
    )
    assert policy_of(queue).resident("w1") == 1000
    assert la.take(view) == AheadHold("w1", "res-b", NOW + 5.0)


async def test_lease_is_bounded_by_the_chain_deadline(clock) -> None:
    """The lease is min(lease_s, time to the deadline), never under 0.1 s."""
    channels = FakeChannels(granted)
    la = make(chain_aware_queue(), channels=channels)
    la.start(CURRENT, [nxt("b", "pool-big", 10)], deadline_s=1.5)
    await settle(la)
    la.start(CURRENT, [nxt("c", "pool-big", 10)], deadline_s=0.0)
    await settle(la)
    assert [request.lease_s for _, request, _ in channels.calls] == [1.5, pytest.approx(0.1)]
    held = la.take(nxt("b", "pool-big", 10))
    assert held is not None and held.expires_at == NOW + 1.5


async def test_refused_reserve_drops_the_policy_hold_and_records_nothing(clock) -> None:
    """A Reserve refused by the memory-pool lets the policy's room go; no hold is kept."""
    queue, channels = chain_aware_queue(), FakeChannels(refused)
    la = make(queue, channels=channels)
    view = nxt("b", "pool-big", 900, max_tokens=100)
    la.start(CURRENT, [view], deadline_s=None)
    await settle(la)
    assert len(channels.calls) == 1
    assert policy_of(queue).resident("w1") == 0
    assert la._held == {}
    assert la.take(view) is None
    assert la.wanted(CURRENT, [view]) == [view]  # not pending any more: may be tried again


async def test_no_room_or_no_memory_pool_reserves_nothing(clock) -> None:
    """Without a worker with room, or without a memory-pool, nothing is reserved or held."""
    channels = FakeChannels(granted)
    no_workers = make(DispatchQueue(policy=make_policy("chain-aware")), channels=channels)
    no_workers.start(CURRENT, [nxt("b", "pool-big", 10)], deadline_s=None)
    await settle(no_workers)
    no_pool = make(chain_aware_queue(), FakeServices(None), channels)
    no_pool.start(CURRENT, [nxt("b", "pool-big", 10)], deadline_s=None)
    await settle(no_pool)
    assert channels.calls == []
    assert (no_workers._held, no_pool._held, no_pool._pending) == ({}, {}, set())


async def test_same_pool_grown_context_is_reserved_after_dispatch(clock) -> None:
    """As the scheduler calls it (after dispatching the hop), a grown same-pool next hop is reserved."""
    queue = DispatchQueue(policy=make_policy("chain-aware"))
    queue.submit("pool-small", "run-1", "a", NOW, view=CURRENT)
    workers = {"pool-small": [WorkerSlots("w1", 4, kv_capacity_tokens=10_000)]}
    assert [hop.worker_id for hop in queue.assign(workers, now=NOW)] == ["w1"]
    channels = FakeChannels(granted)
    la = make(queue, channels=channels)
    grown = nxt("d", "pool-small", 400)
    assert la.wanted(CURRENT, [grown]) == [grown]
    la.start(CURRENT, [grown], deadline_s=None)
    await settle(la)
    assert [request.hop_id for _, request, _ in channels.calls] == ["d"]
    assert la.take(grown) == AheadHold("w1", "res-d", NOW + 5.0)


async def test_a_lookahead_made_after_its_hop_arrived_is_released_at_once(clock) -> None:
    """The hop came while its look-ahead was still being reserved: it reserves for
    itself, so the look-ahead is released as soon as it is made, not held for its lease."""

    def reply(method, request):
        if method.endswith("/Release"):
            return memory_pool_pb2.ReleaseResponse(released=True)
        return granted(method, request)

    queue, channels = chain_aware_queue(), FakeChannels(reply)
    la = make(queue, channels=channels)
    view = nxt("b", "pool-big", 900, max_tokens=100)
    la.start(CURRENT, [view], deadline_s=None)
    assert la.take(view) is None  # the reservation has not been made yet
    await settle(la)
    assert [method for method, _, _ in channels.calls] == [
        "/inferx.v1.MemoryPool/Reserve",
        "/inferx.v1.MemoryPool/Release",
    ]
    assert channels.calls[1][1].reservation_id == "res-b"
    assert la._held == {} and la._arrived == set() and policy_of(queue).resident("w1") == 0
