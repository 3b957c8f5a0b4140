"""A scheduler served in-process (the router's embedded one, `hopstream.LocalPeer`) in
front of one in-process worker: for tests of what the servicer does around a hop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from inferx import hopstream
from inferx.discovery import ChannelPool
from inferx.pools import PoolDirectory
from inferx.tls import Transport
from inferx.v1 import common_pb2, worker_pb2
from inferx_scheduler.dispatcher import HopDispatcher
from inferx_scheduler.servicer import SchedulerServicer

Generate = Callable[[worker_pb2.GenerateRequest, Any], AsyncIterator[worker_pb2.GenerateChunk]]


class Health:
    """Worker health that never opens a breaker."""

    def hop_succeeded(self, worker_id: str) -> None:
        pass

    def hop_failed(self, worker_id: str) -> None:
        pass


def local_scheduler(
    worker: common_pb2.WorkerInfo, generate: Generate, **policy_options: object
) -> tuple[hopstream.LocalPeer, HopDispatcher]:
    """The scheduler (no memory-pool: reserve_kv off) with `worker` as its pool's only
    worker, served by `generate`; a peer to call it through, and its dispatcher."""
    directory = PoolDirectory()
    directory.workers_by_pool = {worker.pool: {worker.worker_id: worker}}
    dispatcher = HopDispatcher(directory, 16, policy_options=policy_options)
    servicer = SchedulerServicer(
        dispatcher,
        None,  # type: ignore[arg-type]  # no memory-pool: reserve_kv is off
        ChannelPool(Transport.plaintext()),
        reserve_kv=False,
        health=Health(),  # type: ignore[arg-type]
    )
    servicer.worker_streams.serve_locally(worker.address, generate)
    return hopstream.LocalPeer(servicer.SubmitHop, hopstream.HOPS), dispatcher
