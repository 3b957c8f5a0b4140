"""`openai_http.unless_client_leaves`: a non-streamed call whose HTTP client disconnects
is cancelled (its engine work aborted) instead of run to the end for nobody."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from inferx.openai_http import unless_client_leaves


def request_whose_client(leaves_after_s: float | None) -> Request:
    async def receive() -> dict:
        if leaves_after_s is None:
            await asyncio.Event().wait()  # stays
        await asyncio.sleep(leaves_after_s or 0)
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


async def test_a_client_that_leaves_cancels_the_call() -> None:
    cancelled = asyncio.Event()

    async def long_call() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "done"

    result = await asyncio.wait_for(unless_client_leaves(request_whose_client(0.05), long_call()), 5)
    assert result is None and cancelled.is_set()
    await asyncio.sleep(0)  # the handler's task goes on normally: not left cancelled
    assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]


async def test_a_client_that_stays_gets_the_result_and_the_watch_ends() -> None:
    async def call() -> str:
        await asyncio.sleep(0.01)
        return "done"

    before = len(asyncio.all_tasks())
    assert await unless_client_leaves(request_whose_client(None), call()) == "done"
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == before  # the watcher is gone


async def test_a_client_leaving_once_the_result_is_in_cancels_nothing() -> None:
    async def quick() -> str:
        return "done"

    assert await unless_client_leaves(request_whose_client(0), quick()) == "done"
    await asyncio.sleep(0.05)  # the disconnect arrives after: the handler is not cancelled
    assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]


async def test_a_caller_cancelled_for_its_own_reasons_stays_cancelled() -> None:
    async def long_call() -> str:
        await asyncio.sleep(30)
        return "done"

    task = asyncio.create_task(unless_client_leaves(request_whose_client(None), long_call()))
    await asyncio.sleep(0.02)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    else:  # pragma: no cover - the assertion below says what went wrong
        raise AssertionError("the cancellation was swallowed")
    assert task.cancelled()
