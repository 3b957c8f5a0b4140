"""`hopstream.LocalPeer`: a peer this process serves itself (the router's embedded
scheduler). The same handler, called in-process instead of over a stream, must end every
call as the stream (and the plain call) would: replies, statuses with their trailers,
deadlines, cancellation, spans -- so the router's hop code cannot tell the two apart."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from inferx import hopstream, telemetry
from inferx.discovery import ChannelPool
from inferx.tls import Transport
from inferx_router.executors import scheduler_streams
from tests.unit.test_hopstream import (
    Hops,
    a_cancelled_caller_cancels_only_its_handler,
    cancelled_handlers,
    errors_end_as_the_plain_call_would,
    hop,
    past_the_deadline_both_sides_stop,
    texts,
)
from tests.unit.test_telemetry import spans  # noqa: F401 (a fixture: the process's spans)

ADDRESS = "10.9.9.9:50052"  # nothing listens there: a call that left the process would fail


@pytest.fixture
async def local():
    channels = ChannelPool(Transport())
    servicer = Hops()
    streams = scheduler_streams(channels, enabled=True)
    streams.serve_locally(ADDRESS, servicer.SubmitHop)
    yield streams, servicer
    await streams.close()
    await channels.close()


def local_calls() -> float:
    return hopstream.LOCAL_CALLS.labels(hopstream.HOPS.plain_method)._value.get()


async def test_hops_run_in_process_each_with_its_own_replies_and_deadline(local) -> None:
    streams, servicer = local
    before = local_calls()
    prompts = [f"echo:{i}-{'x' * i}" for i in range(20)]
    got = await asyncio.gather(*(texts(streams, ADDRESS, p) for p in prompts))
    assert got == [p.split(":", 1)[1] for p in prompts]
    assert sorted(servicer.started) == sorted(prompts)
    assert all(r is not None and 4.0 < r <= 5.0 for r in servicer.remaining)
    assert streams.clients == {}  # no stream was opened: nothing crossed gRPC
    assert local_calls() - before == len(prompts)


async def test_errors_are_the_statuses_the_stream_would_give(local) -> None:
    streams, _ = local
    await errors_end_as_the_plain_call_would(streams, ADDRESS)


async def test_a_cancelled_caller_cancels_the_handler_and_leaves_the_others(local) -> None:
    streams, servicer = local
    await a_cancelled_caller_cancels_only_its_handler(streams, ADDRESS, servicer)


async def test_a_caller_that_stops_reading_cancels_the_handler(local) -> None:
    streams, servicer = local
    replies = streams.call(ADDRESS, hop("wait"), 5.0)
    first = await anext(replies)  # DISPATCHED, then the handler waits
    assert first.worker_id == "w1"
    await replies.aclose()
    assert await cancelled_handlers(servicer) == ["wait"]


async def test_past_its_deadline_a_hop_is_deadline_exceeded_and_its_handler_stops(local) -> None:
    streams, servicer = local
    await past_the_deadline_both_sides_stop(streams, ADDRESS, servicer)
    with pytest.raises(grpc.aio.AioRpcError) as spent:
        await texts(streams, ADDRESS, "echo:x", timeout=0)
    assert spent.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_in_process_calls_do_not_depend_on_hop_streams_being_on() -> None:
    channels = ChannelPool(Transport())
    servicer = Hops()
    streams = scheduler_streams(channels, enabled=False)  # --no-hop-streams
    streams.serve_locally(ADDRESS, servicer.SubmitHop)
    try:
        assert await texts(streams, ADDRESS, "echo:yes") == "yes"
    finally:
        await streams.close()
        await channels.close()


async def test_a_traced_in_process_hop_has_the_call_s_client_span_over_the_handler_s_spans(
    spans,  # noqa: F811
) -> None:
    channels = ChannelPool(Transport())
    servicer = Hops()
    streams = scheduler_streams(channels)  # made while this process traces
    streams.serve_locally(ADDRESS, servicer.SubmitHop)
    try:
        with telemetry.span("attempt"):
            assert await texts(streams, ADDRESS, "traced:ok") == "ok"
            with pytest.raises(grpc.aio.AioRpcError):
                await texts(streams, ADDRESS, "busy")
    finally:
        await streams.close()
        await channels.close()
    finished = {(s.name, s.kind.name): s for s in spans.get_finished_spans()}
    by_id = {s.context.span_id: s for s in spans.get_finished_spans()}
    calls = [s for s in spans.get_finished_spans() if s.name == "/inferx.v1.Scheduler/SubmitHop"]
    assert [s.kind.name for s in calls] == ["CLIENT", "CLIENT"]  # no server span: no server
    attempt = finished[("attempt", "INTERNAL")]
    assert all(call.parent.span_id == attempt.context.span_id for call in calls)
    inside = finished[("inside the handler", "INTERNAL")]
    assert by_id[inside.parent.span_id] in calls  # the handler ran under its call's span
    codes = sorted(s.attributes["rpc.grpc.status_code"] for s in calls)
    assert codes == [0, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
