"""The scheduler's queue-depth gauges (`HopDispatcher`): set once per event-loop turn
for the pools whose queue changed in it, not on every submit, dispatch and finish, and
always what the queue holds once the turn is over."""

from __future__ import annotations

import asyncio

from inferx.metric_children import child
from inferx.pools import PoolDirectory
from inferx.scheduling.views import HopView, Tier
from inferx.v1 import common_pb2
from inferx_scheduler import metrics
from inferx_scheduler.dispatcher import HopDispatcher


def depth(pool: str) -> float:
    return child(metrics.QUEUE_DEPTH, pool)._value.get()


def by_tier(pool: str, tier: str) -> float:
    return child(metrics.QUEUED_BY_TIER, pool, tier)._value.get()


async def test_queue_gauges_follow_the_queue_once_per_loop_turn(monkeypatch) -> None:
    directory = PoolDirectory()
    directory.workers_by_pool = {"gauges": {"w1": common_pb2.WorkerInfo(worker_id="w1", max_concurrency=1)}}
    dispatcher = HopDispatcher(directory, 16)
    published: list[set[str]] = []
    flush = dispatcher.publish_depth_now

    def counted() -> None:
        published.append(set(dispatcher._depth_changed))
        flush()

    monkeypatch.setattr(dispatcher, "publish_depth_now", counted)
    hops = [
        dispatcher.submit(HopView("gauges", f"run{i}", "h", tier=Tier.BATCH if i else Tier.REALTIME))
        for i in range(4)
    ]
    await asyncio.sleep(0)
    assert published == [{"gauges"}]  # four submits, one publication
    assert depth("gauges") == 3  # one runs on the single slot, three wait
    assert by_tier("gauges", "batch") == 3 and by_tier("gauges", "realtime") == 0
    first, future = hops[0]
    assert future.done()
    dispatcher.finished(first)
    await asyncio.sleep(0)
    assert depth("gauges") == 2 and by_tier("gauges", "batch") == 2
    for hop, _ in hops[1:]:
        dispatcher.cancel(hop)
    await asyncio.sleep(0)
    assert depth("gauges") == 0 and len(published) == 3
