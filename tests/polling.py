"""Wait for a condition by polling it until a deadline, instead of sleeping a fixed time.

A fixed sleep is either too short on a loaded machine (the test fails, or worse, passes
without exercising what it claims) or too long everywhere else. These helpers check
the condition every `interval_s` and fail loudly, naming what was awaited and the last
value seen, when the deadline passes.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")


@overload
async def poll_until(
    condition: Callable[[], Awaitable[T]], *, timeout_s: float, interval_s: float = ..., what: str = ...
) -> T: ...


@overload
async def poll_until(
    condition: Callable[[], T], *, timeout_s: float, interval_s: float = ..., what: str = ...
) -> T: ...


async def poll_until(
    condition: Callable[[], Any],
    *,
    timeout_s: float,
    interval_s: float = 0.1,
    what: str = "the condition",
) -> Any:
    """Call `condition` (plain or async) until it returns a truthy value, and return
    that value. The condition is checked at least once, and once more at the deadline;
    an exception it raises propagates."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last value: {value!r}")
        await asyncio.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))


def poll_until_sync(
    condition: Callable[[], T],
    *,
    timeout_s: float,
    interval_s: float = 0.1,
    what: str = "the condition",
) -> T:
    """poll_until for synchronous code (it blocks the thread between checks)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        # A coroutine is always truthy: an async condition here would "pass" unchecked.
        assert not inspect.isawaitable(value), "poll_until_sync needs a plain condition: use poll_until"
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last value: {value!r}")
        time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
