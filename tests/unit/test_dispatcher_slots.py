"""The worker slots the scheduler's dispatcher hands its queue on every submit and
finish: made once and handed over as the same tuple while nothing changed, and made
again when a worker's circuit opens or closes, the registrations change, or the
dispatcher turns conservative -- hops never go to a worker that left or failed."""

from __future__ import annotations

import asyncio

from inferx.pools import PoolDirectory
from inferx.scheduling.views import HopView
from inferx.v1 import common_pb2
from inferx_scheduler.dispatcher import HopDispatcher


def worker(worker_id: str, concurrency: int = 2) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(worker_id=worker_id, pool="p", max_concurrency=concurrency)


async def test_slots_are_reused_until_workers_circuits_or_mode_change() -> None:
    directory = PoolDirectory()
    directory.workers_by_pool = {"p": {"w1": worker("w1"), "w2": worker("w2")}}
    broken: set[str] = set()
    dispatcher = HopDispatcher(directory, 16, usable=lambda worker_id: worker_id not in broken)
    workers = directory.workers_by_pool["p"]
    first = dispatcher._slots("p", workers)
    assert [(s.worker_id, s.max_concurrency) for s in first] == [("w1", 2), ("w2", 2)]
    assert dispatcher._slots("p", workers) is first  # nothing changed: the same tuple

    broken.add("w2")  # its circuit opened
    assert [s.worker_id for s in dispatcher._slots("p", workers)] == ["w1"]
    broken.clear()
    assert [s.worker_id for s in dispatcher._slots("p", workers)] == ["w1", "w2"]

    dispatcher.conservative = True  # no memory-pool: half the concurrency
    assert [s.max_concurrency for s in dispatcher._slots("p", workers)] == [1, 1]
    dispatcher.conservative = False

    directory.workers_by_pool = {"p": {"w1": worker("w1", 8)}}  # re-registered: a new dict
    assert [
        (s.worker_id, s.max_concurrency) for s in dispatcher._slots("p", directory.workers_by_pool["p"])
    ] == [("w1", 8)]


async def test_a_hop_never_goes_to_a_worker_whose_circuit_opened_after_a_dispatch() -> None:
    directory = PoolDirectory()
    directory.workers_by_pool = {"p": {"w1": worker("w1", 1), "w2": worker("w2", 1)}}
    broken: set[str] = set()
    dispatcher = HopDispatcher(directory, 16, policy="least-loaded", usable=lambda w: w not in broken)
    first, assigned = dispatcher.submit(HopView("p", "run1", "h"))
    ran_on = await asyncio.wait_for(assigned, 1)
    broken.add({"w1": "w2", "w2": "w1"}[ran_on])  # the other worker fails
    _, second = dispatcher.submit(HopView("p", "run2", "h"))
    await asyncio.sleep(0)
    assert not second.done()  # the only usable worker is busy: it waits
    dispatcher.finished(first)
    assert await asyncio.wait_for(second, 1) == ran_on
