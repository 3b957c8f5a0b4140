"""The scheduler hands a hop's reply to its caller before it books the hop's end (the
worker's slot freed, the KV hold priced, the next queued hop dispatched), and books it
before anything submitted after that reply is decided (issue #16: the booking was
~90 us of every program call's wall time on a 2-core box).

The scheduler here is the router's embedded one (`hopstream.LocalPeer`), whose caller
and handler share one event loop: the case where the order shows."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from inferx import hopstream
from inferx.v1 import common_pb2, scheduler_pb2, worker_pb2
from inferx_scheduler.dispatcher import HopDispatcher
from tests.local_scheduler import local_scheduler

Event = scheduler_pb2.HopEvent
WORKER = common_pb2.WorkerInfo(
    worker_id="w1", pool="m", address="w1:1", max_concurrency=1, kv_capacity_tokens=100_000
)


class Engine:
    """The worker, served in-process: each request waits for `gate`, then answers."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.requests: list[str] = []
        self.skipped_blocks: list[bool] = []  # each request's skip_context_blocks

    async def generate(self, request: worker_pb2.GenerateRequest, context):
        self.requests.append(request.context.hop_id)
        self.skipped_blocks.append(request.skip_context_blocks)
        await self.gate.wait()
        yield worker_pb2.GenerateChunk(
            text="ok",
            finished=True,
            finish_reason="stop",
            usage=common_pb2.TokenUsage(prompt_tokens=3, completion_tokens=1),
            worker_id="w1",
        )


def scheduler(**policy_options: object) -> tuple[hopstream.LocalPeer, HopDispatcher, Engine]:
    engine = Engine()
    peer, dispatcher = local_scheduler(WORKER, engine.generate, **policy_options)
    return peer, dispatcher, engine


def hop(hop_id: str, kv_retention_s: float | None = None) -> scheduler_pb2.HopRequest:
    context = common_pb2.HopContext(run_id="r", hop_id=hop_id)
    if kv_retention_s is not None:
        context.kv_retention_s = kv_retention_s
    return scheduler_pb2.HopRequest(model="m", prompt="hello", context=context)


def running_on_w1(dispatcher: HopDispatcher) -> int:
    view = dispatcher.queue.pool_workers("m").get("w1")
    assert view is not None
    return view.in_flight


async def events(peer: hopstream.LocalPeer, hop_id: str) -> list[Event]:
    return [event async for event in peer.call(hop(hop_id), timeout=5.0)]


async def test_the_reply_reaches_the_caller_before_the_hop_is_booked_as_ended() -> None:
    peer, dispatcher, _ = scheduler()
    seen_running: list[int] = []
    async for event in peer.call(hop("h1"), timeout=5.0):
        if event.kind == Event.KIND_FINISHED:
            seen_running.append(running_on_w1(dispatcher))
    # The caller had the reply while the policy still counted the hop on its worker
    # (the old order booked it first: 0 here, the booking on the reply's path).
    assert seen_running == [1]
    await asyncio.sleep(0)  # the loop's next turn: booked
    assert running_on_w1(dispatcher) == 0


async def test_a_hop_submitted_after_the_reply_finds_the_slot_free() -> None:
    # One slot on the only worker: a hop decided before the first one's end was booked
    # would wait (and here, with nothing else to free the slot, time out).
    peer, dispatcher, engine = scheduler()
    first = await events(peer, "h1")
    second = await asyncio.wait_for(events(peer, "h2"), timeout=2.0)
    for run in (first, second):
        assert [e.kind for e in run] == [Event.KIND_DISPATCHED, Event.KIND_FINISHED]
    assert engine.requests == ["h1", "h2"]
    await asyncio.sleep(0)
    assert running_on_w1(dispatcher) == 0


async def test_a_queued_hop_is_dispatched_once_the_running_one_is_booked_as_ended() -> None:
    peer, dispatcher, engine = scheduler()
    engine.gate.clear()
    first = asyncio.create_task(events(peer, "h1"))
    second = asyncio.create_task(events(peer, "h2"))
    while engine.requests != ["h1"]:
        await asyncio.sleep(0.001)
    assert dispatcher.queue.queued("m") == 1  # h2 waits for h1's slot
    engine.gate.set()
    done = await asyncio.wait_for(asyncio.gather(first, second), timeout=2.0)
    assert [e.kind for e in done[1]] == [Event.KIND_DISPATCHED, Event.KIND_FINISHED]
    assert engine.requests == ["h1", "h2"]


def hints(outcome: str) -> float:
    labels = {"pool": "m", "outcome": outcome}
    return REGISTRY.get_sample_value("inferx_scheduler_kv_retention_hints_total", labels) or 0.0


async def test_a_retention_hint_is_counted_as_the_policy_took_it_at_the_hops_end() -> None:
    # What the policy made of the hint is known only once it booked the hop's end: counted
    # then, not as "not_applied" before it.
    peer, _, _ = scheduler()
    before = hints("released"), hints("not_applied")
    [event async for event in peer.call(hop("h1", kv_retention_s=0), timeout=5.0)]
    await asyncio.sleep(0)
    assert (hints("released"), hints("not_applied")) == (before[0] + 1, before[1])
