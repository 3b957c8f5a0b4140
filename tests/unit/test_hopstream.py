"""The hop stream multiplexer (`inferx.hopstream`) over real gRPC in this process: a
scheduler-shaped servicer whose SubmitHop does what the prompt says, served both as the
plain call and on `Scheduler.Hops`."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from inferx import hopstream, telemetry, wire
from inferx.discovery import ChannelPool
from inferx.errors import (
    OWNER_KEY,
    SERVICE_STATUS_KEY,
    NotOwner,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
)
from inferx.server import ErrorMappingInterceptor
from inferx.tls import Transport
from inferx.v1 import scheduler_pb2, scheduler_pb2_grpc
from inferx_router.executors import scheduler_streams
from inferx_router.scheduler_target import Failure, classify
from tests.unit.test_telemetry import spans  # noqa: F401 (a fixture: the process's spans)

Event = scheduler_pb2.HopEvent


class Hops(scheduler_pb2_grpc.SchedulerServicer):
    """SubmitHop by prompt: 'echo:X' answers X; 'wait' waits until cancelled;
    'busy' is RESOURCE_EXHAUSTED with a retry hint; 'slow:X' answers X after 0.3 s,
    'nap:X' after 1.2 s."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.remaining: list[float | None] = []
        self.plain_calls = 0

    async def SubmitHop(self, request, context):
        self.started.append(request.prompt)
        self.remaining.append(context.time_remaining())
        kind, _, arg = request.prompt.partition(":")
        try:
            yield Event(kind=Event.KIND_DISPATCHED, worker_id="w1")
            if kind == "wait":
                await asyncio.Event().wait()
            if kind == "slow":
                await asyncio.sleep(0.3)
            if kind == "nap":
                await asyncio.sleep(1.2)
            if kind == "busy":
                raise ResourceExhausted("queue full", retry_after_s=2.5)
            if kind == "boom":
                raise RuntimeError("a bug")
            if kind == "elsewhere":
                raise NotOwner("pool 'p' is owned by another scheduler", owner_address="10.0.0.2:50052")
            if kind == "traced":
                with telemetry.span("inside the handler"):
                    pass
            yield Event(kind=Event.KIND_TOKENS, text=arg[:1], worker_id="w1")
            yield Event(kind=Event.KIND_FINISHED, text=arg[1:], worker_id="w1")
        except asyncio.CancelledError:
            self.cancelled.append(request.prompt)
            raise

    async def Hops(self, request_iterator, context):
        await hopstream.StreamServer(context, self.SubmitHop, hopstream.HOPS).serve()


class PlainOnly(Hops):
    """A scheduler of an older version: no Hops (the generated base answers UNIMPLEMENTED)."""

    Hops = scheduler_pb2_grpc.SchedulerServicer.Hops

    async def SubmitHop(self, request, context):
        self.plain_calls += 1
        async for event in super().SubmitHop(request, context):
            yield event


async def serve(servicer: Hops, port: int = 0, guard=None, options=None) -> tuple[grpc.aio.Server, int]:
    errors = ErrorMappingInterceptor()
    errors.guard = guard
    server = grpc.aio.server(interceptors=[errors], options=options)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


def hop(prompt: str) -> scheduler_pb2.HopRequest:
    return scheduler_pb2.HopRequest(model="m", prompt=prompt)


async def texts(pool: hopstream.StreamPool, address: str, prompt: str, timeout: float | None = 5.0) -> str:
    out = []
    async for event in pool.call(address, hop(prompt), timeout):
        out.append(event.text)
    return "".join(out)


# What every way of calling a hop handler must do alike (the stream here, the
# in-process `LocalPeer` in test_local_peer.py): the plain call's behaviour.


async def errors_end_as_the_plain_call_would(streams: hopstream.StreamPool, address: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as busy:
        await texts(streams, address, "busy")
    assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    error = from_rpc_error(busy.value)
    assert isinstance(error, ResourceExhausted) and error.retry_after_s == 2.5
    assert error.message == "queue full"
    with pytest.raises(grpc.aio.AioRpcError) as bug:
        await texts(streams, address, "boom")
    assert bug.value.code() == grpc.StatusCode.INTERNAL and "a bug" in (bug.value.details() or "")
    # A partitioned service's refusal keeps the trailers the router re-routes by.
    with pytest.raises(grpc.aio.AioRpcError) as elsewhere:
        await texts(streams, address, "elsewhere")
    trailers = dict(elsewhere.value.trailing_metadata() or ())
    assert trailers[OWNER_KEY] == "10.0.0.2:50052" and trailers[SERVICE_STATUS_KEY] == "1"
    assert classify(elsewhere.value.code(), trailers) == Failure.NOT_OWNER
    busy_trailers = dict(busy.value.trailing_metadata() or ())
    assert SERVICE_STATUS_KEY in busy_trailers  # the scheduler's own status, not a lost one
    assert await texts(streams, address, "echo:ok") == "ok"  # later hops are not affected


async def cancelled_handlers(servicer: Hops) -> list[str]:
    for _ in range(100):
        if servicer.cancelled:
            break
        await asyncio.sleep(0.01)
    return servicer.cancelled


async def a_cancelled_caller_cancels_only_its_handler(
    streams: hopstream.StreamPool, address: str, servicer: Hops
) -> None:
    waiting = asyncio.create_task(texts(streams, address, "wait", timeout=None))
    slow = asyncio.create_task(texts(streams, address, "slow:xy"))
    while len(servicer.started) < 2:
        await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert await cancelled_handlers(servicer) == ["wait"]
    assert await slow == "xy"


async def past_the_deadline_both_sides_stop(
    streams: hopstream.StreamPool, address: str, servicer: Hops
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await texts(streams, address, "wait", timeout=0.2)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await cancelled_handlers(servicer) == ["wait"]  # the handler stopped too, as a call's would
    assert await texts(streams, address, "echo:go") == "go"


@pytest.fixture
async def channels():
    pool = ChannelPool(Transport())
    yield pool
    await pool.close()


async def test_concurrent_hops_share_one_stream_and_each_gets_its_own_replies(channels) -> None:
    servicer = Hops()
    server, port = await serve(servicer)
    streams = scheduler_streams(channels, enabled=True)
    address = f"127.0.0.1:{port}"
    try:
        prompts = [f"echo:{i}-{'x' * i}" for i in range(40)]
        got = await asyncio.gather(*(texts(streams, address, p) for p in prompts))
        assert got == [p.split(":", 1)[1] for p in prompts]
        client = streams.clients[address]
        assert client.opened == 1 and client.in_flight == 0
        assert sorted(servicer.started) == sorted(prompts)
        # Each hop's deadline reached its handler: time_remaining() as a call's context.
        assert all(r is not None and 4.0 < r <= 5.0 for r in servicer.remaining)
    finally:
        await streams.close()
        await server.stop(0)


async def test_errors_come_back_as_the_plain_calls_status(channels) -> None:
    servicer = Hops()
    server, port = await serve(servicer)
    streams = scheduler_streams(channels, enabled=True)
    address = f"127.0.0.1:{port}"
    try:
        await errors_end_as_the_plain_call_would(streams, address)
        assert streams.clients[address].opened == 1  # the stream carried on after failed hops
    finally:
        await streams.close()
        await server.stop(0)


async def test_cancelling_a_hop_cancels_its_handler_and_leaves_the_others(channels) -> None:
    servicer = Hops()
    server, port = await serve(servicer)
    streams = scheduler_streams(channels, enabled=True)
    address = f"127.0.0.1:{port}"
    try:
        await a_cancelled_caller_cancels_only_its_handler(streams, address, servicer)
        assert streams.clients[address].in_flight == 0
    finally:
        await streams.close()
        await server.stop(0)


async def test_a_hop_past_its_deadline_is_deadline_exceeded_on_both_sides(channels) -> None:
    servicer = Hops()
    server, port = await serve(servicer)
    streams = scheduler_streams(channels, enabled=True)
    address = f"127.0.0.1:{port}"
    try:
        await past_the_deadline_both_sides_stop(streams, address, servicer)
    finally:
        await streams.close()
        await server.stop(0)


async def test_a_broken_stream_fails_its_hops_as_unavailable_and_the_next_hop_reopens_it(channels) -> None:
    servicer = Hops()
    server, port = await serve(servicer)
    streams = scheduler_streams(channels, enabled=True)
    address = f"127.0.0.1:{port}"
    try:
        assert await texts(streams, address, "echo:a") == "a"
        in_flight = [asyncio.create_task(texts(streams, address, "wait")) for _ in range(3)]
        while len(servicer.started) < 4:
            await asyncio.sleep(0.01)
        await server.stop(0)  # the peer dies with three hops on the stream
        for task in in_flight:
            with pytest.raises(grpc.aio.AioRpcError) as broke:
                await task
            assert broke.value.code() == grpc.StatusCode.UNAVAILABLE
            # UNAVAILABLE is what the router retries and the scheduler re-dispatches.
            assert isinstance(from_rpc_error(broke.value), Unavailable)
        server, _ = await serve(servicer, port)  # back on the same address
        for _ in range(50):
            try:
                assert await texts(streams, address, "echo:b") == "b"
                break
            except grpc.aio.AioRpcError as exc:  # the channel reconnects with backoff
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
                await asyncio.sleep(0.1)
        else:
            pytest.fail("no hop got through after the peer came back")
        assert streams.clients[address].opened >= 2
    finally:
        await streams.close()
        await server.stop(0)


async def test_a_peer_without_the_stream_method_gets_plain_calls(channels) -> None:
    servicer = PlainOnly()
    server, port = await serve(servicer)
    streams = scheduler_streams(channels, enabled=True)
    address = f"127.0.0.1:{port}"
    try:
        assert await texts(streams, address, "echo:one") == "one"
        assert await texts(streams, address, "echo:two") == "two"
        assert servicer.plain_calls == 2
        assert streams.clients[address].supported is False
    finally:
        await streams.close()
        await server.stop(0)


async def test_streams_off_make_plain_calls(channels) -> None:
    servicer = PlainOnly()
    server, port = await serve(servicer)
    streams = scheduler_streams(channels, enabled=False)
    try:
        assert await texts(streams, f"127.0.0.1:{port}", "echo:one") == "one"
        assert servicer.plain_calls == 1 and not streams.clients
    finally:
        await server.stop(0)


async def test_draining_finishes_the_hops_in_flight_then_ends_the_stream(channels) -> None:
    servicer = Hops()
    server, port = await serve(servicer)
    streams = scheduler_streams(channels, enabled=True)
    address = f"127.0.0.1:{port}"
    try:
        slow = asyncio.create_task(texts(streams, address, "slow:ab"))
        while not servicer.started:
            await asyncio.sleep(0.01)
        hopstream.drain_all()  # what the service's shutdown does before server.stop
        assert await slow == "ab"
        client = streams.clients[address]
        for _ in range(100):
            if client._current is None:
                break
            await asyncio.sleep(0.01)
        assert client._current is None  # the stream ended once its hop was done
        assert await texts(streams, address, "echo:again") == "again"  # a new stream
        assert client.opened == 2
    finally:
        await streams.close()
        await server.stop(0)


async def test_traced_hops_have_a_call_s_client_and_server_spans_linked_through_the_stream(
    channels,
    spans,  # noqa: F811
) -> None:
    servicer = Hops()
    server, port = await serve(servicer)
    streams = scheduler_streams(channels)  # made while this process traces
    address = f"127.0.0.1:{port}"
    try:
        with telemetry.span("attempt"):
            assert await texts(streams, address, "traced:ok") == "ok"
            with pytest.raises(grpc.aio.AioRpcError):
                await texts(streams, address, "busy")
        finished = {(s.name, s.kind.name): s for s in spans.get_finished_spans()}
        by_id = {s.context.span_id: s for s in spans.get_finished_spans()}
        assert not [s for s in spans.get_finished_spans() if s.name.endswith("/Hops")]  # the stream has none
        calls = [s for s in spans.get_finished_spans() if s.name == "/inferx.v1.Scheduler/SubmitHop"]
        clients = [s for s in calls if s.kind.name == "CLIENT"]
        servers = [s for s in calls if s.kind.name == "SERVER"]
        assert len(clients) == len(servers) == 2
        attempt = finished[("attempt", "INTERNAL")]
        for client in clients:
            assert client.parent.span_id == attempt.context.span_id
        for server_span in servers:  # each the child of its client span, in the same trace
            parent = by_id[server_span.parent.span_id]
            assert parent in clients and parent.context.trace_id == attempt.context.trace_id
        inside = finished[("inside the handler", "INTERNAL")]
        ok_server = by_id[inside.parent.span_id]
        assert ok_server in servers and ok_server.attributes["rpc.grpc.status_code"] == 0
        failed = [
            s
            for s in calls
            if s.attributes["rpc.grpc.status_code"] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        ]
        assert {s.kind.name for s in failed} == {"CLIENT", "SERVER"}
        assert all(s.status.status_code.name == "ERROR" for s in failed)
    finally:
        await streams.close()
        await server.stop(0)


async def test_a_service_guard_refusing_the_stream_refuses_its_hops_with_its_status(channels) -> None:
    def guard(method: str, context) -> None:
        raise PermissionDenied(f"{method}: not for you")

    servicer = Hops()
    server, port = await serve(servicer, guard=guard)
    streams = scheduler_streams(channels)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await texts(streams, f"127.0.0.1:{port}", "echo:no")
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED  # not a retryable UNAVAILABLE
        assert "/inferx.v1.Scheduler/Hops: not for you" in (refused.value.details() or "")
        assert servicer.started == []
    finally:
        await streams.close()
        await server.stop(0)


class RacedCall:
    """A stream the peer refused while its first message was being written, as grpc.aio
    reports it: the write (`on`="write") or the read waiting meanwhile (`on`="read")
    fails INTERNAL "Internal error from Core" -- the call's status until the peer's
    (`real`, None: never) replaces it `after` seconds later. `real_first`: the peer's
    status came first and the failed write's placeholder overwrote it for good (grpc.aio
    sets the status again on every failure). Done callbacks run at each status set."""

    def __init__(
        self, real: grpc.StatusCode | None, on: str, after: float = 0.05, *, real_first: bool = False
    ) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.real, self.on, self.after, self.real_first = real, on, after, real_first
        self.cancelled = False
        self.written = asyncio.Event()
        self.callbacks: list = []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def _set(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        for callback in self.callbacks:
            callback(self)

    def _raced(self) -> grpc.aio.AioRpcError:
        self._set(grpc.StatusCode.INTERNAL, hopstream._RACED_END)
        return grpc.aio.AioRpcError(
            grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), details=hopstream._RACED_END
        )

    async def write(self, message) -> None:
        refusal = "/inferx.v1.Scheduler/Hops: not for you"
        if self.real is not None and self.real_first:
            self._set(self.real, refusal)
        elif self.real is not None:
            asyncio.get_running_loop().call_later(self.after, self._set, self.real, refusal)
        self.written.set()
        if self.on == "write":
            raise self._raced()
        await asyncio.Event().wait()  # the writer never hears: the reader's failure decides

    async def read(self):
        if self.on == "write":
            await asyncio.Event().wait()  # the reader learns nothing: the writer's failure decides
        await self.written.wait()
        raise self._raced()

    async def code(self) -> grpc.StatusCode:
        assert self.status is not None
        return self.status[0]

    async def details(self) -> str:
        assert self.status is not None
        return self.status[1]

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata()

    def cancel(self) -> bool:
        self.cancelled = True
        return True


@pytest.mark.parametrize("on", ["write", "read"])
@pytest.mark.parametrize(
    ("real", "expected"),
    [
        (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.PERMISSION_DENIED),  # the refusal, not a break
        (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
        (None, grpc.StatusCode.UNAVAILABLE),  # no status ever came: a break, retryable
    ],
)
@pytest.mark.parametrize("real_first", [False, True], ids=["status-after", "status-before"])
async def test_a_write_that_raced_the_streams_end_fails_its_hops_with_the_peers_status(
    monkeypatch, real, expected, on, real_first
) -> None:
    monkeypatch.setattr(hopstream, "SETTLE_S", 0.3)
    call = RacedCall(real, on, real_first=real_first)
    client = hopstream.StreamClient(lambda: call, hopstream.HOPS, "10.0.0.9:50052")
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        async for _ in client.call(hop("echo:no"), 5.0):
            pass
    assert failed.value.code() == expected
    if real == grpc.StatusCode.PERMISSION_DENIED:
        assert "not for you" in (failed.value.details() or "")
    assert call.cancelled and client.in_flight == 0
    await client.close()


async def test_items_queued_while_a_message_is_written_go_out_together_and_room_waits() -> None:
    """The outbox: what queues during a write goes in the next message, and a full
    outbox holds its producers until the writer takes the items (backpressure)."""
    written: list[list[int]] = []
    release = asyncio.Event()

    async def write(batch: scheduler_pb2.HopStreamEvents) -> None:
        written.append([item.tag for item in batch.events])
        await release.wait()  # the peer's window is closed until released

    outbox = hopstream._Outbox(write, scheduler_pb2.HopStreamEvents, "events", on_error=print, limit=3)
    outbox.add().tag = 1
    await asyncio.sleep(0)  # the writer takes it: alone in its message
    for tag in (2, 3, 4):
        outbox.add().tag = tag
    assert outbox.full
    waiting = asyncio.create_task(outbox.room())
    await asyncio.sleep(0.01)
    assert written == [[1]] and not waiting.done()  # held while the first write is stuck
    release.set()
    await asyncio.wait_for(waiting, 1)
    await asyncio.wait_for(outbox.flush(), 1)
    assert written == [[1], [2, 3, 4]]
    outbox.close()


async def test_a_deferred_item_rides_with_the_next_one_or_goes_out_within_its_bound() -> None:
    """The scheduler's DISPATCHED is deferred: with the hop's FINISHED when that comes
    soon (one message, not two), else on its own at most `DEFER_S` later."""
    written: list[tuple[float, list[int]]] = []

    async def write(batch: scheduler_pb2.HopStreamEvents) -> None:
        written.append((asyncio.get_running_loop().time(), [item.tag for item in batch.events]))

    outbox = hopstream._Outbox(write, scheduler_pb2.HopStreamEvents, "events", on_error=print)
    await asyncio.sleep(0)  # the writer waits for work
    outbox.add(defer=True).tag = 1
    await asyncio.sleep(hopstream.DEFER_S / 5)
    assert written == []  # not alone
    outbox.add().tag = 2
    await asyncio.wait_for(outbox.flush(), 1)
    assert [tags for _, tags in written] == [[1, 2]]
    added = asyncio.get_running_loop().time()
    outbox.add(defer=True).tag = 3
    await asyncio.wait_for(outbox.flush(), 1)  # nothing follows: it goes out by itself
    at, tags = written[-1]
    assert tags == [3] and at - added >= hopstream.DEFER_S * 0.9
    outbox.close()


async def test_a_dispatched_event_reaches_the_caller_while_its_hop_still_runs(channels) -> None:
    """Deferring DISPATCHED never holds it back for the whole hop: a caller waiting on a
    long hop sees it (and the handler's later replies come after it, in order)."""
    servicer = Hops()
    server, port = await serve(servicer)
    streams = scheduler_streams(channels, enabled=True)
    address = f"127.0.0.1:{port}"
    try:
        events = streams.call(address, hop("slow:ab"), 5.0)
        first = await asyncio.wait_for(anext(events), 0.25)  # 'slow' answers after 0.3 s
        assert first.kind == Event.KIND_DISPATCHED and first.worker_id == "w1"
        rest = [event async for event in events]
        assert [e.kind for e in rest] == [Event.KIND_TOKENS, Event.KIND_FINISHED]
        assert "".join(e.text for e in rest) == "ab"
    finally:
        await streams.close()
        await server.stop(0)


async def test_a_stream_whose_connection_aged_out_takes_no_new_hops_and_none_breaks(channels) -> None:
    """A server past its max connection age (1 s here) sends a GOAWAY and closes the
    connection after its grace (3 s): the hops already on the stream finish on it, new
    hops go on a new stream over a new connection, and the old stream then ends -- no hop
    breaks, though hops run all the time, each longer than the age. Other calls on the
    same channel (a scheduler's health checks) reconnect it at once after the GOAWAY:
    the stream must move all the same."""
    options = wire.server_options(
        max_connection_age_s=1.0, max_connection_age_grace_s=3.0, keepalive_time_s=60, keepalive_timeout_s=20
    )
    servicer = Hops()
    server, port = await serve(servicer, options=options)
    streams = scheduler_streams(channels, enabled=True)
    address = f"127.0.0.1:{port}"
    channel = channels.get(address)

    async def health_checks() -> None:
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await scheduler_pb2_grpc.SchedulerStub(channel).GetSchedulerStatus(
                    scheduler_pb2.SchedulerStatusRequest(), timeout=1
                )
            await asyncio.sleep(0.05)

    checks = asyncio.create_task(health_checks())
    try:
        hops = []
        for i in range(18):  # a 1.2 s hop every 0.25 s for 4.5 s: past two connection ages
            hops.append(asyncio.create_task(texts(streams, address, f"nap:h{i}", timeout=10)))
            await asyncio.sleep(0.25)
        assert await asyncio.gather(*hops) == [f"h{i}" for i in range(18)]
        client = streams.clients[address]
        assert client.retired >= 2 and client.opened == client.retired + 1
        assert client.in_flight == 0
    finally:
        checks.cancel()
        await streams.close()
        await server.stop(0)
