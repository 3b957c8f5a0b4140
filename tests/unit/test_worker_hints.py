"""A chain's worker survives a scheduler that never saw it (issue #15: a partition that
moved to another scheduler): the router remembers where each chain's latest hop in a
pool ran (`WorkerHints`) and sends it with the next hop (`HopContext.last_worker_id`);
the chain-aware policy starts from it when it has no record of the chain, and only
then, and only on a worker alive in the pool."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from inferx.scheduling.chain_aware import ChainAwareConfig, ChainAwarePolicy
from inferx.scheduling.queue import DispatchQueue
from inferx.scheduling.views import HopView, Tier, WorkerSlots
from inferx.v1 import scheduler_pb2
from inferx_router.executors import SchedulerExecutor, hop_request
from inferx_router.hops import ModelHop, NextHop, WorkerHints

WORKERS = {"p": [WorkerSlots("a", 4), WorkerSlots("b", 4), WorkerSlots("c", 4)]}


def chain_aware(**config) -> DispatchQueue:
    return DispatchQueue(policy=ChainAwarePolicy(ChainAwareConfig(**config)))


def submit(q: DispatchQueue, v: HopView, now: float):
    return q.submit(v.pool, v.run_id, v.hop_id, now, v)


def busy(q: DispatchQueue, worker: str, hops: int, now: float) -> None:
    """Load `worker` with other chains' running hops, so placement by load avoids it."""
    for i in range(hops):
        submit(q, HopView("p", f"other-{worker}-{i}", "0"), now)
    placed = q.assign({"p": [WorkerSlots(worker, 4)]}, now)
    assert [h.worker_id for h in placed] == [worker] * hops


def later_hop(hint: str = "", run: str = "c") -> HopView:
    """A chain's third hop, as a scheduler that never saw the first two receives it."""
    return HopView("p", run, "2", hop_index=2, prompt_tokens=6000, last_worker_id=hint)


def test_a_chain_the_policy_has_no_record_of_goes_to_the_hinted_worker() -> None:
    q = chain_aware()
    busy(q, "a", 2, now=0)  # by load the hop would go to "b" or "c"
    submit(q, later_hop("a"), now=1)
    (hop,) = q.assign(WORKERS, now=1)
    assert hop.worker_id == "a"


def test_without_the_hint_the_same_hop_is_placed_by_load() -> None:
    """What the hint changes (so the test above can fail): no hint, or hints off."""
    for hint, config in (("", {}), ("a", {"worker_hints": False})):
        q = chain_aware(**config)
        busy(q, "a", 2, now=0)
        submit(q, later_hop(hint), now=1)
        (hop,) = q.assign(WORKERS, now=1)
        assert hop.worker_id != "a", (hint, config)


@pytest.mark.parametrize("hint", ["gone", "w-of-another-pool"])
def test_a_hinted_worker_not_alive_in_the_pool_is_ignored(hint: str) -> None:
    q = chain_aware()
    busy(q, "a", 2, now=0)
    pools = {**WORKERS, "q": [WorkerSlots("w-of-another-pool", 4)]}
    submit(q, later_hop(hint), now=1)
    (hop,) = q.assign(pools, now=1)
    assert hop.worker_id in ("b", "c")
    # the chain's record is then where it really ran, not the hint
    state = q.policy.chain("c", "p")  # type: ignore[attr-defined]
    assert state is not None and state.worker_id == hop.worker_id


def test_the_policys_own_record_wins_over_the_hint() -> None:
    q = chain_aware()
    submit(q, HopView("p", "c", "0", prompt_tokens=5000), now=0)
    (first,) = q.assign({"p": [WorkerSlots("b", 4)]}, now=0)
    q.finished(first, 1, context_tokens=5100, service_s=1)
    busy(q, "c", 1, now=1)
    # A stale hint (the router missed a move) names "a", idle; the record says "b".
    submit(q, later_hop("a"), now=2)
    (hop,) = q.assign(WORKERS, now=2)
    assert hop.worker_id == "b"


def test_a_hinted_worker_that_is_busy_is_waited_for_as_a_recorded_one() -> None:
    """The hinted worker counts as the chain's home: a hop waits for it while moving
    would cost more (the prompt re-prefilled elsewhere), then falls back."""
    q = chain_aware(max_affinity_wait_s=5.0, prefill_tokens_per_s=3000.0)  # 6000 tokens: 2 s
    one_each = {"p": [WorkerSlots("a", 1), WorkerSlots("b", 1)]}
    blocker = submit(q, HopView("p", "x", "0"), now=0)
    assert q.assign({"p": [WorkerSlots("a", 1)]}, now=0) == [blocker]
    submit(q, later_hop("a"), now=1)
    assert q.assign(one_each, now=1.5) == []  # "a" busy, "b" idle: it waits for "a"
    (hop,) = q.assign(one_each, now=3.5)
    assert hop.worker_id == "b"


def test_worker_hints_are_per_chain_and_pool_bounded_and_expire() -> None:
    hints = WorkerHints(capacity=2, ttl_s=10.0)
    hints.put("run1", "p", "a", now=0)
    hints.put("run1", "q", "x", now=0)
    assert (hints.get("run1", "p", 1), hints.get("run1", "q", 1), hints.get("run2", "p", 1)) == ("a", "x", "")
    hints.put("run1", "p", "b", now=2)  # the chain moved: the latest hop's worker
    assert hints.get("run1", "p", 3) == "b"
    hints.put("run3", "p", "c", now=3)  # past capacity: least recently used goes
    assert len(hints) == 2 and hints.get("run1", "q", 3) == ""
    assert hints.get("run1", "p", 12.5) == ""  # older than ttl_s
    hints.put("", "p", "a", now=13)  # no chain key, nothing to key by
    assert len(hints) == 1


class FakeServices:
    async def wait_pick(self, kind: str, timeout_s: float) -> str:
        return "scheduler:1"


class FakeStreams:
    """A scheduler hop stream that records requests and finishes each on `worker`."""

    def __init__(self) -> None:
        self.requests: list[scheduler_pb2.HopRequest] = []
        self.worker = "w1"

    async def call(self, address, request, timeout):
        self.requests.append(request)
        yield scheduler_pb2.HopEvent(kind=scheduler_pb2.HopEvent.KIND_DISPATCHED, worker_id=self.worker)
        yield scheduler_pb2.HopEvent(
            kind=scheduler_pb2.HopEvent.KIND_FINISHED, worker_id=self.worker, pool="pool-x", text="ok"
        )


def model_hop(run: str, hop: str, model: str, session: str = "") -> ModelHop:
    return ModelHop(
        run_id=run,
        hop_id=hop,
        session_id=session,
        chain_name="c",
        chain_version=1,
        tier=Tier.STANDARD,
        priority=2,
        deadline_unix_ms=0,
        hop_index=0,
        remaining_hops=None,
        remaining_critical_path_ms=0.0,
        next_hops=(),
        model=model,
        prompt="hi",
        max_tokens=4,
        temperature=0.0,
    )


def test_the_router_sends_each_hop_the_worker_of_its_chains_latest_hop_in_the_pool() -> None:
    streams = FakeStreams()
    pools = {"small": "pool-x", "small-alias": "pool-x", "big": "pool-y"}
    executor = SchedulerExecutor(
        FakeServices(),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        streams=streams,  # type: ignore[arg-type]
        pool_of=lambda model: pools[model],
    )

    async def run(hop: ModelHop) -> str:
        return (await executor.run_hop(hop, 5.0, lambda _: None)).worker_id

    async def main() -> list[str]:
        await run(model_hop("r1", "h0", "small"))
        streams.worker = "w2"
        await run(model_hop("r1", "h1", "small-alias"))  # same pool, other model name
        await run(model_hop("r1", "h2", "big"))  # another pool: nothing known there
        await run(model_hop("r2", "h0", "small"))  # another run
        await run(model_hop("r3", "h0", "small", session="s"))
        await run(model_hop("r4", "h0", "small", session="s"))  # the session's next run
        return [r.context.last_worker_id for r in streams.requests]

    assert asyncio.run(main()) == ["", "w1", "", "", "", "w2"]


def test_hop_request_carries_the_hints_of_the_hop_and_its_next_hops() -> None:
    hop = replace(
        model_hop("r", "h", "m"), next_hops=(NextHop("n1", "big", 100, 8), NextHop("n2", "", 100, 8))
    )
    known = {"m": "w9", "big": "w3"}
    request = hop_request(hop, lambda model: known.get(model, ""))
    assert request.context.last_worker_id == "w9"
    assert [n.last_worker_id for n in request.context.next_hops] == ["w3", ""]
    assert hop_request(model_hop("r", "h", "m")).context.last_worker_id == ""


def test_a_look_ahead_for_a_chain_with_no_record_holds_room_on_the_hinted_worker() -> None:
    """After a failover the new owner's look-ahead (room for the chain's next hop in
    another pool) would otherwise make a record of its own -- which then wins over the
    hint the hop brings."""
    for hint, expected in (("a", "a"), ("gone", None)):
        q = chain_aware()
        busy(q, "a", 2, now=0)
        assert q.assign(WORKERS, now=0.5) == []  # the pool's workers, as the queue knows them
        coming = HopView("p", "c", "3", hop_index=3, prompt_tokens=6000, last_worker_id=hint)
        worker = q.plan_ahead(coming, until=10.0, now=1)
        assert (worker == "a") == (expected == "a"), (hint, worker)
        submit(q, later_hop(hint), now=2)
        (hop,) = q.assign(WORKERS, now=2)
        assert hop.worker_id == worker  # the hop finds its room held there
