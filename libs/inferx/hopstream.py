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

Flow control is HTTP/2's, per stream: a writer waits for the window, and with it the
handler that produces (each handler writes its own replies, in order).

Tracing: these streams are for the untraced path. With tracing on, callers use the
plain calls, whose per-call spans (and the trace context in their metadata) are what
the traces show (`inferx.telemetry`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from prometheus_client import Counter

from inferx import telemetry
from inferx.discovery import ChannelPool
from inferx.errors import RETRY_AFTER_KEY, InferxError, fit_status_message
from inferx.v1 import common_pb2

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


class StreamClient:
    """One multiplexed stream to one peer, opened on first use and re-opened after a break.

    `open_stream()` starts the bidirectional call (e.g. `SchedulerStub(ch).Hops`);
    `request_cls(tag=, <payload_field>=, cancel=, timeout_s=)` is its request message;
    replies carry `tag`, `<reply_field>` and, on a call's last one, `status`."""

    def __init__(
        self,
        open_stream: Callable[[], grpc.aio.StreamStreamCall],
        request_cls: type,
        payload_field: str,
        reply_field: str,
        peer: str,
    ) -> None:
        self._open_stream = open_stream
        self._request_cls = request_cls
        self._payload_field = payload_field
        self._reply_field = reply_field
        self.peer = peer
        self.supported = True  # False once the peer answered UNIMPLEMENTED
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, _Inbox] = {}
        self._tags = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self.opened = 0  # streams opened so far (tests, diagnostics)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def _ensure_open(self) -> grpc.aio.StreamStreamCall:
        if self._call is None:
            call = self._open_stream()
            self._call = call
            self.opened += 1
            self._reader = asyncio.get_running_loop().create_task(self._read(call))
        return self._call

    async def call(self, payload: Any, timeout: float | None) -> AsyncIterator[Any]:
        """Send `payload` and yield its replies; raises as the plain call would."""
        if not self.supported:
            raise StreamUnsupported(self.peer)
        loop = asyncio.get_running_loop()
        call = self._ensure_open()
        tag = next(self._tags)
        inbox = _Inbox()
        self._pending[tag] = inbox
        timer = None
        if timeout is not None:
            if timeout <= 0:
                self._pending.pop(tag, None)
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            timer = loop.call_later(timeout, self._expire, tag)
        ended = False
        replied = False
        try:
            request = self._request_cls(tag=tag, timeout_s=timeout or 0.0)
            getattr(request, self._payload_field).CopyFrom(payload)
            await self._write(call, request)
            while True:
                item = await inbox.get()
                if isinstance(item, _End):
                    ended = True
                    if item.code == 0:
                        return
                    if item.code == grpc.StatusCode.UNIMPLEMENTED.value[0] and not replied:
                        raise StreamUnsupported(item.message)
                    raise _status_error(item)
                replied = True
                yield item
        finally:
            if timer is not None:
                timer.cancel()
            if self._pending.pop(tag, None) is not None and not ended and self._call is call:
                # The caller left first (cancelled, deadline, stopped reading): tell the
                # peer, as cancelling the call would, without making the caller wait.
                task = loop.create_task(self._cancel(call, tag))
                _background.add(task)
                task.add_done_callback(_background.discard)

    def _expire(self, tag: int) -> None:
        inbox = self._pending.get(tag)
        if inbox is not None:
            inbox.put(_End(code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], message="Deadline Exceeded"))

    async def _cancel(self, call: grpc.aio.StreamStreamCall, tag: int) -> None:
        try:
            await self._write(call, self._request_cls(tag=tag, cancel=True))
        except grpc.aio.AioRpcError:
            pass  # the stream broke: the peer cancels everything on it anyway

    async def _write(self, call: grpc.aio.StreamStreamCall, request: Any) -> None:
        try:
            async with self._write_lock:
                await call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            # The stream is gone; its reader fails every call on it (this one too).
            # Raise what the reader will report, should it not have run yet.
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._broken(call, exc)
                raise StreamUnsupported(detail or "") from None
            self._broken(call, exc)
            raise rpc_error(
                grpc.StatusCode.UNAVAILABLE, f"hop stream to {self.peer} broke: {detail}"
            ) from None

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        reason: BaseException | None = None
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    break
                inbox = self._pending.get(message.tag)
                if inbox is None:
                    continue  # a call this side gave up
                if message.HasField(self._reply_field):
                    inbox.put(getattr(message, self._reply_field))
                if message.HasField("status"):
                    self._pending.pop(message.tag, None)
                    inbox.put(message.status)
        except grpc.aio.AioRpcError as exc:
            reason = exc
        except asyncio.CancelledError:
            reason = None
            raise
        except Exception as exc:  # a bug: fail the calls rather than hang them
            log.exception("hop stream reader to %s failed", self.peer)
            reason = exc
        finally:
            self._broken(call, reason)

    def _broken(self, call: grpc.aio.StreamStreamCall, reason: BaseException | None) -> None:
        """The stream `call` ended: fail what is still on it; the next call opens a new one."""
        current = self._call
        if current is None or current is not call:
            return
        self._call = None
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
        current.cancel()
        pending, self._pending = self._pending, {}
        if isinstance(reason, grpc.aio.AioRpcError) and reason.code() == grpc.StatusCode.UNIMPLEMENTED:
            self.supported = False
            end = _End(code=grpc.StatusCode.UNIMPLEMENTED.value[0], message=reason.details() or "")
        else:
            detail = reason.details() if isinstance(reason, grpc.aio.AioRpcError) else str(reason or "ended")
            end = _End(
                code=grpc.StatusCode.UNAVAILABLE.value[0],
                message=f"hop stream to {self.peer} broke: {detail}",
            )
        for inbox in pending.values():
            inbox.put(end)

    async def close(self) -> None:
        call = self._call
        if call is not None:
            self._broken(call, None)


_background: set[asyncio.Task[None]] = set()

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
    off (`enabled`: the service's --hop-streams and not tracing, whose spans are per
    call) or the peer has no stream method."""

    def __init__(
        self,
        channels: ChannelPool,
        open_stream: Callable[[grpc.aio.Channel], grpc.aio.StreamStreamCall],
        plain: PlainCall,
        request_cls: type,
        payload_field: str,
        reply_field: str,
        *,
        enabled: bool | None = None,
    ) -> None:
        self._channels = channels
        self._open_stream = open_stream
        self._plain = plain
        self._request_cls = request_cls
        self._payload_field = payload_field
        self._reply_field = reply_field
        # None: on unless this process traces (its spans are per call).
        self.enabled = not telemetry.enabled() if enabled is None else enabled
        self.clients: dict[str, StreamClient] = {}

    def client(self, address: str) -> StreamClient:
        client = self.clients.get(address)
        if client is None:
            client = StreamClient(
                lambda: self._open_stream(self._channels.get(address)),
                self._request_cls,
                self._payload_field,
                self._reply_field,
                address,
            )
            self.clients[address] = client
        return client

    async def call(self, address: str, payload: Any, timeout: float | None) -> AsyncIterator[Any]:
        """`payload`'s replies from the peer at `address`; raises as the plain call would."""
        if self.enabled:
            client = self.client(address)
            if client.supported:
                try:
                    async for reply in client.call(payload, timeout):
                        yield reply
                    return
                except StreamUnsupported:  # raised before any reply: nothing was sent twice
                    log.info("%s has no multiplexed stream method: one call per request", address)
        async for reply in self._plain(self._channels.get(address), payload, timeout):
            yield reply

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
        self.clients.clear()


class PerCallContext:
    """What a plain call's handler reads from its context, for one multiplexed call."""

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
    """Serves one multiplexed stream: each request runs `handler` in a task of its own."""

    def __init__(
        self,
        context: grpc.aio.ServicerContext,
        handler: Handler,
        reply_cls: type,
        payload_field: str,
        reply_field: str,
        method: str,
    ) -> None:
        self._context = context
        self._handler = handler
        self._reply_cls = reply_cls
        self._payload_field = payload_field
        self._reply_field = reply_field
        self._method = method
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._write_lock = asyncio.Lock()
        self._draining = False
        self._ended = False  # the caller half-closed: no more requests
        self._finished = asyncio.Event()
        STREAMS_OPENED.labels(method).inc()
        self._calls = STREAM_CALLS.labels(method)  # the child once, not a label lookup per call

    async def serve(self) -> None:
        """Until the caller half-closes or the service drains, and then until the calls
        on the stream are done; cancelling this (the caller went away) cancels them all."""
        _servers.add(self)
        reader = asyncio.get_running_loop().create_task(self._read_requests())
        try:
            await self._finished.wait()
        finally:
            _servers.discard(self)
            reader.cancel()
            for task in list(self._tasks.values()):
                task.cancel()

    async def _read_requests(self) -> None:
        try:
            while True:
                message = await self._context.read()
                if message is grpc.aio.EOF:
                    break
                self._on_request(message)
        finally:  # half-closed, or the stream broke: no more requests
            self._ended = True
            self._check_finished()

    def _check_finished(self) -> None:
        if (self._ended or self._draining) and not self._tasks:
            self._finished.set()

    def _on_request(self, message: Any) -> None:
        tag = message.tag
        if message.cancel:
            task = self._tasks.get(tag)
            if task is not None:
                task.cancel()
            return
        if not message.HasField(self._payload_field):
            return
        if self._draining:  # as a stopping server refuses a new call
            self._send_end_soon(tag, grpc.StatusCode.UNAVAILABLE, f"{self._method}: the service is stopping")
            return
        if tag in self._tasks:
            self._send_end_soon(tag, grpc.StatusCode.INVALID_ARGUMENT, f"tag {tag} is in use on this stream")
            return
        payload = getattr(message, self._payload_field)
        self._calls.inc()
        self._tasks[tag] = asyncio.get_running_loop().create_task(self._run(tag, payload, message.timeout_s))

    def _send_end_soon(self, tag: int, code: grpc.StatusCode, text: str) -> None:
        task = asyncio.get_running_loop().create_task(self._end(tag, code, text))
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def _run(self, tag: int, payload: Any, timeout_s: float) -> None:
        code, text, retry = grpc.StatusCode.OK, "", None
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
        try:
            async for item in self._handler(payload, context):
                reply = self._reply_cls(tag=tag)
                getattr(reply, self._reply_field).CopyFrom(item)
                await self._write(reply)
        except asyncio.CancelledError:
            cancelled = True
        except InferxError as exc:
            code, text, retry = exc.code, exc.message, exc.retry_after_s
        except grpc.aio.AioRpcError as exc:  # a handler that lets its own call's error through
            code, text = exc.code(), exc.details() or ""
        except Exception as exc:
            log.exception("unhandled error in %s", self._method)
            code, text = grpc.StatusCode.INTERNAL, f"internal error in {self._method}: {exc}"
        finally:
            if timer is not None:
                timer.cancel()
            self._tasks.pop(tag, None)
        if cancelled:
            if not expired:  # by the caller (who expects nothing more) or the stream's end
                self._check_finished()
                return
            code, text = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"  # as a call's
        await self._end(tag, code, text, retry)
        self._check_finished()

    async def _end(
        self, tag: int, code: grpc.StatusCode, text: str, retry_after_s: float | None = None
    ) -> None:
        status = common_pb2.StreamStatus(code=code.value[0], message=fit_status_message(text))
        if retry_after_s is not None:
            status.retry_after_s = retry_after_s
        reply = self._reply_cls(tag=tag)
        reply.status.CopyFrom(status)
        try:
            await self._write(reply)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError):
            pass  # the stream is gone, and the caller with it

    async def _write(self, reply: Any) -> None:
        async with self._write_lock:
            await self._context.write(reply)

    def drain(self) -> None:
        """Take no new call on this stream; end it once the calls on it are done."""
        if self._draining:
            return
        self._draining = True
        self._check_finished()


def drain_all() -> None:
    """The service is stopping: every stream takes no new call and ends once its calls
    are done (a caller sees the stream end and sends its next calls elsewhere, as it
    would to a stopping server)."""
    for server in list(_servers):
        server.drain()
