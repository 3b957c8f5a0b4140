"""A hop whose worker fails mid-reply is re-dispatched by the scheduler to another worker
of its pool; the text the failed worker sent is void. The scheduler marks the new
dispatch (`HopEvent.restarted`, `ReplyRestarts`) and the router drops that text -- or,
where some of it reached a streaming caller already, fails the hop rather than send two
replies joined into one."""

from __future__ import annotations

import asyncio

import pytest

from inferx.errors import Unavailable
from inferx.v1 import scheduler_pb2
from inferx_router.executors import SchedulerExecutor
from inferx_scheduler.servicer import ReplyRestarts
from tests.unit.test_worker_hints import FakeServices, model_hop

Event = scheduler_pb2.HopEvent
DISPATCHED, TOKENS, FINISHED = Event.KIND_DISPATCHED, Event.KIND_TOKENS, Event.KIND_FINISHED


def events(*items: tuple[scheduler_pb2.HopEvent.Kind, str, str]) -> list[scheduler_pb2.HopEvent]:
    return [Event(kind=kind, worker_id=worker, text=text) for kind, worker, text in items]


def test_a_dispatch_after_text_was_sent_is_marked_restarted() -> None:
    restarts = ReplyRestarts()
    marked = [
        restarts.mark(e)
        for e in events(
            (DISPATCHED, "w1", ""),
            (TOKENS, "w1", "par"),  # w1 fails here
            (DISPATCHED, "w2", ""),  # re-dispatched: w1's text is void
            (DISPATCHED, "w3", ""),  # w2 failed before any text: nothing more to void
            (TOKENS, "w3", "ful"),
            (FINISHED, "w3", "l"),
        )
    ]
    assert [e.restarted for e in marked] == [False, False, True, False, False, False]


def test_a_first_dispatch_is_never_a_restart() -> None:
    restarts = ReplyRestarts()
    assert [restarts.mark(e).restarted for e in events((DISPATCHED, "w1", ""), (FINISHED, "w1", "ok"))] == [
        False,
        False,
    ]


class RestartingStreams:
    """A scheduler hop stream whose hop restarts on w2 after w1 sent part of a reply."""

    async def call(self, address, request, timeout):
        for event in events((DISPATCHED, "w1", ""), (TOKENS, "w1", "par")):
            yield event
        restarted = Event(kind=DISPATCHED, worker_id="w2", restarted=True)
        yield restarted
        for event in events((TOKENS, "w2", "ful"), (FINISHED, "w2", "l")):
            yield event


def executor() -> SchedulerExecutor:
    return SchedulerExecutor(
        FakeServices(),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        streams=RestartingStreams(),  # type: ignore[arg-type]
    )


def test_the_router_drops_the_failed_workers_text() -> None:
    dispatched: list[str] = []
    done = asyncio.run(executor().run_hop(model_hop("r", "h", "m"), 5.0, dispatched.append))
    assert done.text == "full" and done.worker_id == "w2"
    assert dispatched == ["w1", "w2"]


def test_a_streaming_caller_that_has_some_of_the_void_text_gets_an_error_not_two_replies() -> None:
    streamed: list[str] = []
    with pytest.raises(Unavailable, match="failed mid-reply"):
        asyncio.run(
            executor().run_hop(model_hop("r", "h", "m"), 5.0, lambda _: None, on_text=streamed.append)
        )
    assert streamed == ["par"]  # nothing of the second reply joined to it
