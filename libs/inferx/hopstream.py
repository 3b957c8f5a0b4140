"""Many server-streaming calls multiplexed on one long-lived bidirectional stream.

A hop used to be a new call each time (router -> scheduler `SubmitHop`, scheduler ->
worker `Generate`); setting up and tearing down a call is most of what gRPC's asyncio
layer costs per hop (issue #14's profile). `Scheduler.Hops` and
`ModelWorker.GenerateStream` carry the same requests and replies as messages on one
stream per peer, each tagged by the caller:

* `StreamClient` (caller side, one per peer address): `call(payload, timeout)` sends
  one request and yields its replies. It ends as the call would have: normally, or by
  raising the `grpc.aio.AioRpcError` the call would have raised (same code, message and
  retry-after trailer), so callers handle errors exactly as before. The deadline is the
  call's (DEADLINE_EXCEEDED), cancelling the caller sends `cancel`, and the stream
  breaking fails every call on it with UNAVAILABLE (retryable, as a failed call to a
  dead peer), the next call opening a new stream. A peer without the method
  (UNIMPLEMENTED) raises `StreamUnsupported` before any reply: use the plain call.
* `StreamServer` (servicer side, one per stream): runs each request's handler -- the
  plain call's own handler, with a per-request `time_remaining()` -- in a task of its
  own, writes its replies tagged, and ends it with its status. `drain_all` (the
  service's shutdown) stops new requests on every stream (UNAVAILABLE, as a stopping
  server refuses calls) and ends each stream once its requests are done.

Each side batches: what is ready while the previous message is being written goes out
in the next one (`_Outbox`; one item per message when the stream is idle). Flow control
is HTTP/2's, per stream: the writer waits for the window, and a handler whose replies
pile up (more than the outbox's limit) waits for the writer.

Tracing: the stream itself has no span (it lives as long as the process); each call on
it has the client and server spans a plain call has, with the same names, the trace
context travelling in the request (`trace_context`) instead of the call's metadata.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.trace import Span
from prometheus_client import Counter

from inferx import telemetry
from inferx.discovery import ChannelPool
from inferx.errors import RETRY_AFTER_KEY, InferxError, fit_status_message, status_trailers
from inferx.v1 import common_pb2, scheduler_pb2, worker_pb2

log = logging.getLogger("inferx.hopstream")

# A reply of `_Inbox`: a payload message, or how the call ended.
_End = common_pb2.StreamStatus


class StreamUnsupported(Exception):
    """The peer has no such stream method (an older version): use the plain call."""


def rpc_error(
    code: grpc.StatusCode, message: str, retry_after_s: float | None = None
) -> grpc.aio.AioRpcError:
    """The error a plain call ending with this status raises."""
    trailing = grpc.aio.Metadata()
    if retry_after_s is not None:
        trailing.add(RETRY_AFTER_KEY, f"{retry_after_s:g}")
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=message)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _status_error(status: common_pb2.StreamStatus) -> grpc.aio.AioRpcError:
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    if status.trailers:  # what the plain call's trailing metadata would have been
        trailing = grpc.aio.Metadata(*sorted(status.trailers.items()))
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=status.message)
    retry = status.retry_after_s if status.HasField("retry_after_s") else None
    return rpc_error(code, status.message, retry)


class _Inbox:
    """The replies of one call, as the stream's reader hands them over (no task, no queue)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: Any) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> Any:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            self.waiter = None
        return self.items.popleft()


@dataclass(frozen=True)
class StreamShape:
    """The messages of one multiplexed stream method: batches (`requests_cls` listing
    `requests_field`) of requests with `tag`, `<payload_field>` (the plain call's
    request), `cancel` and `timeout_s`; reply batches (`replies_cls` listing
    `replies_field`) of replies with `tag`, `<reply_field>` (one of the plain call's
    replies) and, on a call's last, `status`."""

    method: str
    plain_method: str  # the plain call's: what a call on the stream is named in traces
    requests_cls: type
    requests_field: str
    payload_field: str
    replies_cls: type
    replies_field: str
    reply_field: str
    # Replies that need not go out on their own: sent with the next message, or at most
    # `DEFER_S` later (`_Outbox.add(defer=True)`).
    deferrable: Callable[[Any], bool] | None = None


def _dispatched(event: scheduler_pb2.HopEvent) -> bool:
    return event.kind == scheduler_pb2.HopEvent.KIND_DISPATCHED


# How late a deferred reply may go out when nothing else does. The scheduler's
# DISPATCHED event is one: the router only records the worker from it (its spans are
# built from FINISHED's timings), so it rides with the hop's FINISHED -- one stream
# message per hop instead of two when the stream is idle (issue #14) -- and a long hop's
# DISPATCHED still arrives within a few ms.
DEFER_S = 0.005


HOPS = StreamShape(
    "/inferx.v1.Scheduler/Hops",
    "/inferx.v1.Scheduler/SubmitHop",
    scheduler_pb2.HopStreamRequests,
    "requests",
    "hop",
    scheduler_pb2.HopStreamEvents,
    "events",
    "event",
    deferrable=_dispatched,
)
GENERATE = StreamShape(
    "/inferx.v1.ModelWorker/GenerateStream",
    "/inferx.v1.ModelWorker/Generate",
    worker_pb2.GenerateStreamRequests,
    "requests",
    "request",
    worker_pb2.GenerateStreamChunks,
    "chunks",
    "chunk",
)


class _Outbox:
    """What one side sends on a stream, batched: items are added to the next message
    (in place, no copy) and a writer task sends each message as soon as the previous one
    is written, so one message carries one item when the stream is idle and everything
    that queued meanwhile under load (a write is one operation through gRPC's poller
    thread; one per item would serialize them on the stream). Backpressure: `room()`
    waits while `limit` items are waiting (HTTP/2 flow control holds the writer)."""

    def __init__(
        self,
        write: Callable[[Any], Any],
        batch_cls: type,
        items_field: str,
        on_error: Callable[[BaseException], None],
        limit: int = 512,
    ) -> None:
        self._write = write
        self._batch_cls = batch_cls
        self._items_field = items_field
        self._on_error = on_error
        self._limit = limit
        self._batch = batch_cls()
        self._items = getattr(self._batch, items_field)
        self._wake: asyncio.Future[None] | None = None
        self._room: asyncio.Future[None] | None = None
        self._flushed = asyncio.Event()  # nothing waiting, nothing being written
        self._flushed.set()
        self.closed = False
        self._deferred: asyncio.TimerHandle | None = None  # the latest a deferred item waits
        self._task = asyncio.get_running_loop().create_task(self._run())

    def add(self, defer: bool = False) -> Any:
        """A new item of the next message, to be filled in before the caller awaits.
        `defer`: the item need not go out on its own: it waits (at most `DEFER_S`) for
        the next item that does, and goes in the same message."""
        item = self._items.add()
        self._flushed.clear()
        if defer:
            if self._deferred is None:
                self._deferred = asyncio.get_running_loop().call_later(DEFER_S, self._send_deferred)
        else:
            self._send_deferred()
        return item

    def _send_deferred(self) -> None:
        if self._deferred is not None:
            self._deferred.cancel()
            self._deferred = None
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    @property
    def full(self) -> bool:
        return len(self._items) >= self._limit

    async def room(self) -> None:
        while self.full and not self.closed:
            if self._room is None or self._room.done():
                self._room = asyncio.get_running_loop().create_future()
            await self._room

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not len(self._items):
                    self._flushed.set()
                    self._wake = loop.create_future()
                    await self._wake
                    self._wake = None
                    continue
                if self._deferred is not None:  # this message takes the deferred items too
                    self._deferred.cancel()
                    self._deferred = None
                batch = self._batch
                self._batch = self._batch_cls()
                self._items = getattr(self._batch, self._items_field)
                if self._room is not None and not self._room.done():
                    self._room.set_result(None)
                await self._write(batch)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the stream is gone (AioRpcError, InvalidStateError, ...)
            self._on_error(exc)
        finally:
            self.closed = True
            self._flushed.set()
            if self._room is not None and not self._room.done():
                self._room.set_result(None)

    async def flush(self) -> None:
        """Until what was added is written (or the stream is gone)."""
        await self._flushed.wait()  # also set when the writer ends

    def close(self) -> None:
        self.closed = True
        if self._deferred is not None:
            self._deferred.cancel()
            self._deferred = None
        self._task.cancel()


class _Stream:
    """One opened multiplexed stream: its call, writer, reader, and the tags of the
    calls on it. `retiring`: it takes no new call and half-closes once those are done."""

    __slots__ = ("call", "outbox", "reader", "tags", "connection", "retiring", "ended", "first_status")

    def __init__(self, call: grpc.aio.StreamStreamCall, connection: int) -> None:
        self.call = call
        self.outbox: _Outbox | None = None
        self.reader: asyncio.Task[None] | None = None
        self.tags: set[int] = set()
        self.connection = connection  # the channel's connection count when it was opened
        self.retiring = False
        self.ended = False
        # The first status the call got, as it was then (`_settled`: a write failing after
        # the peer's status arrived overwrites it with the placeholder, for good).
        self.first_status: grpc.aio.AioRpcError | None = None
        call.add_done_callback(self._note_status)

    def _note_status(self, call: grpc.aio.StreamStreamCall) -> None:
        # Called by grpc.aio each time the call's status is set, at once: read it now,
        # before anything replaces it (its coroutines return without waiting once set).
        if self.first_status is None:
            code, details = _now(call.code()), _now(call.details())
            if code is not None:
                trailers = _now(call.trailing_metadata()) or grpc.aio.Metadata()
                self.first_status = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, details=details)


class StreamClient:
    """Multiplexed streams to one peer: one open for new calls at a time, opened on first
    use and re-opened after a break.

    `open_stream()` starts the bidirectional call (e.g. `SchedulerStub(ch).Hops()`) whose
    messages `shape` describes, on `channel()`. A server past its max connection age
    sends a GOAWAY, lets the calls on that connection run for its grace period and then
    closes it; the channel moves its new calls to a new connection. A stream is one long
    call that would stay on the old one and break with every hop on it: so each time the
    channel leaves READY (a GOAWAY, a broken connection) the streams opened before are
    retired -- new calls go on a new stream (a new connection), and an old one
    half-closes once the calls on it are done.
    """

    def __init__(
        self,
        open_stream: Callable[[], grpc.aio.StreamStreamCall],
        shape: StreamShape,
        peer: str,
        channel: Callable[[], grpc.aio.Channel] | None = None,
    ) -> None:
        self._open_stream = open_stream
        self._shape = shape
        self._payload_field = shape.payload_field
        self.peer = peer
        self._channel = channel
        self._watcher: asyncio.Task[None] | None = None
        self._connections = 0  # times the channel left READY (its connection went away)
        self.supported = True  # False once the peer answered UNIMPLEMENTED
        self._current: _Stream | None = None  # the stream new calls go on
        self._streams: set[_Stream] = set()  # every stream not ended, retiring ones too
        self._pending: dict[int, _Inbox] = {}  # tag -> its call's replies, on any stream
        self._tags = itertools.count(1)
        self.opened = 0  # streams opened so far (tests, diagnostics)
        self.retired = 0  # streams retired because their connection went away
        # Work on ended or retiring streams (half-closing, settling a break), held until
        # done: the loop keeps only a weak reference to a task.
        self._aside: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def _stream(self) -> _Stream:
        loop = asyncio.get_running_loop()
        if self._channel is not None and (self._watcher is None or self._watcher.done()):
            # (again after its channel was closed: the pool gives a new one for the address)
            self._watcher = loop.create_task(self._watch(self._channel()))
        stream = self._current
        if stream is not None and stream.connection != self._connections:
            self._retire(stream)
            stream = None
        if stream is None:
            stream = _Stream(self._open_stream(), self._connections)
            opened = stream
            stream.outbox = _Outbox(
                stream.call.write,
                self._shape.requests_cls,
                self._shape.requests_field,
                lambda exc: self._write_failed(opened, exc),
            )
            stream.reader = loop.create_task(self._read(stream))
            self._current = stream
            self._streams.add(stream)
            self.opened += 1
        return stream

    async def _watch(self, channel: grpc.aio.Channel) -> None:
        """Count the times the channel's connection goes away (READY -> anything else)."""
        state = channel.get_state(try_to_connect=False)
        try:
            while True:
                await channel.wait_for_state_change(state)
                new = channel.get_state(try_to_connect=False)
                if state == _READY:
                    self._connections += 1
                if new == _SHUTDOWN:
                    return
                state = new
        except (asyncio.CancelledError, grpc.aio.UsageError, RuntimeError):
            return  # closed: the channel, or this client

    def _retire(self, stream: _Stream) -> None:
        log.info("connection to %s went away (a GOAWAY): its hop stream takes no new hops", self.peer)
        self.retired += 1
        stream.retiring = True
        if self._current is stream:
            self._current = None
        self._half_close_when_done(stream)

    def _half_close_when_done(self, stream: _Stream) -> None:
        if stream.retiring and not stream.tags and not stream.ended:
            self._run_aside(self._half_close(stream))

    async def _half_close(self, stream: _Stream) -> None:
        """No more requests on `stream`: the peer ends it, and its reader then sees EOF."""
        try:
            if stream.outbox is not None:
                await stream.outbox.flush()
            await stream.call.done_writing()
        except Exception as exc:  # already gone: the reader ends it
            log.debug("half-closing a hop stream to %s: %s", self.peer, exc)

    async def call(self, payload: Any, timeout: float | None, span: Span | None = None) -> AsyncIterator[Any]:
        """Send `payload` and yield its replies; raises as the plain call would. `span`:
        the call's client span, whose context goes with the request."""
        if not self.supported:
            raise StreamUnsupported(self.peer)
        if timeout is not None and timeout <= 0:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        stream = self._stream()
        outbox = stream.outbox
        assert outbox is not None
        tag = next(self._tags)
        inbox = _Inbox()
        self._pending[tag] = inbox
        stream.tags.add(tag)
        request = outbox.add()
        request.tag = tag
        if timeout is not None:
            request.timeout_s = timeout
        getattr(request, self._payload_field).CopyFrom(payload)
        if span is not None:
            telemetry.inject_context(request.trace_context, span)
        timer = None
        if timeout is not None:
            timer = asyncio.get_running_loop().call_later(timeout, self._expire, tag)
        ended = False
        replied = False
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, _End):
                    ended = True
                    if item.code == 0:
                        return
                    if item.code == _UNIMPLEMENTED and not replied:
                        raise StreamUnsupported(item.message)
                    raise _status_error(item)
                replied = True
                yield item
        finally:
            if timer is not None:
                timer.cancel()
            if self._pending.pop(tag, None) is not None and not ended and not stream.ended:
                # The caller left first (cancelled, deadline, stopped reading): tell the
                # peer, as cancelling the call would, without making the caller wait.
                cancel = outbox.add()
                cancel.tag = tag
                cancel.cancel = True
            stream.tags.discard(tag)
            self._half_close_when_done(stream)

    def _expire(self, tag: int) -> None:
        inbox = self._pending.get(tag)
        if inbox is not None:
            inbox.put(_End(code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], message="Deadline Exceeded"))

    async def _read(self, stream: _Stream) -> None:
        reason: BaseException | None = None
        replies_field, reply_field = self._shape.replies_field, self._shape.reply_field
        call = stream.call
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    break
                for reply in getattr(message, replies_field):
                    inbox = self._pending.get(reply.tag)
                    if inbox is None:
                        continue  # a call this side gave up
                    if reply.HasField(reply_field):
                        inbox.put(getattr(reply, reply_field))
                    if reply.HasField("status"):
                        self._pending.pop(reply.tag, None)
                        inbox.put(reply.status)
        except grpc.aio.AioRpcError as exc:
            reason = await _settled(stream, exc)
        except asyncio.CancelledError:
            reason = None
            raise
        except Exception as exc:  # a bug: fail the calls rather than hang them
            log.exception("hop stream reader to %s failed", self.peer)
            reason = exc
        finally:
            self._broken(stream, reason)

    def _write_failed(self, stream: _Stream, exc: BaseException) -> None:
        """The writer could not send on `stream`: it is gone, for the reason its status
        gives once settled (`_settled`). New calls go on a new stream meanwhile."""
        if self._current is stream:
            self._current = None

        async def break_when_settled() -> None:
            self._broken(stream, await _settled(stream, exc))

        self._run_aside(break_when_settled())

    def _run_aside(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._aside.add(task)
        task.add_done_callback(self._aside.discard)

    def _broken(self, stream: _Stream, reason: BaseException | None) -> None:
        """`stream` ended: fail what is still on it; the next call opens a new one."""
        if stream.ended:
            return
        stream.ended = True
        self._streams.discard(stream)
        if self._current is stream:
            self._current = None
        reader, stream.reader = stream.reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
        outbox, stream.outbox = stream.outbox, None
        if outbox is not None:
            outbox.close()
        stream.call.cancel()
        if isinstance(reason, grpc.aio.AioRpcError) and reason.code() == grpc.StatusCode.UNIMPLEMENTED:
            self.supported = False
            end = _End(code=_UNIMPLEMENTED, message=reason.details() or "")
        elif isinstance(reason, grpc.aio.AioRpcError) and reason.code() in _REFUSED:
            # The peer refused the stream itself: each call would have been refused alike.
            end = _End(code=reason.code().value[0], message=reason.details() or "")
        else:  # the peer went away (or the transport broke): retryable, as a call to it
            detail = reason.details() if isinstance(reason, grpc.aio.AioRpcError) else str(reason or "ended")
            end = _End(
                code=grpc.StatusCode.UNAVAILABLE.value[0],
                message=f"hop stream to {self.peer} broke: {detail}",
            )
        for tag in stream.tags:
            inbox = self._pending.pop(tag, None)
            if inbox is not None:
                inbox.put(end)

    def abandon(self, reason: str) -> None:
        """The peer is known to be gone (it stopped answering health checks): fail every
        call on its streams now with UNAVAILABLE, `reason` in the message, instead of
        when the connection's keepalive gives up on it (tens of seconds)."""
        for stream in list(self._streams):
            self._broken(stream, ConnectionAbortedError(reason))

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        for stream in list(self._streams):
            self._broken(stream, None)


# grpc.aio reports a write (or read) that raced the call's end as INTERNAL with this
# message, and sets it as the call's status. When the peer's real status -- a refusal
# such as PERMISSION_DENIED -- arrives after that, it replaces the placeholder; when it
# arrived first, the placeholder overwrites it (grpc.aio's `set_internal_error`), and
# only the status first noted (`_Stream.first_status`) still has it. Failing the calls
# on the stream with the placeholder would turn a refusal into a retryable break;
# `_settled` finds the real one, waiting for it at most `SETTLE_S`.
_RACED_END = "Internal error from Core"
SETTLE_S = 1.0
_SETTLE_POLL_S = 0.005


def _is_placeholder(error: BaseException | None) -> bool:
    return (
        isinstance(error, grpc.aio.AioRpcError)
        and error.code() == grpc.StatusCode.INTERNAL
        and error.details() == _RACED_END
    )


def _now(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """What `coroutine` returns if it does not have to wait (else None, and it is closed)."""
    try:
        coroutine.send(None)
    except StopIteration as returned:
        return returned.value
    coroutine.close()
    return None


async def _settled(stream: _Stream, reason: BaseException) -> BaseException:
    """`reason` the stream ended for, or the peer's status it stood in for."""
    if not _is_placeholder(reason):
        return reason
    if stream.first_status is not None and not _is_placeholder(stream.first_status):
        return stream.first_status  # the peer's status came first; the placeholder overwrote it
    call = stream.call
    loop = asyncio.get_running_loop()
    give_up = loop.time() + SETTLE_S
    while loop.time() < give_up:
        await asyncio.sleep(_SETTLE_POLL_S)  # no event fires when the status is replaced
        code = await call.code()
        details = await call.details()
        if code != grpc.StatusCode.INTERNAL or details != _RACED_END:
            trailers = await call.trailing_metadata()
            return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, details=details)
    return reason


_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
_READY, _SHUTDOWN = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.SHUTDOWN
# A stream that ended with one of these was refused by the peer, not broken: its calls
# get the same status. Any other end fails them UNAVAILABLE.
_REFUSED = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}

# Served here (the callee's side): streams opened, and the calls that came on them.
STREAMS_OPENED = Counter(
    "inferx_hop_streams_opened_total", "Multiplexed hop streams callers opened to this service", ["method"]
)
STREAM_CALLS = Counter(
    "inferx_hop_stream_calls_total", "Calls (hops) that came on multiplexed hop streams", ["method"]
)

# The plain call: (channel, request, timeout) -> its replies.
PlainCall = Callable[[grpc.aio.Channel, Any, float | None], AsyncIterator[Any]]


class StreamPool:
    """Calls to peers by address: on the peer's multiplexed stream (one `StreamClient`
    per address, on the `ChannelPool`'s channel), or as the plain call where streams are
    off (`enabled`: the service's --hop-streams) or the peer has no stream method. A
    traced process gives each call on a stream the client span a plain call has."""

    def __init__(
        self,
        channels: ChannelPool,
        shape: StreamShape,
        open_stream: Callable[[grpc.aio.Channel], grpc.aio.StreamStreamCall],
        plain: PlainCall,
        *,
        enabled: bool = True,
    ) -> None:
        self._channels = channels
        self._shape = shape
        self._open_stream = open_stream
        self._plain = plain
        self.enabled = enabled
        self._traced = telemetry.enabled()
        self.clients: dict[str, StreamClient] = {}
        #: peers this process serves itself, by the address others reach them at
        self.local: dict[str, LocalPeer] = {}

    def serve_locally(self, address: str, handler: Handler) -> None:
        """Calls to `address` run `handler` in this process (`LocalPeer`), not over gRPC."""
        self.local[address] = LocalPeer(handler, self._shape)

    def client(self, address: str) -> StreamClient:
        client = self.clients.get(address)
        if client is None:
            client = StreamClient(
                lambda: self._open_stream(self._channels.get(address)),
                self._shape,
                address,
                lambda: self._channels.get(address),
            )
            self.clients[address] = client
        return client

    def abandon(self, address: str, reason: str) -> None:
        """`StreamClient.abandon` for the peer at `address` (plain calls are left to
        their deadlines)."""
        client = self.clients.get(address)
        if client is not None:
            client.abandon(reason)

    async def call(self, address: str, payload: Any, timeout: float | None) -> AsyncIterator[Any]:
        """`payload`'s replies from the peer at `address`; raises as the plain call would."""
        local = self.local.get(address)
        if self.enabled or local is not None:
            client = self.client(address) if local is None else None
            if client is None or client.supported:
                # Traced: the call's client span, as the gRPC instrumentation makes for a
                # plain call (the plain call below gets the instrumentation's own).
                span = telemetry.start_call_span(self._shape.plain_method) if self._traced else None
                code, message = grpc.StatusCode.OK, ""
                try:
                    if local is not None:
                        replies = local.call(payload, timeout, span)
                    else:
                        assert client is not None
                        replies = client.call(payload, timeout, span)
                    async for reply in replies:
                        yield reply
                    return
                except StreamUnsupported:  # raised before any reply: nothing was sent twice
                    log.info("%s has no multiplexed stream method: one call per request", address)
                except grpc.aio.AioRpcError as exc:
                    code, message = exc.code(), exc.details() or ""
                    raise
                except asyncio.CancelledError:
                    code, message = grpc.StatusCode.CANCELLED, "cancelled"
                    raise
                finally:
                    if span is not None:
                        telemetry.end_call_span(span, code, message)
        async for reply in self._plain(self._channels.get(address), payload, timeout):
            yield reply

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
        self.clients.clear()


class PerCallContext:
    """What a plain call's handler reads from its context, for one multiplexed call: its
    deadline (`time_remaining`), as gRPC's context gives it from the request's timeout.
    The handlers served on streams (SubmitHop, Generate) use nothing else of it."""

    __slots__ = ("_deadline",)

    def __init__(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout_s if timeout_s > 0 else None

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(self._deadline - asyncio.get_running_loop().time(), 0.0)


# A plain call's handler: (request, context) -> its replies.
Handler = Callable[[Any, Any], AsyncIterator[Any]]

_servers: weakref.WeakSet[StreamServer] = weakref.WeakSet()


class StreamServer:
    """Serves one multiplexed stream: each request runs `handler` (the plain call's own)
    in a task of its own, its replies tagged, its end as a status."""

    def __init__(self, context: grpc.aio.ServicerContext, handler: Handler, shape: StreamShape) -> None:
        self._context = context
        self._handler = handler
        self._shape = shape
        self._payload_field = shape.payload_field
        self._reply_field = shape.reply_field
        self._method = shape.method
        self.service = shape.method.lstrip("/").partition("/")[0]  # "inferx.v1.Scheduler"
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._outbox: _Outbox | None = None
        self._draining = False
        self._ended = False  # the caller half-closed, or the stream broke: no more requests
        self._finished = asyncio.Event()
        self._traced = telemetry.enabled()
        STREAMS_OPENED.labels(shape.method).inc()
        self._calls = STREAM_CALLS.labels(shape.method)  # the child once, not a label lookup per call

    async def serve(self) -> None:
        """Until the caller half-closes or the service drains, and then until the calls
        on the stream are done; cancelling this (the caller went away) cancels them all."""
        _servers.add(self)
        self._outbox = _Outbox(
            self._context.write, self._shape.replies_cls, self._shape.replies_field, self._write_failed
        )
        reader = asyncio.get_running_loop().create_task(self._read_requests())
        try:
            await self._finished.wait()
            await self._outbox.flush()  # the last statuses go out before the stream ends
        finally:
            _servers.discard(self)
            reader.cancel()
            self._outbox.close()
            for task in list(self._tasks.values()):
                task.cancel()

    def _write_failed(self, exc: BaseException) -> None:
        # The stream is gone: nobody is left to answer. gRPC cancels this handler too.
        self._ended = True
        for task in list(self._tasks.values()):
            task.cancel()
        self._check_finished()

    async def _read_requests(self) -> None:
        field = self._shape.requests_field
        try:
            while True:
                message = await self._context.read()
                if message is grpc.aio.EOF:
                    break
                for request in getattr(message, field):
                    self._on_request(request)
        finally:  # half-closed, or the stream broke: no more requests
            self._ended = True
            self._check_finished()

    def _check_finished(self) -> None:
        if (self._ended or self._draining) and not self._tasks:
            self._finished.set()

    def _on_request(self, request: Any) -> None:
        tag = request.tag
        if request.cancel:
            task = self._tasks.get(tag)
            if task is not None:
                task.cancel()
            return
        if not request.HasField(self._payload_field):
            return
        if self._draining:  # as a stopping server refuses a new call
            self._end(tag, grpc.StatusCode.UNAVAILABLE, f"{self._method}: the service is stopping")
            return
        if tag in self._tasks:
            self._end(tag, grpc.StatusCode.INVALID_ARGUMENT, f"tag {tag} is in use on this stream")
            return
        self._calls.inc()
        payload = getattr(request, self._payload_field)
        trace_context = request.trace_context if self._traced and len(request.trace_context) else None
        self._tasks[tag] = asyncio.get_running_loop().create_task(
            self._run(tag, payload, request.timeout_s, trace_context)
        )

    async def _run(self, tag: int, payload: Any, timeout_s: float, trace_context: Any = None) -> None:
        if trace_context is None:
            await self._serve_call(tag, payload, timeout_s)
            return
        # The caller traces: the server span a plain call has, current for the handler.
        span = telemetry.start_call_span(self._shape.plain_method, server=True, carrier=trace_context)
        with telemetry.current(span):
            code, text = await self._serve_call(tag, payload, timeout_s)
        telemetry.end_call_span(span, code, text)

    async def _serve_call(self, tag: int, payload: Any, timeout_s: float) -> tuple[grpc.StatusCode, str]:
        outbox = self._outbox
        assert outbox is not None
        code, text, retry = grpc.StatusCode.OK, "", None
        trailers: tuple[tuple[str, str], ...] = ()
        context = PerCallContext(timeout_s)
        expired = cancelled = False
        timer = None
        if timeout_s > 0:
            task = asyncio.current_task()
            assert task is not None

            def expire() -> None:
                nonlocal expired
                expired = True
                task.cancel()

            timer = asyncio.get_running_loop().call_later(timeout_s, expire)
        field = self._reply_field
        deferrable = self._shape.deferrable
        try:
            async for item in self._handler(payload, context):
                reply = outbox.add(defer=deferrable is not None and deferrable(item))
                reply.tag = tag
                getattr(reply, field).CopyFrom(item)
                if outbox.full:
                    await outbox.room()
        except asyncio.CancelledError:
            cancelled = True
        except Exception as exc:
            code, text, retry, trailers = _failure(exc, self._method)
        finally:
            if timer is not None:
                timer.cancel()
            self._tasks.pop(tag, None)
        if cancelled:
            if not expired:  # by the caller (who expects nothing more) or the stream's end
                self._check_finished()
                return grpc.StatusCode.CANCELLED, "cancelled by the caller"
            code, text = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"  # as a call's
        self._end(tag, code, text, retry, trailers)
        self._check_finished()
        return code, text

    def _end(
        self,
        tag: int,
        code: grpc.StatusCode,
        text: str,
        retry_after_s: float | None = None,
        trailers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        if self._outbox is None or self._outbox.closed:
            return  # the stream is gone, and the caller with it
        reply = self._outbox.add()
        reply.tag = tag
        reply.status.code = code.value[0]
        if text:
            reply.status.message = fit_status_message(text)
        if retry_after_s is not None:
            reply.status.retry_after_s = retry_after_s
        reply.status.trailers.update(trailers)

    def drain(self) -> None:
        """Take no new call on this stream; end it once the calls on it are done."""
        if self._draining:
            return
        self._draining = True
        self._check_finished()


def _failure(
    exc: Exception, method: str
) -> tuple[grpc.StatusCode, str, float | None, tuple[tuple[str, str], ...]]:
    """How a handler's error ends its call (code, text, retry-after, trailers), as the
    error-mapping interceptor ends a plain call."""
    if isinstance(exc, InferxError):
        return exc.code, exc.message, exc.retry_after_s, status_trailers(exc)
    if isinstance(exc, grpc.aio.AioRpcError):  # a handler that lets its own call's error through
        return exc.code(), exc.details() or "", None, ()
    log.exception("unhandled error in %s", method)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}: {exc}", None, ()


# Calls a process made to a peer it serves itself (`LocalPeer`): no stream, no gRPC.
LOCAL_CALLS = Counter(
    "inferx_in_process_calls_total",
    "Calls (hops) this process served to itself, without gRPC (a router's embedded scheduler)",
    ["method"],
)


class LocalPeer:
    """A peer served by this very process -- the router's embedded scheduler
    (`inferx-router --embedded-scheduler`, issue #14): a call runs the plain call's own
    handler in a task of its own, as a call on a stream does, and its replies and end
    reach the caller directly, without serialising anything or crossing gRPC. Same
    replies, same errors (the `AioRpcError` the call would raise, trailers included),
    same deadline (DEADLINE_EXCEEDED, the handler cancelled); the caller leaving cancels
    the handler, as cancelling a call does. The replies are the handler's own objects:
    neither side changes a message once it is sent (as with a stream, whose copies they
    would be)."""

    def __init__(self, handler: Handler, shape: StreamShape) -> None:
        self._handler = handler
        self._method = shape.plain_method
        self._calls = LOCAL_CALLS.labels(shape.plain_method)

    async def call(self, payload: Any, timeout: float | None, span: Span | None = None) -> AsyncIterator[Any]:
        """`payload`'s replies; `span`: the call's client span, current in the handler
        (the spans it makes are its children, as the server span's would be)."""
        if timeout is not None and timeout <= 0:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        self._calls.inc()
        inbox = _Inbox()
        loop = asyncio.get_running_loop()
        if span is None:
            task = loop.create_task(self._serve(payload, timeout, inbox))
        else:
            with telemetry.current(span):  # the task starts in a copy of this context
                task = loop.create_task(self._serve(payload, timeout, inbox))
        timer = None
        if timeout is not None:

            def expire() -> None:
                inbox.put(_End(code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], message="Deadline Exceeded"))
                task.cancel()

            timer = loop.call_later(timeout, expire)
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, _End):
                    if item.code == 0:
                        return
                    raise _status_error(item)
                yield item
        finally:
            if timer is not None:
                timer.cancel()
            task.cancel()  # no-op once it ended; else the caller left (or ran out of time)

    async def _serve(self, payload: Any, timeout: float | None, inbox: _Inbox) -> None:
        context = PerCallContext(timeout or 0.0)
        try:
            async for item in self._handler(payload, context):
                inbox.put(item)
        except asyncio.CancelledError:
            return  # the caller left, or the deadline passed (the caller was told)
        except Exception as exc:
            code, text, retry, trailers = _failure(exc, self._method)
            end = _End(code=code.value[0], message=fit_status_message(text))
            if retry is not None:
                end.retry_after_s = retry
            end.trailers.update(trailers)
            inbox.put(end)
            return
        inbox.put(_End(code=0))


def drain_all(services: Iterable[str] | None = None) -> None:
    """The service is stopping: every stream takes no new call and ends once its calls
    are done (a caller sees the stream end and sends its next calls elsewhere, as it
    would to a stopping server). `services` ("inferx.v1.Scheduler", ...): only the
    streams of those (a process serving two services stops them one after the other)."""
    wanted = None if services is None else set(services)
    for server in list(_servers):
        if wanted is None or server.service in wanted:
            server.drain()
