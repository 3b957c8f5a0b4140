"""Router gRPC servicer: the public API. Thin: validate -> domain code -> protobuf."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid

import aetcd
import grpc

from inferx import etcd
from inferx.ab import DEFAULT_MARGIN, DEFAULT_MIN_RUNS, two_proportion_z
from inferx.auth import store as auth_store
from inferx.auth.limits import QuotaExceeded, TenantQuotas, TierNotAllowed
from inferx.auth.model import Role, TenantLimits, TenantRecord, TokenRecord
from inferx.chain.plan import LearnedLatency
from inferx.chain.subchains import MAX_DEPTH
from inferx.chain.validate import load_chain_text, required_inputs
from inferx.discovery import ChannelPool, ServiceLocator
from inferx.errors import DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from inferx.limits import RequestLimits
from inferx.pools import PoolDirectory, no_worker_message
from inferx.pricing import OverBudget, Price, PriceBook, check_amount, parse_price
from inferx.v1 import (
    memory_pool_pb2,
    memory_pool_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from inferx_router import ab_tests, costs, metrics, program_calls, records, shared_runs
from inferx_router.ab_tests import AbTests
from inferx_router.access import AccessControl, audit, caller
from inferx_router.chain_store import ChainStore, StoredVersion
from inferx_router.executors import SchedulerExecutor
from inferx_router.load import LoadMonitor
from inferx_router.off_peak import plan_of, waiting_messages
from inferx_router.program_calls import ProgramCalls
from inferx_router.runner import ChainRun
from inferx_router.tools import ToolRouter, cache_key, stale_key

log = logging.getLogger("inferx.router")

MAX_NESTED_TRACES = 300  # child runs one GetRun nests


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
        *,
        access: AccessControl,
        quotas: TenantQuotas,
        etcd_client: aetcd.Client,
        calls: ProgramCalls,
        request_limits: RequestLimits | None = None,
        shared: shared_runs.SharedRuns | None = None,
        executor: SchedulerExecutor | None = None,
        prices: PriceBook | None = None,
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
        # the component's (hops to their pool's owning scheduler); else any scheduler
        self._executor = executor or SchedulerExecutor(services, channels)
        self._access = access
        self._etcd = etcd_client  # tenants and tokens are written straight to etcd
        self._quotas = quotas
        self._shared = shared  # finished runs of every router (None: this router's only)
        self._calls = calls  # dynamic programs' calls: CallModel and the HTTP front share them
        # Expected node latencies, learned from this router's finished nodes.
        self._latency = LearnedLatency()
        self._prices = prices or PriceBook(etcd.PRICES)  # the pools' prices (inferx pool price)
        self._ab = AbTests(store, etcd_client)  # A/B tests of chain configs
        calls.price_of = self.price_of  # dynamic programs' calls are priced alike

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
        tenant = caller().tenant
        # An A/B test of the chain picks the version of runs that name none (inferx.ab).
        run_id, version, arm = uuid.uuid4().hex[:16], request.version, ""
        if request.chain and not request.version and not request.label:
            version, arm = self._ab.pick(tenant, request.chain, request.session_id or run_id)
        chain = await self._store.resolve(tenant, request.chain, version, request.label)
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
            node_events=not request.final_only,
            reasoning_parser=self._directory.reasoning_parser,
            resolve_chain=self._store.resolve,  # sub-agent chains (type: chain nodes)
            off_peak=plan_of(chain.config, request.schedule, request.off_peak_within_ms),
            price_of=self.price_of,
            run_id=run_id,
            ab_arm=arm,
        )
        try:
            run.plan_cost()  # within slo.max_cost, or refused before it starts
        except OverBudget:
            metrics.BUDGET_REFUSALS.labels(chain.config.name).inc()
            raise
        limits = self._limits(tenant)
        try:
            self._quotas.admit(
                tenant, limits, int(run.tier), self._estimate(run) if limits.cost_per_hour else 0.0
            )
        except (TierNotAllowed, QuotaExceeded) as exc:
            metrics.TENANT_REFUSALS.labels(tenant, exc.limit).inc()
            raise
        self._active_runs += 1
        task = asyncio.create_task(run.run(), name=f"run:{run.run_id}")
        task.add_done_callback(lambda done: self._release_run(tenant, limits, done))
        batch = request.batch_events and not request.final_only
        try:
            while (event := await run.events.get()) is not None:
                if batch and await _gather_following(run.events, event):
                    yield event
                    break  # the run's end mark was among them
                yield event
            await task
        finally:
            if not task.done():  # the caller went away: stop the run's hops too
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def CallModel(self, request: router_pb2.ProgramCallRequest, context: grpc.aio.ServicerContext):
        """One call of a dynamic program, on the HTTP front's path (`ProgramCalls`)."""
        body = program_calls.request_body(request)
        identity = program_calls.request_identity(request, context.time_remaining())
        call = self._calls.prepare(body)
        reader = self._calls.reader(body)  # tool calls read as the HTTP front reads them
        try:
            stream = self._calls.stream(caller(), identity, call, reader=reader)
            async with contextlib.aclosing(stream) as pieces:
                async for piece in pieces:  # text, tool calls as each is read whole, finished
                    if (event := program_calls.call_event(piece)) is not None:
                        yield event
        except TimeoutError:
            raise DeadlineExceeded("the call's deadline passed before the model finished") from None

    def price_of(self, model: str) -> Price:
        """What `model`'s hops are priced at: a price set for the model name itself (one
        pool may serve several names), else its pool's."""
        if self._prices.has(model):
            return self._prices.of(model)
        return self._prices.of(self._directory.pool_of(model))

    def _release_run(self, tenant: str, limits: TenantLimits, done: asyncio.Task) -> None:
        self._active_runs -= 1
        finished = done.result() if not done.cancelled() and done.exception() is None else None
        tokens = metrics.observe_tenant_run(tenant, finished) if finished is not None else 0
        self._quotas.finished(tenant, limits, tokens, finished.cost if finished is not None else 0.0)
        if finished is not None and finished.ab_arm:  # the guard rail of the chain's A/B test
            try:
                name = records.RECENT.find(finished.run_id, tenant=tenant).chain
            except NotFound:
                return
            self._ab.check_guard(tenant, name, lambda: records.RECENT.of_chain(name, tenant=tenant))

    def _estimate(self, run: ChainRun) -> float:
        """The run's estimated cost, for the tenant's cost budget (inferx.pricing)."""
        if run.budget_plan is not None:
            return run.budget_plan.estimate
        return sum(
            node.primary for node in costs.node_costs(run.config, run.inputs, self.price_of, self._latency)
        )

    def _limits(self, tenant: str) -> TenantLimits:
        record = self._access.directory.tenant(tenant) if self._access.directory is not None else None
        return record.limits if record is not None else TenantLimits()

    # ----- chain configs ------------------------------------------------------------

    async def ValidateChain(self, request, context):
        validated = load_chain_text(request.config, source="config", limits=self._request_limits)
        return router_pb2.ValidateChainResponse(name=validated.config.name, warnings=validated.warnings)

    async def PutChain(self, request, context):
        if not request.config.strip():
            raise InvalidArgument("config: must not be empty")
        who = caller()
        stored, active = await self._store.put(
            who.tenant,
            request.config,
            message=request.message,
            # The history's "who" is the authenticated caller; a self-declared author
            # is kept only when nobody is authenticated (--insecure).
            author=request.author if self._access.insecure and request.author else who.label,
            expect_version=request.expect_version,
            activate=not request.no_activate,
            limits=self._request_limits,
        )
        audit("chain.put", stored.name, version=stored.version, active=active)
        return router_pb2.PutChainResponse(name=stored.name, version=stored.version, active=active)

    async def GetChain(self, request, context):
        tenant = caller().tenant
        stored = await self._store.resolve(tenant, request.name, request.version, request.label)
        labels = await self._store.labels(tenant, stored.name)
        active = await self._store.active_version(tenant, stored.name)
        return _version_message(stored, active, labels, with_config=True)

    async def GetChainHistory(self, request, context):
        tenant = caller().tenant
        versions = await self._store.history(tenant, request.name)
        labels = await self._store.labels(tenant, request.name)
        active = await self._store.active_version(tenant, request.name)
        return router_pb2.ChainHistory(
            name=request.name,
            active_version=active,
            versions=[_version_message(v, active, labels, with_config=False) for v in versions],
        )

    async def DiffChain(self, request, context):
        if not request.from_version or not request.to_version:
            raise InvalidArgument("from_version and to_version: both are required")
        diff = await self._store.diff(caller().tenant, request.name, request.from_version, request.to_version)
        return router_pb2.DiffChainResponse(diff=diff)

    async def LabelChain(self, request, context):
        previous = await self._store.label(caller().tenant, request.name, request.label, request.version)
        audit("chain.label", request.name, label=request.label, version=request.version, previous=previous)
        return router_pb2.LabelChainResponse(previous_version=previous)

    async def RollbackChain(self, request, context):
        before, after = await self._store.rollback(caller().tenant, request.name, request.to_version)
        audit("chain.rollback", request.name, from_version=before, to_version=after)
        return router_pb2.RollbackChainResponse(from_version=before, to_version=after)

    async def ListChains(self, request, context):
        reply = router_pb2.ListChainsResponse()
        tenant = caller().tenant
        for name in self._store.names(tenant):
            active = self._store.pointer(tenant, name, "active")
            summary = reply.chains.add(
                name=name, active_version=active, latest_version=self._store.pointer(tenant, name, "latest")
            )
            if active:
                stored = await self._store.resolve(tenant, name, active)
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
            key = cache_key(request.tool, version, arguments, tenant=request.tenant or caller().tenant)
            removed, replicas = await self._tools.cache.invalidate(key=key)
            await self._tools.cache.invalidate(key=stale_key(key))
        else:
            removed, replicas = await self._tools.cache.invalidate(prefix=f"tool:{request.tool}:")
            await self._tools.cache.invalidate(prefix=f"stale:tool:{request.tool}:")
        audit("tool_cache.invalidate", request.tool, arguments=bool(request.arguments_json), removed=removed)
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
        who = caller()  # off-peak hops waiting for room: the caller's tenant's (an admin: all)
        reply.off_peak_waiting.extend(waiting_messages(None if who.role >= Role.ADMIN else who.tenant))
        # Every scheduler: each answers for the model pools it owns (partitions).
        schedulers = [info.address for info in self._services.instances("scheduler")]
        if not schedulers:
            reply.problems.append("no scheduler registered")
        queues: dict[str, tuple[int, int]] = {}
        for at in schedulers:
            try:
                sched = await scheduler_pb2_grpc.SchedulerStub(self._channels.get(at)).GetSchedulerStatus(
                    scheduler_pb2.SchedulerStatusRequest(), timeout=2.0
                )
            except grpc.aio.AioRpcError as exc:
                reply.problems.append(f"scheduler at {at}: {exc.code().name}")
                continue
            reply.scheduler_policy = reply.scheduler_policy or sched.policy
            for worker_id, state in sched.worker_breakers.items():
                reply.circuit_breakers[f"worker:{worker_id}"] = state
            if sched.conservative:
                reply.problems.append(f"scheduler at {at} cannot reach the memory-pool: half concurrency")
            for pool in sched.pools:
                queued, running = queues.get(pool.pool, (0, 0))
                queues[pool.pool] = (queued + pool.queued, running + pool.running)
        for pool_name, (queued, running) in sorted(queues.items()):
            reply.queues.add(pool=pool_name, queued=queued, running=running)
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
                        leased_tokens=row.leased_tokens,
                    )
            except grpc.aio.AioRpcError as exc:
                reply.problems.append(f"memory-pool at {address}: {exc.code().name}")
        reply.tools.extend(self._tools.names())
        for target, state in self._tools.breaker_states().items():
            reply.circuit_breakers[target] = state.name.lower()
        if not self._services.instances("cache"):
            reply.problems.append("no cache registered (tool results are not cached)")
        if caller().role < Role.ADMIN:  # the system's layout (addresses, workers) is for admins
            for name in ("services", "workers", "memory", "circuit_breakers", "tools"):
                reply.ClearField(name)
        return reply

    # ----- recent runs (observability) ----------------------------------------------

    # This router's records first, then those every router shares in etcd (shared_runs).

    async def GetRun(self, request, context):
        record = await shared_runs.find_run(
            records.RECENT, self._shared, request.run_id, request.chain, caller().tenant
        )
        trace = records.run_trace_message(record)
        await self._nest_children(trace, caller().tenant, budget=[MAX_NESTED_TRACES])
        return trace

    async def _nest_children(
        self, trace: router_pb2.RunTrace, tenant: str, budget: list[int], depth: int = 1
    ) -> None:
        """The child runs of the trace's `type: chain` nodes, nested (theirs too), those
        still kept by this router or the shared store; at most MAX_NESTED_TRACES in all."""
        if depth >= MAX_DEPTH:
            return
        for hop in trace.finished.hops:
            for run_id in hop.child_run_ids:
                if budget[0] <= 0:
                    return
                try:
                    record = await shared_runs.find_run(records.RECENT, self._shared, run_id, "", tenant)
                except (NotFound, InvalidArgument):
                    continue  # no longer kept
                budget[0] -= 1
                child = trace.children.add()
                child.CopyFrom(records.run_trace_message(record))
                await self._nest_children(child, tenant, budget, depth + 1)

    async def GetChainStats(self, request, context):
        if not request.chain:
            raise InvalidArgument("chain: required")
        kept = await shared_runs.chain_runs(
            records.RECENT, self._shared, request.chain, request.last, caller().tenant
        )
        if not kept:
            raise NotFound(f"no recent runs of chain '{request.chain}' are kept by any router")
        reply = records.chain_stats_message(records.chain_stats(request.chain, kept))
        reply.arms.extend(ab_tests.arm_message(arms) for arms in ab_tests.arms_by_version(kept))
        return reply

    # ----- access: tenants and tokens (admin) ----------------------------------------

    async def WhoAmI(self, request, context):
        who = caller()
        return router_pb2.WhoAmIResponse(
            tenant=who.tenant,
            role=who.role.label,
            token_id=who.token_id,
            token_name=who.name,
            insecure=self._access.insecure,
        )

    async def CreateTenant(self, request, context):
        limits = TenantLimits(
            max_concurrent_runs=request.limits.max_concurrent_runs,
            tokens_per_minute=request.limits.tokens_per_minute,
            max_tier=int(request.limits.max_tier),
            cost_per_hour=check_amount("limits.cost_per_hour", request.limits.cost_per_hour),
        )
        if limits.max_tier > 3:
            raise InvalidArgument(f"limits.max_tier: unknown tier {limits.max_tier}")
        record = await auth_store.create_tenant(self._etcd, request.name, limits, created_by=caller().label)
        audit("tenant.create", record.name, limits=limits.model_dump_json())
        return _tenant_message(record)

    async def ListTenants(self, request, context):
        tenants = await auth_store.list_tenants(self._etcd)
        return router_pb2.ListTenantsResponse(tenants=[_tenant_message(t) for t in tenants])

    async def CreateToken(self, request, context):
        try:
            role = Role.parse(request.role)
        except ValueError as exc:
            raise InvalidArgument(f"role: {exc}") from None
        if request.ttl_s < 0 or request.ttl_s != request.ttl_s:
            raise InvalidArgument("ttl_s: must be a number of seconds >= 0")
        text, record = await auth_store.create_token(
            self._etcd,
            tenant=request.tenant or caller().tenant,
            role=role,
            ttl_s=request.ttl_s,
            name=request.name,
            created_by=caller().label,
        )
        audit("token.create", record.token_id, tenant=record.tenant, role=role.label, ttl_s=request.ttl_s)
        return router_pb2.CreateTokenResponse(token=text, info=_token_message(record))

    async def RevokeToken(self, request, context):
        if not request.token_id:
            raise InvalidArgument("token_id: required")
        record = await auth_store.revoke_token(self._etcd, request.token_id)
        audit("token.revoke", record.token_id, tenant=record.tenant)
        return _token_message(record)

    async def ListTokens(self, request, context):
        tokens = await auth_store.list_tokens(self._etcd, request.tenant)
        return router_pb2.ListTokensResponse(tokens=[_token_message(t) for t in tokens])

    # ----- prices of model pools (cost) ---------------------------------------------------

    async def SetPoolPrice(self, request, context):
        if not request.pool or "/" in request.pool:
            raise InvalidArgument("pool: a pool (or model) name is required, without '/'")
        fields = {
            "prompt_per_1k": request.prompt_per_1k,
            "output_per_1k": request.output_per_1k,
            "gpu_second": request.gpu_second,
        }
        if request.HasField("cached_per_1k"):
            fields["cached_per_1k"] = request.cached_per_1k
        price = parse_price(fields)  # INVALID_ARGUMENT naming a negative or non-finite amount
        pool = request.pool  # a pool, or a model name priced apart from its pool
        await self._etcd.put(etcd.price_key(pool).encode(), price.to_json().encode())
        self._prices.update({**self._prices_items(), etcd.price_key(pool): price.to_json().encode()})
        audit("pool.price", pool, price=price.to_json())
        return _price_message(pool, price, is_set=True)

    async def GetPoolPrice(self, request, context):
        if not request.pool:
            raise InvalidArgument("pool: required")
        if self._prices.has(request.pool):
            return _price_message(request.pool, self._prices.of(request.pool), is_set=True)
        pool = self._directory.pool_of(request.pool)  # a model without its own price: its pool's
        return _price_message(pool, self._prices.of(pool), is_set=self._prices.has(pool))

    def _prices_items(self) -> dict[str, bytes]:
        return {etcd.price_key(pool): price.to_json().encode() for pool, price in self._prices.items()}

    # ----- A/B tests of chain configs ---------------------------------------------------

    async def StartAbTest(self, request, context):
        if not request.chain:
            raise InvalidArgument("chain: required")
        who = caller()
        test = await self._ab.start(
            who.tenant,
            request.chain,
            request.a,
            request.b,
            request.split_pct,
            request.margin or DEFAULT_MARGIN,
            request.min_runs or DEFAULT_MIN_RUNS,
            who.label,
        )
        audit("chain.ab.start", request.chain, a=test.a, b=test.b, split_pct=test.split_pct)
        return ab_tests.ab_test_message(request.chain, test)

    async def GetAbStatus(self, request, context):
        if not request.chain:
            raise InvalidArgument("chain: required")
        tenant = caller().tenant
        test = self._ab.current(tenant, request.chain)
        reply = router_pb2.AbStatus(running=test is not None)
        if test is None:
            test, reply.last_result = await self._ab.last_result(tenant, request.chain)
            if test is None:
                await self._store.resolve(tenant, request.chain)  # NOT_FOUND for an unknown chain
                raise NotFound(f"chain '{request.chain}' has had no A/B test (inferx chain ab start)")
        reply.test.CopyFrom(ab_tests.ab_test_message(request.chain, test))
        kept = await shared_runs.chain_runs(records.RECENT, self._shared, request.chain, 0, tenant)
        a, b = ab_tests.figures(test, kept)
        reply.arms.extend([ab_tests.arm_message(a), ab_tests.arm_message(b)])
        significance = two_proportion_z(a.slo_met, a.runs, b.slo_met, b.runs)
        reply.z, reply.p_value = significance.z, significance.p_value
        reply.enough_runs, reply.note = significance.enough, significance.note
        return reply

    async def StopAbTest(self, request, context):
        if not request.chain:
            raise InvalidArgument("chain: required")
        who = caller()
        test, version, before = await self._ab.stop(who.tenant, request.chain, request.keep, who.label)
        return router_pb2.StopAbTestResponse(
            kept=request.keep, version=version, label=ab_tests.WINNER_LABEL, previous_active=before
        )


def _price_message(pool: str, price: Price, *, is_set: bool) -> router_pb2.PoolPrice:
    reply = router_pb2.PoolPrice(
        pool=pool,
        prompt_per_1k=price.prompt_per_1k,
        output_per_1k=price.output_per_1k,
        gpu_second=price.gpu_second,
        set=is_set,
    )
    if price.cached_per_1k is not None:
        reply.cached_per_1k = price.cached_per_1k
    return reply


def _tenant_message(record: TenantRecord) -> router_pb2.Tenant:
    return router_pb2.Tenant(
        name=record.name,
        limits=router_pb2.TenantLimits(
            max_concurrent_runs=record.limits.max_concurrent_runs,
            tokens_per_minute=record.limits.tokens_per_minute,
            max_tier=record.limits.max_tier,  # type: ignore[arg-type]
            cost_per_hour=record.limits.cost_per_hour,
        ),
        created_by=record.created_by,
        created_unix_ms=record.created_unix_ms,
    )


def _token_message(record: TokenRecord) -> router_pb2.TokenInfo:
    return router_pb2.TokenInfo(
        token_id=record.token_id,
        tenant=record.tenant,
        role=record.role.label,
        name=record.name,
        created_by=record.created_by,
        created_unix_ms=record.created_unix_ms,
        expires_unix_ms=record.expires_unix_ms,
    )


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


# How many event-loop passes a batching stream waits before it sends: a node's finish
# and its successors' starts are queued one pass apart (each node is its own task), the
# chain's end two passes after its last node (the gather of the node tasks, then the
# run's task), so two passes put a 4-hop chain's 9 events in 5 messages.
_BATCH_PASSES = 2


async def _gather_following(
    events: asyncio.Queue[router_pb2.RunEvent | None], event: router_pb2.RunEvent
) -> bool:
    """RunChainRequest.batch_events: wait `_BATCH_PASSES` loop passes, then move the events
    queued by then into `event.following`. True when the run's end mark (None) was among
    them. Each message costs the router and the caller ~0.1 ms of CPU; the passes cost
    microseconds."""
    for _ in range(_BATCH_PASSES):
        await asyncio.sleep(0)
    while not events.empty():
        queued = events.get_nowait()
        if queued is None:
            return True
        event.following.append(queued)
    return False
