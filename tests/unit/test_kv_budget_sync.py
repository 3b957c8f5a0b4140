"""The scheduler's budget against a memory-pool served in-process (issue #14): a hop
within the budget reserves and releases with no call; one beyond it goes to Reserve and
Release as before; the sync declares, reports and applies grants, and is what tells
the scheduler the memory-pool cannot be reached."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import cast

import grpc
import pytest

from inferx.discovery import ChannelPool, ServiceLocator
from inferx.pools import PoolDirectory
from inferx.scheduling.queue import DispatchQueue, WorkerSlots
from inferx.scheduling.registry import make_policy
from inferx.scheduling.views import HopView, Tier
from inferx.tls import Transport
from inferx.v1 import memory_pool_pb2, memory_pool_pb2_grpc
from inferx_scheduler.budget import LOOKAHEAD
from inferx_scheduler.budget_sync import KvBudget
from inferx_scheduler.dispatcher import HopDispatcher
from inferx_scheduler.lookahead import AheadHold, LookAhead
from inferx_scheduler.servicer import Hold, SchedulerServicer
from tests.polling import poll_until


class Pool(memory_pool_pb2_grpc.MemoryPoolServicer):
    """Grants what is asked up to `room` per worker; records every call."""

    def __init__(self, room: int = 10_000) -> None:
        self.room = room
        self.syncs: list[memory_pool_pb2.SyncBudgetRequest] = []
        self.reserves: list[memory_pool_pb2.ReserveRequest] = []
        self.releases: list[str] = []

    async def SyncBudget(self, request, context):
        self.syncs.append(request)
        reply = memory_pool_pb2.SyncBudgetReply(ttl_s=request.ttl_s or 10, high_usage_ratio=0.85)
        for row in request.workers:
            reply.workers.add(worker_id=row.worker_id, granted_tokens=min(row.target_tokens, self.room))
        return reply

    async def Reserve(self, request, context):
        self.reserves.append(request)
        return memory_pool_pb2.Reservation(
            reservation_id=f"r{len(self.reserves)}", worker_id=request.worker_id
        )

    async def Release(self, request, context):
        self.releases.append(request.reservation_id)
        return memory_pool_pb2.ReleaseResponse(released=True)


class Old(memory_pool_pb2_grpc.MemoryPoolServicer):
    """A memory-pool from before budgets: SyncBudget is UNIMPLEMENTED."""


class Services:
    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)

    def instances(self, kind: str):
        return [SimpleNamespace(address=a) for a in self.addresses] if kind == "memory-pool" else []

    def pick(self, kind: str) -> str | None:
        return self.addresses[0] if kind == "memory-pool" and self.addresses else None

    def leader(self, kind: str) -> str | None:
        return None  # no election: any live memory-pool holds the budget


class Deadline:
    def time_remaining(self) -> float | None:
        return 30.0


async def serve(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    memory_pool_pb2_grpc.add_MemoryPoolServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def pool():
    servicer = Pool()
    server, address = await serve(servicer)
    channels = ChannelPool(Transport.plaintext())
    yield servicer, address, channels
    await channels.close()
    await server.stop(0)


def make_budget(address: str, channels: ChannelPool, reachable: list | None = None, **kwargs) -> KvBudget:
    return KvBudget(
        cast(ServiceLocator, Services(address)),
        channels,
        holder="sched-1",
        ttl_s=5.0,
        on_reachable=(lambda ok, why: reachable.append((ok, why)))
        if reachable is not None
        else (lambda *_: None),
        **kwargs,
    )


HOP = HopView("p", "run-1", "answer", tier=Tier.STANDARD, prompt_tokens=1000, max_tokens=24)  # 1024 KV


def servicer_with(address: str, channels: ChannelPool, budget: KvBudget | None) -> SchedulerServicer:
    return SchedulerServicer(
        HopDispatcher(PoolDirectory(), 16),
        cast(ServiceLocator, Services(address)),
        channels,
        reserve_kv=True,
        health=None,  # type: ignore[arg-type]  # not used by _reserve
        budget=budget,
    )


async def test_sync_declares_reports_and_applies_grants(pool) -> None:
    servicer, address, channels = pool
    reachable: list = []
    budget = make_budget(address, channels, reachable)
    assert budget.reserve("w1", 1024, kind="hop") is None  # no budget yet: a miss
    assert await budget.sync_once()
    (first,) = servicer.syncs
    assert (first.holder, first.seq, first.ttl_s) == ("sched-1", 1, 5.0)
    assert [(r.worker_id, r.target_tokens) for r in first.workers] == [("w1", 1024 + 2048)]
    assert budget.budget.granted("w1") == 3072 and reachable == [(True, "")]
    held = budget.reserve("w1", 1024, kind="hop")
    ahead = budget.reserve("w1", 100, kind=LOOKAHEAD, lease_s=30)
    assert held is not None and ahead is not None
    assert await budget.sync_once()
    second = servicer.syncs[1]
    assert second.seq == 2
    (row,) = second.workers  # what is reserved from it, reported
    assert (row.reserved_tokens, row.reservations, row.lookahead_tokens, row.lookahead_reservations) == (
        1124,
        2,
        100,
        1,
    )
    await budget.close()  # hands the budget back: an empty declaration
    assert servicer.syncs[-1].workers == [] and servicer.syncs[-1].seq == 3


async def test_an_unreachable_pool_makes_the_scheduler_conservative_and_the_budget_stays() -> None:
    channels = ChannelPool(Transport.plaintext())
    servicer = Pool()
    server, address = await serve(servicer)
    reachable: list = []
    try:
        budget = make_budget(address, channels, reachable)
        budget.reserve("w1", 10, kind="hop")
        assert await budget.sync_once()
        await server.stop(0)
        assert not await budget.sync_once()
        assert reachable[-1][0] is False and "UNAVAILABLE" in reachable[-1][1]
        assert budget.reserve("w1", 10, kind="hop") is not None  # the lease is still valid
        budget.budget.valid_until = 0.0  # ... until it is not
        assert budget.reserve("w1", 10, kind="hop") is None
        no_pool = KvBudget(
            cast(ServiceLocator, Services()),
            channels,
            holder="s",
            on_reachable=lambda ok, why: reachable.append((ok, why)),
        )
        assert not await no_pool.sync_once()
        assert reachable[-1] == (False, "no memory-pool is registered")
    finally:
        await channels.close()


async def test_an_older_memory_pool_without_budgets_gets_every_hop_as_before() -> None:
    server, address = await serve(Old())
    channels = ChannelPool(Transport.plaintext())
    try:
        budget = make_budget(address, channels)
        assert not await budget.sync_once()
        assert not budget.supported
        budget.start()
        await asyncio.sleep(0.05)  # the loop ends at once: nothing to sync with
        assert budget._task is not None and budget._task.done()
        await budget.close()
    finally:
        await channels.close()
        await server.stop(0)


async def test_the_budget_of_a_memory_pool_that_left_is_forgotten(pool) -> None:
    servicer, address, channels = pool
    budget = make_budget(address, channels)
    budget.reserve("w1", 10, kind="hop")
    assert await budget.sync_once() and budget.budget.granted("w1") > 0
    services = cast(Services, budget._services)
    services.addresses = []  # it left etcd
    assert not await budget.sync_once()
    assert budget.budget.granted("w1") == 0 and budget.reserve("w1", 10, kind="hop") is None


async def test_the_sync_loop_runs_when_the_budget_runs_low(pool) -> None:
    servicer, address, channels = pool
    budget = make_budget(address, channels, sync_s=30.0)  # the period alone would take 30 s
    budget.start()
    try:
        await poll_until(lambda: len(servicer.syncs) == 1, timeout_s=5, what="the first sync")
        assert budget.reserve("w1", 500, kind="hop") is None  # a miss wakes it at once
        await poll_until(lambda: budget.budget.granted("w1") > 0, timeout_s=5, what="the grant")
        assert budget.reserve("w1", 500, kind="hop") is not None
    finally:
        await budget.close()


async def test_a_hop_within_the_budget_costs_no_call(pool) -> None:
    servicer, address, channels = pool
    budget = make_budget(address, channels)
    scheduler = servicer_with(address, channels, budget)
    first = await scheduler._reserve("w1", HOP, Deadline())  # no budget yet: Reserve, as before
    assert first == Hold("r1", address=address) and len(servicer.reserves) == 1
    assert await budget.sync_once()
    hold = await scheduler._reserve("w1", HOP, Deadline())
    assert hold is not None and hold.local and len(servicer.reserves) == 1
    assert budget.budget.used("w1") == 1024
    scheduler._release_soon(hold)
    scheduler._release_soon(first)
    assert budget.budget.used("w1") == 0
    await scheduler.drain_releases()
    assert servicer.releases == ["r1"]  # only the one made at the memory-pool


async def test_a_hop_takes_over_its_local_lookahead_or_lets_the_remote_one_go(pool) -> None:
    servicer, address, channels = pool
    budget = make_budget(address, channels)
    scheduler = servicer_with(address, channels, budget)
    budget.reserve("w1", 3000, kind="hop")
    assert await budget.sync_once()
    ahead = budget.reserve("w1", 1024, kind=LOOKAHEAD, lease_s=30)
    assert ahead is not None
    filler = budget.reserve("w1", budget.budget.granted("w1") - 1024, kind="hop")
    assert filler is not None  # the budget is full but for the look-ahead's room
    hold = await scheduler._reserve(
        "w1", HOP, Deadline(), AheadHold("w1", ahead.reservation_id, 1e9, local=True)
    )
    assert hold is not None and hold.local and budget.budget.get(ahead.reservation_id) is None
    assert servicer.reserves == []
    scheduler._release_soon(hold)
    # A look-ahead made at the memory-pool (before the budget came): released there.
    hold = await scheduler._reserve("w1", HOP, Deadline(), AheadHold("w1", "r-ahead", 1e9))
    assert hold is not None and hold.local
    await scheduler.drain_releases()
    assert servicer.releases == ["r-ahead"]


async def test_a_hop_beyond_the_budget_replaces_its_local_lookahead_at_the_memory_pool(pool) -> None:
    servicer, address, channels = pool
    budget = make_budget(address, channels)
    scheduler = servicer_with(address, channels, budget)
    budget.reserve("w1", 10, kind="hop")
    assert await budget.sync_once()
    ahead = budget.reserve("w1", 10, kind=LOOKAHEAD, lease_s=30)
    assert ahead is not None
    hold = await scheduler._reserve(
        "w1", HOP, Deadline(), AheadHold("w1", ahead.reservation_id, 1e9, local=True)
    )
    assert hold == Hold("r1", address=address)  # 1024 tokens do not fit a budget sized for 10
    assert servicer.reserves[0].replaces == ""  # the pool never saw the local look-ahead ...
    assert budget.budget.get(ahead.reservation_id) is None  # ... which goes here


async def test_lookahead_reserves_from_the_budget_with_no_call(pool) -> None:
    servicer, address, channels = pool
    budget = make_budget(address, channels)
    queue = DispatchQueue(policy=make_policy("chain-aware"))
    queue.assign({"big": [WorkerSlots("w1", 4, kv_capacity_tokens=100_000)]}, now=0.0)
    la = LookAhead(
        queue,
        cast(ServiceLocator, Services(address)),
        channels,
        holder="sched-1",
        lease_s=5.0,
        growth=2.0,
        budget=budget,
    )
    current = HopView("small", "run-1", "a", tier=Tier.REALTIME, prompt_tokens=100)
    big = HopView("big", "run-1", "b", tier=Tier.REALTIME, prompt_tokens=900, max_tokens=100)
    la.start(current, [big], deadline_s=None)  # no budget yet: reserved at the memory-pool
    await asyncio.gather(*list(la._tasks))
    held = la.take(big)
    assert held is not None and not held.local and len(servicer.reserves) == 1
    assert servicer.reserves[0].kind == memory_pool_pb2.RESERVATION_KIND_LOOKAHEAD
    assert await budget.sync_once()
    again = HopView("big", "run-1", "c", tier=Tier.REALTIME, prompt_tokens=900, max_tokens=100)
    la.start(current, [again], deadline_s=None)
    await asyncio.gather(*list(la._tasks))
    held = la.take(again)
    assert held is not None and held.local and len(servicer.reserves) == 1
    local = budget.budget.get(held.reservation_id)
    assert local is not None and local.kind == LOOKAHEAD and local.tokens == 1000


def test_inferx_status_shows_the_leased_budget() -> None:
    from inferx.cli.main import _reserved_cell

    row = SimpleNamespace(reserved_tokens=1200, lookahead_tokens=200, leased_tokens=4096)
    assert _reserved_cell(row) == "1,200 (200 look-ahead), 4,096 budget leased"
    row = SimpleNamespace(reserved_tokens=0, lookahead_tokens=0, leased_tokens=0)
    assert _reserved_cell(row) == "0"
