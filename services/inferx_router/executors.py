"""The gRPC side of the chain walker: a model hop goes to the scheduler.

The protobuf conversion of a hop happens here and nowhere else in the router."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import grpc

from inferx import telemetry
from inferx.discovery import ChannelPool, ServiceLocator
from inferx.errors import OWNER_KEY, Unavailable, from_rpc_error
from inferx.hopstream import HOPS, StreamPool
from inferx.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from inferx.wire import tier_to_proto
from inferx_router import metrics
from inferx_router.hops import HopDone, ModelHop, WorkerHints
from inferx_router.scheduler_target import Failure, HopAttempts, SchedulerTargets, classify, trailers_of

Event = scheduler_pb2.HopEvent


def hop_request(hop: ModelHop, last_worker: Callable[[str], str] | None = None) -> scheduler_pb2.HopRequest:
    """`last_worker(model)`: where the chain's latest hop in that model's pool ran
    (`WorkerHints`; "" = not known), for the hop and its next hops."""
    last_worker = last_worker or (lambda model: "")
    request = scheduler_pb2.HopRequest(
        context=common_pb2.HopContext(
            run_id=hop.run_id,
            hop_id=hop.hop_id,
            session_id=hop.session_id,
            chain_name=hop.chain_name,
            chain_version=hop.chain_version,
            tier=tier_to_proto(hop.tier),
            priority=hop.priority,
            chain_deadline_unix_ms=hop.deadline_unix_ms,
            hop_index=hop.hop_index,
            remaining_critical_path_ms=hop.remaining_critical_path_ms,
            next_hops=[
                common_pb2.NextHop(
                    hop_id=nxt.hop_id,
                    model=nxt.model,
                    prompt_tokens=nxt.prompt_tokens,
                    max_tokens=nxt.max_tokens,
                    last_worker_id=last_worker(nxt.model) if nxt.model else "",
                )
                for nxt in hop.next_hops
            ],
            last_worker_id=last_worker(hop.model),
            prefix_id=hop.prefix_id,
            prefix_tokens=hop.prefix_tokens,
        ),
        model=hop.model,
        prompt=hop.prompt,
        sampling=common_pb2.SamplingOptions(
            max_tokens=hop.max_tokens,
            temperature=hop.temperature,
            top_p=hop.top_p,
            seed=hop.seed,
            stop=hop.stop,
            response_format_json=hop.response_format_json,
            max_context_tokens=hop.max_context_tokens,
            truncate_context=hop.truncate_context,
        ),
        chat_json=hop.chat_json,
    )
    if hop.remaining_hops is not None:  # unset = unknown (the scheduler's HopView gets None)
        request.context.remaining_hops = hop.remaining_hops
    if hop.kv_retention_s is not None:  # unset = no hint (0 is one: let go at once)
        request.context.kv_retention_s = hop.kv_retention_s
    return request


def _submit_hop(channel: grpc.aio.Channel, request, timeout: float | None) -> AsyncIterator[Event]:
    return scheduler_pb2_grpc.SchedulerStub(channel).SubmitHop(request, timeout=timeout)


def scheduler_streams(channels: ChannelPool, *, enabled: bool = True) -> StreamPool:
    """Hops to schedulers on one multiplexed `Scheduler.Hops` stream per scheduler
    (issue #14: no call set-up per hop), or one `SubmitHop` call each where streams are
    off (--no-hop-streams) or the scheduler has no `Hops`."""
    return StreamPool(
        channels,
        HOPS,
        lambda channel: scheduler_pb2_grpc.SchedulerStub(channel).Hops(),
        _submit_hop,
        enabled=enabled,
    )


class _Resend(Exception):
    """The hop goes to another scheduler (see scheduler_target)."""

    def __init__(self, failure: Failure, named: str) -> None:
        self.failure = failure
        self.named = named


class SchedulerExecutor:
    """Runs model hops through the scheduler that owns their pool (`targets`; without
    it, any scheduler found in etcd), on that scheduler's hop stream (`streams`).
    Each hop carries where its chain's latest hop in the pool ran (`hints`, learned from
    the hops' results): a scheduler new to the chain (after a failover) keeps it there."""

    def __init__(
        self,
        services: ServiceLocator,
        channels: ChannelPool,
        targets: SchedulerTargets | None = None,
        streams: StreamPool | None = None,
        *,
        pool_of: Callable[[str], str] | None = None,
        hints: WorkerHints | None = None,
    ) -> None:
        self._services = services
        self._channels = channels
        self._targets = targets
        self.streams = streams if streams is not None else scheduler_streams(channels)
        self._pool_of = pool_of or (lambda model: model)
        self.hints = hints if hints is not None else WorkerHints()

    async def run_hop(
        self,
        hop: ModelHop,
        timeout_s: float,
        on_dispatched: Callable[[str], None],
        on_text: Callable[[str], None] | None = None,
    ) -> HopDone:
        """`on_text`, when given, gets each piece of text as it arrives (streaming callers)."""
        # No scheduler registered (one restarting, or a lease lapsed under load): wait
        # for one within the hop's time rather than failing the hop at once.
        until = time.monotonic() + timeout_s
        if self._targets is None:
            address = await self._services.wait_pick("scheduler", timeout_s)
        else:
            address = await self._targets.first(hop.model, timeout_s)
        attempts = HopAttempts()
        streamed = [False]
        chain_key, pool, now = hop.session_id or hop.run_id, self._pool_of(hop.model), time.monotonic()
        request = hop_request(hop, lambda model: self.hints.get(chain_key, self._pool_of(model), now))

        def text_out(piece: str) -> None:
            streamed[0] = True
            if on_text is not None:
                on_text(piece)

        while True:
            if address is None:
                raise Unavailable(f"no scheduler registered in etcd within the hop's {timeout_s:.1f} s")
            try:
                done = await self._submit(
                    address,
                    request,
                    hop,
                    until - time.monotonic(),
                    on_dispatched,
                    text_out if on_text else None,
                )
                self.hints.put(chain_key, pool, done.worker_id, time.monotonic())
                return done
            except _Resend as resend:
                if self._targets is None or not attempts.again(resend.failure, streamed=streamed[0]):
                    raise Unavailable(
                        f"scheduler at {address}: the hop could not be placed ({resend.failure.value})"
                    ) from None
                metrics.HOP_RESENDS.labels(resend.failure.value).inc()
                address = await self._targets.after(
                    hop.model, resend.failure, address, resend.named, until - time.monotonic()
                )

    async def _submit(
        self,
        address: str,
        request: scheduler_pb2.HopRequest,
        hop: ModelHop,
        timeout_s: float,
        on_dispatched: Callable[[str], None],
        on_text: Callable[[str], None] | None,
    ) -> HopDone:
        if timeout_s <= 0:
            raise TimeoutError
        spans = telemetry.HopSpans()  # queue wait / dispatch / engine spans from the reported timings
        tier = hop.tier.label
        text: list[str] = []
        done: HopDone | None = None
        try:
            async for event in self.streams.call(address, request, timeout_s):
                if event.restarted and text:  # its first worker failed mid-reply: that text is void
                    if on_text is not None:  # ... but the caller has some of it already
                        raise Unavailable(
                            f"worker {event.worker_id or 'of the hop'} was given the hop again after its "
                            "first worker failed mid-reply, but part of that reply was streamed already"
                        )
                    text.clear()
                if event.text:
                    text.append(event.text)  # each piece of text arrives once (TOKENS, then FINISHED's tail)
                    if on_text is not None:
                        on_text(event.text)
                if event.kind == Event.KIND_DISPATCHED:
                    spans.dispatched()
                    on_dispatched(event.worker_id)
                elif event.kind == Event.KIND_FINISHED:
                    spans.finished(event, tier=tier)
                    metrics.observe_hop(tier, event)
                    usage = event.usage
                    done = HopDone(
                        text="".join(text),
                        worker_id=event.worker_id,
                        pool=event.pool,
                        queue_ms=event.queue_ms,
                        engine_ms=event.engine_ms,
                        ttft_ms=event.ttft_ms,
                        prompt_tokens=usage.prompt_tokens,
                        completion_tokens=usage.completion_tokens,
                        cached_prompt_tokens=usage.cached_prompt_tokens,
                        finish_reason=event.finish_reason,
                    )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError from None
            trailers = trailers_of(exc)
            failure = classify(exc.code(), trailers, exc.details() or "")
            if failure != Failure.OTHER and self._targets is not None:
                raise _Resend(failure, trailers.get(OWNER_KEY, "")) from None
            raise from_rpc_error(exc, target=f"scheduler at {address}") from None
        # The stream is read to its end (not left at FINISHED), so the call and its
        # client span close normally.
        if done is None:
            raise Unavailable(f"scheduler at {address} ended the hop without a result")
        return done
