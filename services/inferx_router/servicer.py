"""Router gRPC servicer: the public API. Thin: validate -> domain code -> protobuf."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import grpc

from inferx.chain.plan import LearnedLatency
from inferx.chain.validate import load_chain_text, required_inputs
from inferx.discovery import ChannelPool, ServiceLocator
from inferx.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from inferx.limits import RequestLimits
from inferx.pools import PoolDirectory, no_worker_message
from inferx.v1 import (
    memory_pool_pb2,
    memory_pool_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from inferx_router import records
from inferx_router.chain_store import ChainStore, StoredVersion
from inferx_router.executors import SchedulerExecutor
from inferx_router.load import LoadMonitor
from inferx_router.runner import ChainRun
from inferx_router.tools import ToolRouter, cache_key, stale_key

log = logging.getLogger("inferx.router")


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        store: ChainStore,
        directory: PoolDirectory,
        services: ServiceLocator,
        channels: ChannelPool,
        tools: ToolRouter,
        load: LoadMonitor | None = None,
        max_active_runs: int = 256,
        request_limits: RequestLimits | None = None,
    ) -> None:
        self._store = store
        self._directory = directory
        self._services = services
        self._channels = channels
        self._tools = tools
        self._load = load
        self._max_active_runs = max_active_runs
        self._request_limits = request_limits or RequestLimits()
        self._active_runs = 0
        self._executor = SchedulerExecutor(services, channels)
        # Expected node latencies, learned from this router's finished nodes.
        self._latency = LearnedLatency()

    # ----- running chains -----------------------------------------------------------

    def _check_inputs(self, chain: StoredVersion, given: dict[str, str]) -> dict[str, str]:
        config = chain.config
        inputs = dict(given)
        for name in inputs:
            if not name.isidentifier():
                raise InvalidArgument(f"input '{name}': names are letters, digits and '_'")
        if config.inputs:
            unknown = sorted(set(inputs) - set(config.inputs))
            if unknown:
                raise InvalidArgument(
                    f"input '{unknown[0]}': chain '{config.name}' takes {', '.join(sorted(config.inputs))}"
                )
            for name, spec in config.inputs.items():
                if name not in inputs and spec.default is not None:
                    inputs[name] = spec.default
        for name in required_inputs(config):
            if name not in inputs:
                raise InvalidArgument(
                    f"input '{name}': required by chain '{config.name}' (pass --input {name}=...)"
                )
        return inputs

    def _check_workers(self, chain: StoredVersion) -> None:
        for node in chain.config.nodes:
            if node.kind.is_model and not self._directory.workers_for(node.model or ""):
                raise Unavailable(
                    no_worker_message(node.model or "", self._directory.pool_of(node.model or ""))
                )

    async def RunChain(self, request: router_pb2.RunChainRequest, context: grpc.aio.ServicerContext):
        # Backpressure: never hold more runs than configured; the caller retries later.
        if self._active_runs >= self._max_active_runs:
            raise ResourceExhausted(
                f"the router is running {self._active_runs} chains (its limit); retry shortly",
                retry_after_s=1.0,
            )
        self._request_limits.check_inputs(request.inputs)
        chain = await self._store.resolve(request.chain, request.version, request.label)
        inputs = self._check_inputs(chain, dict(request.inputs))
        self._check_workers(chain)
        if request.tier not in (0, 1, 2, 3):
            raise InvalidArgument(f"tier: unknown value {request.tier}")
        run = ChainRun(
            chain,
            inputs,
            session_id=request.session_id,
            tier=request.tier,
            executor=self._executor,
            tools=self._tools,
            load=self._load,
            latency=self._latency,
        )
        self._active_runs += 1
        task = asyncio.create_task(run.run(), name=f"run:{run.run_id}")
        task.add_done_callback(lambda _: self._release_run())
        try:
            while (event := await run.events.get()) is not None:
                yield event
            await task
        finally:
            if not task.done():  # the caller went away: stop the run's hops too
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _release_run(self) -> None:
        self._active_runs -= 1

    # ----- chain configs ------------------------------------------------------------

    async def ValidateChain(self, request, context):
        validated = load_chain_text(request.config, source="config", limits=self._request_limits)
        return router_pb2.ValidateChainResponse(name=validated.config.name, warnings=validated.warnings)

    async def PutChain(self, request, context):
        if not request.config.strip():
            raise InvalidArgument("config: must not be empty")
        stored, active = await self._store.put(
            request.config,
            message=request.message,
            author=request.author,
            expect_version=request.expect_version,
            activate=not request.no_activate,
            limits=self._request_limits,
        )
        return router_pb2.PutChainResponse(name=stored.name, version=stored.version, active=active)

    async def GetChain(self, request, context):
        stored = await self._store.resolve(request.name, request.version, request.label)
        labels = await self._store.labels(stored.name)
        active = await self._store.active_version(stored.name)
        return _version_message(stored, active, labels, with_config=True)

    async def GetChainHistory(self, request, context):
        versions = await self._store.history(request.name)
        labels = await self._store.labels(request.name)
        active = await self._store.active_version(request.name)
        return router_pb2.ChainHistory(
            name=request.name,
            active_version=active,
            versions=[_version_message(v, active, labels, with_config=False) for v in versions],
        )

    async def DiffChain(self, request, context):
        if not request.from_version or not request.to_version:
            raise InvalidArgument("from_version and to_version: both are required")
        diff = await self._store.diff(request.name, request.from_version, request.to_version)
        return router_pb2.DiffChainResponse(diff=diff)

    async def LabelChain(self, request, context):
        previous = await self._store.label(request.name, request.label, request.version)
        return router_pb2.LabelChainResponse(previous_version=previous)

    async def RollbackChain(self, request, context):
        before, after = await self._store.rollback(request.name, request.to_version)
        return router_pb2.RollbackChainResponse(from_version=before, to_version=after)

    async def ListChains(self, request, context):
        reply = router_pb2.ListChainsResponse()
        for name in self._store.names():
            active = self._store.pointer(name, "active")
            summary = reply.chains.add(
                name=name, active_version=active, latest_version=self._store.pointer(name, "latest")
            )
            if active:
                stored = await self._store.resolve(name, active)
                summary.nodes = len(stored.config.nodes)
                summary.slo_ms = stored.config.slo.latency_p99_ms
        return reply

    # ----- tool cache -----------------------------------------------------------------

    async def InvalidateToolCache(self, request, context):
        if not request.tool:
            raise InvalidArgument("tool: must not be empty")
        if request.arguments_json:
            try:
                arguments = json.loads(request.arguments_json)
            except ValueError as exc:
                raise InvalidArgument(f"arguments_json: not JSON ({exc})") from None
            if not isinstance(arguments, dict):
                raise InvalidArgument("arguments_json: must be a JSON object")
            version = self._tools.resolve(request.tool).version
            key = cache_key(request.tool, version, arguments)
            removed, replicas = await self._tools.cache.invalidate(key=key)
            await self._tools.cache.invalidate(key=stale_key(key))
        else:
            removed, replicas = await self._tools.cache.invalidate(prefix=f"tool:{request.tool}:")
            await self._tools.cache.invalidate(prefix=f"stale:tool:{request.tool}:")
        return router_pb2.InvalidateToolCacheResponse(removed=removed, replicas=replicas)

    async def GetToolCacheStats(self, request, context):
        reply = router_pb2.ToolCacheStats(
            local=self._tools.cache.local_stats(), single_flight_joins=self._tools.single_flight_joins
        )
        for address, stats, error in await self._tools.cache.replica_stats():
            row = reply.replicas.add(address=address, error=error)
            if stats is not None:
                row.stats.CopyFrom(stats)
        return reply

    # ----- status -------------------------------------------------------------------

    async def GetStatus(self, request, context):
        reply = router_pb2.SystemStatus(services=self._services.all(), workers=self._directory.all_workers())
        address = self._services.pick("scheduler")
        if address is None:
            reply.problems.append("no scheduler registered")
        else:
            try:
                sched = await scheduler_pb2_grpc.SchedulerStub(
                    self._channels.get(address)
                ).GetSchedulerStatus(scheduler_pb2.SchedulerStatusRequest(), timeout=2.0)
                reply.scheduler_policy = sched.policy
                for worker_id, state in sched.worker_breakers.items():
                    reply.circuit_breakers[f"worker:{worker_id}"] = state
                if sched.conservative:
                    reply.problems.append("scheduler cannot reach the memory-pool: half concurrency")
                for pool in sched.pools:
                    reply.queues.add(pool=pool.pool, queued=pool.queued, running=pool.running)
            except grpc.aio.AioRpcError as exc:
                reply.problems.append(f"scheduler at {address}: {exc.code().name}")
        address = self._services.pick("memory-pool")
        if address is None:
            reply.problems.append("no memory-pool registered")
        else:
            try:
                usage = await memory_pool_pb2_grpc.MemoryPoolStub(self._channels.get(address)).GetUsage(
                    memory_pool_pb2.GetUsageRequest(), timeout=2.0
                )
                reply.kv_headroom_ratio = usage.headroom_ratio
                for row in usage.workers:
                    reply.memory.add(
                        worker_id=row.worker_id,
                        pool=row.pool,
                        capacity_tokens=row.capacity_tokens,
                        reserved_tokens=row.reserved_tokens,
                        engine_kv_usage_ratio=row.engine_kv_usage_ratio,
                        lookahead_tokens=row.lookahead_tokens,
                    )
            except grpc.aio.AioRpcError as exc:
                reply.problems.append(f"memory-pool at {address}: {exc.code().name}")
        reply.tools.extend(self._tools.names())
        for target, state in self._tools.breakers.states().items():
            reply.circuit_breakers[target] = state.name.lower()
        if not self._services.instances("cache"):
            reply.problems.append("no cache registered (tool results are not cached)")
        return reply

    # ----- recent runs (observability) ----------------------------------------------

    async def GetRun(self, request, context):
        return records.run_trace_message(records.RECENT.find(request.run_id, request.chain))

    async def GetChainStats(self, request, context):
        if not request.chain:
            raise InvalidArgument("chain: required")
        kept = records.RECENT.of_chain(request.chain, request.last)
        if not kept:
            raise NotFound(f"no recent runs of chain '{request.chain}' are kept by this router")
        return records.chain_stats_message(records.chain_stats(request.chain, kept))


def _version_message(
    stored: StoredVersion, active: int, labels: dict[str, int], *, with_config: bool
) -> router_pb2.ChainVersion:
    return router_pb2.ChainVersion(
        name=stored.name,
        version=stored.version,
        config_yaml=stored.to_yaml() if with_config else "",
        author=stored.author,
        message=stored.message,
        created_unix_ms=stored.created_unix_ms,
        active=active == stored.version,
        labels=sorted(label for label, v in labels.items() if v == stored.version),
    )
