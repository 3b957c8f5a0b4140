"""Every chain of a trace replayed at once against a live front, within a time limit,
and a chain's calls issued as their dependencies allow: the loops the live replays
share (the scheduler's gRPC replay in `live` and the OpenAI HTTP replay in
`agent_http`); each brings how one call runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from inferx.sim.cluster import alone_latency_s
from inferx.sim.profile import EngineProfile
from inferx.sim.records import ChainRecord
from inferx.sim.trace import ChainProgress, Trace, TraceChain

# run_chain(chain, its record, the replay's start on the loop's clock)
ChainRunner = Callable[[TraceChain, ChainRecord, float], Awaitable[None]]
# call(k, when it is ready on the loop's clock) -> (None or why the chain failed, when it ended)
CallRunner = Callable[[int, float], Coroutine[Any, Any, tuple[str | None, float]]]


async def run_calls(
    progress: ChainProgress, arrival: float, speed: float, call: CallRunner
) -> tuple[str | None, float]:
    """A chain's calls, each a task: its roots at `arrival`, then each call that
    `progress` makes ready when one finishes (its dependencies done, their tool delays
    or think times passed, divided by `speed`), so a DAG's branches are in flight
    together. (None, when the last ended), or the first failure `call` returned (the
    calls still in flight are cancelled)."""
    loop = asyncio.get_running_loop()
    tasks: dict[asyncio.Task[tuple[str | None, float]], int] = {
        asyncio.create_task(call(k, arrival)): k for k in progress.chain.roots()
    }
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: tasks[t]):
                k = tasks.pop(task)
                failure, ended = task.result()
                if failure is not None:
                    return failure, ended
                for d, ready_at in progress.finish(k, ended, speed):
                    tasks[asyncio.create_task(call(d, ready_at))] = d
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return None, loop.time()


async def replay_chains(
    trace: Trace,
    profile: EngineProfile,
    speed: float,
    timeout_s: float,
    progress: Callable[[int], None],
    run_chain: ChainRunner,
) -> tuple[list[ChainRecord], int]:
    """Start every chain's `run_chain` at once (each waits for its own arrival); after
    `timeout_s` cancel what still runs. The records, and how many chains were still
    running then (finished as failed, at the trace time the replay stopped)."""
    records = [
        ChainRecord.start(c, alone_s=alone_latency_s(c, profile), profile=profile) for c in trace.chains
    ]
    done = 0
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(chain: TraceChain, record: ChainRecord) -> None:
        nonlocal done
        try:
            await run_chain(chain, record, start)
        finally:
            done += 1
            progress(done)

    tasks = [asyncio.create_task(one(c, r)) for c, r in zip(trace.chains, records, strict=True)]
    try:
        await asyncio.wait(tasks, timeout=timeout_s)
    finally:
        # Timed out, or interrupted (Ctrl-C): stop every chain still running before the
        # caller's channel or client closes under it, and collect their outcomes.
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    now_trace = (loop.time() - start) * speed
    unfinished = 0
    for record in records:
        if record.status == "running":
            record.finish("failed", now_trace)
            unfinished += 1
    return records, unfinished
