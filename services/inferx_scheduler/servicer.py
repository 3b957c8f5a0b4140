"""Scheduler gRPC servicer: queue a hop, wait for a worker slot, reserve KV, stream
the worker's output back, release everything on the way out (also on failure).

A hop's KV is reserved from the scheduler's leased budget (`budget_sync.KvBudget`) with
no call when it fits, and from the memory-pool (Reserve, then Release) when it does not."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

import grpc

from inferx import hopstream, telemetry
from inferx.discovery import ChannelPool, ServiceLocator
from inferx.errors import (
    OWNER_KEY,
    InvalidArgument,
    NoOwner,
    NotOwner,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
)
from inferx.metric_children import child
from inferx.partitions import PartitionElector
from inferx.pools import no_worker_message
from inferx.scheduling.engine_fit import EngineSample
from inferx.scheduling.queue import QueuedHop, QueueFull, Rejected
from inferx.scheduling.views import HopView, Tier
from inferx.v1 import (
    common_pb2,
    memory_pool_pb2,
    memory_pool_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from inferx.wire import tier_to_proto
from inferx_scheduler import metrics
from inferx_scheduler.budget import HOP
from inferx_scheduler.budget_sync import KvBudget
from inferx_scheduler.codec import hop_view, next_hop_views
from inferx_scheduler.dispatcher import HopDispatcher
from inferx_scheduler.health import WorkerHealth
from inferx_scheduler.lookahead import AheadHold, LookAhead

log = logging.getLogger("inferx.scheduler")

Event = scheduler_pb2.HopEvent


@dataclass(frozen=True)
class Hold:
    """A hop's KV reservation: from the local budget, or made at the memory-pool
    `address` (released there)."""

    reservation_id: str
    local: bool = False
    address: str = ""


@dataclass
class _HopOutcome:
    context_tokens: int = 0  # what the hop left in its worker's prefix cache
    service_s: float = 0.0
    engine: EngineSample | None = None  # what the worker reported of its engine's speed


def _engine_sample(finished: scheduler_pb2.HopEvent) -> EngineSample | None:
    """What a hop's FINISHED event says of its engine's speed (None: it reported no times)."""
    if finished.engine_ms <= 0 or finished.ttft_ms <= 0:
        return None
    usage = finished.usage
    return EngineSample(
        prefill_tokens=max(usage.prompt_tokens - usage.cached_prompt_tokens, 0),
        ttft_s=finished.ttft_ms / 1000,
        output_tokens=usage.completion_tokens,
        decode_s=max(finished.engine_ms - finished.ttft_ms, 0.0) / 1000,
    )


@dataclass(frozen=True)
class _ContextBlocks:
    """Passed up from a worker's last chunk (not sent to the caller): the block keys
    of the hop's prompt + output, as the worker's KV events key them."""

    blocks: tuple[tuple[str, int], ...]


class WorkerFailed(Unavailable):
    """The worker failed the hop itself (gone, crashed, refused): try another worker."""


# The status of a worker call that says "this worker", not "this request", failed:
# it is gone, draining, or its engine died. Other codes fail the hop, not the worker.
WORKER_FAULTS = {grpc.StatusCode.UNAVAILABLE}


def _generate(channel: grpc.aio.Channel, request, timeout: float | None):
    return worker_pb2_grpc.ModelWorkerStub(channel).Generate(request, timeout=timeout)


def worker_streams(channels: ChannelPool, *, enabled: bool = True) -> hopstream.StreamPool:
    """Hops to workers on one multiplexed `ModelWorker.GenerateStream` per worker, or one
    `Generate` call each where streams are off (--no-hop-streams) or the worker has none."""
    return hopstream.StreamPool(
        channels,
        hopstream.GENERATE,
        lambda channel: worker_pb2_grpc.ModelWorkerStub(channel).GenerateStream(),
        _generate,
        enabled=enabled,
    )


class ReplyRestarts:
    """A hop's events across its dispatches: the text a failed worker sent before the
    hop was re-dispatched is void, and the new dispatch's DISPATCHED says so
    (`restarted`), so the caller drops that text rather than joining two replies."""

    def __init__(self) -> None:
        self._text_sent = False  # since the hop's latest DISPATCHED

    def mark(self, event: scheduler_pb2.HopEvent) -> scheduler_pb2.HopEvent:
        if event.kind == Event.KIND_DISPATCHED:
            event.restarted = self._text_sent
            self._text_sent = False
        elif event.text:
            self._text_sent = True
        return event


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        dispatcher: HopDispatcher,
        services: ServiceLocator,
        channels: ChannelPool,
        reserve_kv: bool,
        health: WorkerHealth,
        max_redispatch: int = 2,
        *,
        holder: str = "",
        lookahead: LookAhead | None = None,
        max_kv_wait_s: float = 120.0,
        budget: KvBudget | None = None,
        hop_streams: bool = True,
        partitions: PartitionElector | None = None,
    ) -> None:
        self._dispatcher = dispatcher
        self._partitions = partitions
        self._directory = dispatcher.directory
        self._services = services
        self._channels = channels
        self._reserve_kv = reserve_kv
        self._health = health
        self._max_redispatch = max_redispatch
        self._holder = holder  # this instance: the memory-pool drops our reservations if it dies
        self._lookahead = lookahead if reserve_kv else None
        self._max_kv_wait_s = max_kv_wait_s
        self._budget = budget if reserve_kv else None
        # A reservation from the budget makes no call, so no RPC span shows it: with
        # tracing on, a "kv reserve" span does (off: not even a no-op span per hop).
        self._traced = telemetry.enabled()
        self._releases: set[asyncio.Task[None]] = set()  # releases still on their way
        # Hops to workers on one GenerateStream per worker (issue #14), else a call each.
        self.worker_streams = worker_streams(channels, enabled=hop_streams)

    async def Hops(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        """SubmitHop's hops, many on one stream (`inferx.hopstream`)."""
        await hopstream.StreamServer(context, self.SubmitHop, hopstream.HOPS).serve()

    async def SubmitHop(self, request: scheduler_pb2.HopRequest, context: grpc.aio.ServicerContext):
        if not request.model:
            raise InvalidArgument("model: must not be empty")
        if not request.prompt:
            raise InvalidArgument("prompt: must not be empty")
        pool = self._directory.pool_of(request.model)
        if not self._directory.workers_for(request.model):
            raise Unavailable(no_worker_message(request.model, pool))
        await self._check_owner(pool)
        view = hop_view(pool, request, self._dispatcher.token_ratio(pool))  # the hop's facts, worked out once
        # The chain's context the prompt starts with: its blocks, as keyed in the workers'
        # KV events, say exactly where that context is cached (for a policy that reads them).
        if self._dispatcher.reads_prompt_blocks:
            blocks = self._dispatcher.contexts.get(pool, view.chain_key, request.prompt)
            if blocks:
                view = replace(view, prompt_blocks=blocks)
        # Room a look-ahead kept for this hop: its own reservation replaces that one.
        ahead = self._lookahead.take(view) if self._lookahead is not None else None
        # A worker that dies or fails mid-hop costs a re-dispatch to another one of the
        # pool, not the hop: its breaker keeps new hops away from it meanwhile.
        restarts = ReplyRestarts()
        for attempt in range(self._max_redispatch + 1):
            try:
                async for event in self._dispatch_once(request, view, context, ahead):
                    yield restarts.mark(event)
                return
            except WorkerFailed as exc:
                remaining = context.time_remaining()
                if attempt == self._max_redispatch or (remaining is not None and remaining < 0.05):
                    raise
                metrics.REDISPATCHES.labels(pool).inc()
                log.warning("re-dispatching %s/%s: %s", request.context.run_id, request.context.hop_id, exc)

    async def _check_owner(self, pool: str) -> None:
        """Serve a pool's hops only while this instance owns it: two schedulers taking
        the same pool would each hold half of its chains' affinity and of its workers'
        load. A hop for a pool nobody owns makes this instance campaign for it (if it
        may serve it); otherwise the answer names the owner, so the router re-resolves."""
        elector = self._partitions
        if elector is None or await elector.confirm(pool):
            return
        owner = elector.table.owner(pool)
        if owner is None and await elector.campaign(pool):
            return
        owner = elector.table.owner(pool)
        if owner is None or owner.instance_id == elector.instance_id:  # ours under a lapsed lease
            metrics.NOT_OWNER.labels(pool, "no_owner").inc()
            raise NoOwner(f"no scheduler owns pool '{pool}' yet (an election is under way); retry")
        metrics.NOT_OWNER.labels(pool, "redirected").inc()
        raise NotOwner(
            f"scheduler {elector.instance_id} does not own pool '{pool}': "
            f"{owner.instance_id} at {owner.address} does",
            owner_address=owner.address,
        )

    async def _dispatch_once(
        self, request, view: HopView, context: grpc.aio.ServicerContext, ahead: AheadHold | None = None
    ):
        pool = view.pool
        try:
            hop, assigned = self._dispatcher.submit(view)
        except QueueFull as exc:
            metrics.SHED.labels(pool).inc()
            raise ResourceExhausted(str(exc), retry_after_s=1.0) from None
        except Rejected as exc:
            metrics.SHED.labels(pool).inc()
            raise ResourceExhausted(str(exc), retry_after_s=exc.retry_after_s) from None
        outcome = _HopOutcome()
        try:
            try:
                worker_id = await assigned
            except asyncio.CancelledError:
                self._dispatcher.cancel(hop)
                raise
            queue_ms = (time.monotonic() - hop.enqueued_at) * 1000
            child(metrics.QUEUE_WAIT_SECONDS, pool).observe(queue_ms / 1000)
            child(metrics.DISPATCHES, pool, worker_id).inc()
            worker = self._directory.workers_by_pool.get(pool, {}).get(worker_id)
            if worker is None:
                raise WorkerFailed(f"worker {worker_id} of pool '{pool}' left before the hop started")
            yield Event(kind=Event.KIND_DISPATCHED, worker_id=worker_id, queue_ms=queue_ms, pool=pool)
            if ahead is not None:
                metrics.LOOKAHEAD.labels(pool, "used" if ahead.worker_id == worker_id else "moved").inc()
            if self._lookahead is not None:
                self._lookahead.start(view, self._next_hops(view, request), context.time_remaining())
            # The engine orders by the policy's priority (vLLM runs with priority
            # scheduling); baseline sends 0 to every hop, so the engine is FCFS.
            # The prompt is copied once, into the worker's request; only the small
            # context is copied to carry the policy's engine priority.
            hop_context = common_pb2.HopContext()
            hop_context.CopyFrom(request.context)
            hop_context.priority = hop.engine_priority
            generate = worker_pb2.GenerateRequest(
                context=hop_context,
                prompt=request.prompt,
                sampling=request.sampling,
                chat_json=request.chat_json,  # a chat for the worker's template, passed on as it came
                # The context's blocks only for a policy that reads them (exact prefix).
                skip_context_blocks=not self._dispatcher.reads_prompt_blocks,
            )
            # The hop's output, kept (for a policy that reads contexts) to tell which
            # later prompts start with this hop's context.
            output: list[str] | None = [] if self._dispatcher.reads_prompt_blocks else None
            blocks: tuple[tuple[str, int], ...] = ()
            try:
                async for event in self._run_on_worker(
                    generate, view, worker.address, worker_id, queue_ms, context, ahead
                ):
                    if isinstance(event, _ContextBlocks):
                        blocks = event.blocks
                        continue
                    if output is not None:
                        output.append(event.text)
                    if event.kind == Event.KIND_FINISHED:
                        outcome.context_tokens = event.usage.prompt_tokens + event.usage.completion_tokens
                        self._dispatcher.counted_tokens(pool, len(request.prompt), event.usage.prompt_tokens)
                        outcome.service_s = event.engine_ms / 1000
                        outcome.engine = _engine_sample(event)
                        if output is not None:
                            text = request.prompt + "".join(output)
                            self._dispatcher.contexts.put(pool, view.chain_key, text, blocks)
                    yield event
            except WorkerFailed:
                self._health.hop_failed(worker_id)
                raise
            self._health.hop_succeeded(worker_id)
        finally:
            # The caller has the hop's last event already; the policy's bookkeeping of
            # its end (slot freed, KV hold priced, the next queued hop dispatched) runs
            # in the loop's next turn, after the caller's task has taken the reply on
            # (issue #16: ~90 us of a program call's wall time on a 2-core box). It
            # still runs before any hop submitted after this reply: their tasks start
            # later in the same queue.
            asyncio.get_running_loop().call_soon(self._hop_ended, hop, view, outcome)

    def _hop_ended(self, hop: QueuedHop, view: HopView, outcome: _HopOutcome) -> None:
        self._dispatcher.finished(hop, outcome.context_tokens, outcome.service_s, outcome.engine)
        if view.kv_retention_s is not None:  # what the policy made of the client's hint (on_finish)
            metrics.KV_RETENTION_HINTS.labels(view.pool, hop.retention_hint or "not_applied").inc()

    def _next_hops(self, view: HopView, request: scheduler_pb2.HopRequest) -> list[HopView]:
        def pool_of(model: str) -> str | None:
            return self._directory.pool_of(model) if self._directory.workers_for(model) else None

        return next_hop_views(view, request, pool_of, self._dispatcher.token_ratio)

    async def _run_on_worker(
        self,
        request: worker_pb2.GenerateRequest,
        view: HopView,
        address,
        worker_id,
        queue_ms,
        context,
        ahead=None,
    ):
        pool = view.pool
        if self._traced:
            with telemetry.span(
                "kv reserve", {"inferx.worker": worker_id, "inferx.kv_tokens": view.kv_tokens}
            ) as span:
                reservation = await self._reserve(worker_id, view, context, ahead)
                source = "none" if reservation is None else "budget" if reservation.local else "memory-pool"
                span.set_attribute("inferx.kv.reserved_from", source)
        else:
            reservation = await self._reserve(worker_id, view, context, ahead)
        remaining = context.time_remaining()
        try:
            async for chunk in self.worker_streams.call(address, request, remaining):
                # Each piece of text crosses once: TOKENS as it comes, FINISHED only
                # with what the worker's last chunk carried (the caller joins them).
                if not chunk.finished:
                    yield Event(kind=Event.KIND_TOKENS, text=chunk.text, worker_id=worker_id)
                    continue
                if chunk.context_blocks:
                    yield _ContextBlocks(tuple((b.key, b.tokens) for b in chunk.context_blocks))
                yield Event(
                    kind=Event.KIND_FINISHED,
                    worker_id=worker_id,
                    pool=pool,
                    text=chunk.text,
                    usage=chunk.usage,
                    queue_ms=queue_ms,
                    engine_ms=chunk.engine_ms,
                    ttft_ms=chunk.ttft_ms,
                    finish_reason=chunk.finish_reason,
                )
        except grpc.aio.AioRpcError as exc:
            metrics.HOP_ERRORS.labels(pool, exc.code().name).inc()
            if exc.code() in WORKER_FAULTS:
                raise WorkerFailed(f"worker {worker_id} ({address}): {exc.details()}") from None
            error = from_rpc_error(exc, target=f"worker {worker_id} ({address})")
            error.message = f"worker {worker_id}: {error.message}"
            raise error from None
        finally:
            self._release_soon(reservation)

    async def _reserve(
        self, worker_id: str, view: HopView, context, ahead: AheadHold | None = None
    ) -> Hold | None:
        """Reserve the hop's KV before it runs (replacing the look-ahead reservation kept
        for it, if any): from the leased budget when it fits, else at the memory-pool. A
        refusal there (no room, or usage above the high mark for non-realtime work)
        makes the hop wait for room within its deadline, then gives up with
        RESOURCE_EXHAUSTED; a memory-pool that cannot be reached makes the scheduler
        conservative (half concurrency) but does not stop the hop."""
        if not self._reserve_kv:
            return None
        local_ahead = ahead.reservation_id if ahead is not None and ahead.local else ""
        remote_ahead = ahead.reservation_id if ahead is not None and not ahead.local else ""
        hold = self._reserve_local(worker_id, view, local_ahead, remote_ahead)
        if hold is not None:
            return hold
        address = self._services.pick("memory-pool")
        if address is None:
            self._set_conservative(True, "no memory-pool is registered")
            self._release_local(local_ahead)
            return None
        stub = memory_pool_pb2_grpc.MemoryPoolStub(self._channels.get(address))
        message = memory_pool_pb2.ReserveRequest(
            worker_id=worker_id,
            tokens=view.kv_tokens,
            run_id=view.run_id,
            hop_id=view.hop_id,
            tier=tier_to_proto(view.tier),
            holder=self._holder,
            kind=memory_pool_pb2.RESERVATION_KIND_HOP,
            replaces=remote_ahead,
        )
        waited, delay = 0.0, 0.05
        redirected = False
        while True:
            try:
                reply = await stub.Reserve(message, timeout=2.0)
                self._set_conservative(False, "")
                self._release_local(local_ahead)  # the hop's own reservation covers it now
                return Hold(reply.reservation_id, address=address)
            except grpc.aio.AioRpcError as exc:
                owner = dict(exc.trailing_metadata() or ()).get(OWNER_KEY)
                if owner and not redirected:
                    # Not the ledger (it moved since our watch saw it): the one named is.
                    redirected, address = True, str(owner)
                    stub = memory_pool_pb2_grpc.MemoryPoolStub(self._channels.get(address))
                    continue
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._set_conservative(True, f"memory-pool: {exc.code().name}")
                    self._release_local(local_ahead)
                    return None
                # No room now: wait for it, as an engine queues a request it has no
                # KV for, for as long as the hop's own deadline allows (bounded by
                # max_kv_wait_s when the caller set none). Failing fast here would turn
                # a momentary peak into lost hops.
                remaining = context.time_remaining()
                budget = (
                    self._max_kv_wait_s if remaining is None else min(self._max_kv_wait_s, remaining - 0.1)
                )
                if waited + delay > budget:
                    raise ResourceExhausted(f"KV memory: {exc.details()}", retry_after_s=1.0) from None
                await asyncio.sleep(delay)
                waited += delay
                delay = min(delay * 2, 0.5)
                # Room may have come back to the budget meanwhile (a release, a grant).
                hold = self._reserve_local(worker_id, view, local_ahead, remote_ahead)
                if hold is not None:
                    return hold

    def _reserve_local(
        self, worker_id: str, view: HopView, local_ahead: str, remote_ahead: str
    ) -> Hold | None:
        """The hop's KV from the leased budget (no call), or None when it does not fit."""
        if self._budget is None:
            return None
        res = self._budget.reserve(
            worker_id,
            view.kv_tokens,
            kind=HOP,
            protected=view.tier == Tier.REALTIME,
            replaces=local_ahead,
            run_id=view.run_id,
            hop_id=view.hop_id,
        )
        if res is None:
            return None
        if remote_ahead:  # room kept at the memory-pool that this hop no longer needs
            self._release_soon(Hold(remote_ahead))
        return Hold(res.reservation_id, local=True)

    def _release_local(self, reservation_id: str) -> None:
        if reservation_id and self._budget is not None:
            self._budget.release(reservation_id)

    def _set_conservative(self, on: bool, why: str) -> None:
        if on != self._dispatcher.conservative:
            if on:
                log.warning("conservative admission (half concurrency): %s", why)
            else:
                log.info("memory-pool reachable again: full concurrency")
            self._dispatcher.conservative = on

    def _release_soon(self, hold: Hold | None) -> None:
        """Release the hop's reservation: a local one at once (no call); one made at the
        memory-pool without holding the hop's stream open for its reply: the router
        reads a hop's stream to its end, so an awaited Release was one more round trip
        on every hop's critical path (issue #14: ~0.9 ms of ~4.3 ms per hop on a 2-core
        box). The request is sent at once, before the chain's next hop can reserve, and
        a refusal in the meantime only makes that hop wait for room.
        `drain_releases` lets the scheduler's shutdown finish them."""
        if hold is None or not hold.reservation_id:
            return
        if hold.local:
            self._release_local(hold.reservation_id)
            return
        task = asyncio.create_task(self._release(hold))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def drain_releases(self) -> None:
        """Wait for the releases still on their way (each is bounded by its timeout)."""
        if self._releases:
            await asyncio.gather(*list(self._releases), return_exceptions=True)

    async def _release(self, hold: Hold) -> None:
        address = hold.address or self._services.pick("memory-pool")  # where it was made
        if address is None:
            return
        stub = memory_pool_pb2_grpc.MemoryPoolStub(self._channels.get(address))
        try:
            await stub.Release(
                memory_pool_pb2.ReleaseRequest(reservation_id=hold.reservation_id), timeout=2.0
            )
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "release of %s failed (%s); it expires on its own", hold.reservation_id, exc.details()
            )

    async def GetSchedulerStatus(self, request, context):
        queue = self._dispatcher.queue
        index = self._dispatcher.prefix_index
        pools = sorted(set(queue.pools()) | set(self._directory.workers_by_pool))
        reply = scheduler_pb2.SchedulerStatus(
            policy=queue.policy_name,
            conservative=self._dispatcher.conservative,
            chain_contexts=len(self._dispatcher.contexts),
        )
        if self._partitions is not None:
            # Only the pools this instance owns: another owner answers for the others.
            pools = [pool for pool in pools if self._partitions.owns(pool)]
        reply.worker_breakers.update(self._health.states())
        reply.model_to_pool.update(self._directory.model_to_pool)
        for pool in pools:
            status = reply.pools.add(pool=pool, queued=queue.queued(pool), running=queue.running(pool))
            for worker in self._directory.workers_by_pool.get(pool, {}).values():
                status.workers.add(
                    worker=worker,
                    in_flight=queue.in_flight(worker.worker_id),
                    dispatched_total=queue.dispatched(worker.worker_id),
                    kv_events_live=index.knows(worker.worker_id),
                    kv_blocks_indexed=index.blocks_of(worker.worker_id),
                    kv_tokens_indexed=index.tokens_of(worker.worker_id),
                )
        return reply
