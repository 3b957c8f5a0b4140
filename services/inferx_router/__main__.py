"""`inferx-router`: the public entry point (inferx.v1.Router)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from inferx import MAX_UINT32, etcd
from inferx.auth.limits import TenantQuotas
from inferx.auth.store import AuthDirectory
from inferx.discovery import ChannelPool, ServiceLocator
from inferx.limits import KIB, MAX_STORED_CHAIN_BYTES, MIB, RequestLimits
from inferx.partitions import ALL_POOLS, OwnerTable
from inferx.pools import PoolDirectory
from inferx.pricing import PriceBook
from inferx.server import ServiceComponent, ServiceInstance, ServiceRuntime, run_service
from inferx.settings import ServiceSettings
from inferx.v1 import router_pb2, router_pb2_grpc
from inferx_router import embedded, metrics, records, shared_runs
from inferx_router.access import AccessControl
from inferx_router.chain_store import ChainStore
from inferx_router.executors import SchedulerExecutor, scheduler_streams
from inferx_router.http_front import HttpServer, OpenAIFront
from inferx_router.knowledge import KnowledgeBase
from inferx_router.load import LoadMonitor
from inferx_router.program_calls import ProgramCalls
from inferx_router.program_homes import ProgramHomes
from inferx_router.programs import ProgramBook
from inferx_router.scheduler_target import SchedulerTargets
from inferx_router.servicer import RouterServicer
from inferx_router.tools import ToolRouter
from inferx_scheduler.config import SchedulerSettings

log = logging.getLogger("inferx.router")


class RouterSettings(ServiceSettings):
    port: int = Field(50051, ge=0, le=65535, description="gRPC port of inferx.v1.Router")
    # The public port: callers are agents and people, who authenticate with tokens, not
    # certificates (the router calls no one who needs to call it back).
    tls_client_auth: bool = Field(
        False,
        description="require callers to present a certificate issued by --tls-ca (default off: the "
        "router's callers authenticate with tokens; TLS with the router's certificate still applies)",
    )
    knowledge_base: str = Field(
        "examples/knowledge_base.jsonl", description="documents for the built-in vector_search tool"
    )
    degrade_load_threshold: float = Field(
        0.8, gt=0, le=10, description="pool load (running+queued / capacity) above which nodes degrade"
    )
    tool_cache: bool = Field(
        True, description="cache results of cacheable tool nodes (off: for A/B benchmarks)"
    )
    max_active_runs: int = Field(
        256, gt=0, description="runs in progress at once; more are refused with RESOURCE_EXHAUSTED"
    )
    recent_runs: int = Field(
        1000, ge=0, description="finished runs kept for `inferx trace` and `inferx stats`"
    )
    run_retention_s: int = Field(
        shared_runs.DEFAULT_RETENTION_S,
        ge=0,
        description="finished runs are shared with every router (in etcd) for this long, so any router "
        "answers `inferx trace` and `inferx stats` for them; 0 = not shared (this router's memory only)",
    )
    shared_runs: int = Field(
        shared_runs.DEFAULT_PER_ROUTER,
        ge=0,
        description="finished runs this router keeps shared in etcd at most (its oldest is deleted past it)",
    )
    http_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="port of the OpenAI-compatible HTTP front (/v1/chat/completions, /v1/completions, "
        "/v1/models) on --host; 0 = off",
    )
    http_timeout_s: float = Field(
        300.0,
        gt=0,
        description="time limit of a program call (HTTP or CallModel) that sets no deadline of its own",
    )
    program_idle_s: float = Field(
        300.0,
        gt=0,
        description="a dynamic program (OpenAI front, CallModel) with no call for this long ends: its record "
        "is finished (the scheduler's hold of its KV lapses by itself)",
    )
    shared_programs: bool = Field(
        True,
        description="a dynamic program whose calls land on several routers stays one program: the "
        "routers say in etcd which of them holds each open program (one put when a router opens it, one "
        "delete when it ends, one read when a router first sees it, none per call) and hand it over when "
        "its calls move; off: each router keeps "
        "its own record and count of it",
    )
    program_handoff_wait_s: float = Field(
        1.0,
        gt=0,
        le=30,
        description="a program call arriving at a router while another holds the program waits this long "
        "at most for the hand-over (a holder that died is not waited for longer)",
    )
    # Limits on what callers send (docs/limits.md). Over one: INVALID_ARGUMENT naming it
    # (HTTP 400, 413 for the body); over --max-request-bytes: gRPC's RESOURCE_EXHAUSTED.
    max_request_bytes: int = Field(
        4 * MIB,
        ge=KIB,
        le=2**31 - 1,
        description="largest gRPC request the router accepts, in bytes (gRPC refuses a larger one "
        "with RESOURCE_EXHAUSTED)",
    )
    max_input_bytes: int = Field(
        RequestLimits.max_input_bytes,
        gt=0,
        description="total bytes of a RunChain's inputs (names and values)",
    )
    max_inputs: int = Field(
        RequestLimits.max_inputs, gt=0, description="number of inputs a RunChain may pass"
    )
    max_config_bytes: int = Field(
        RequestLimits.max_config_bytes,
        gt=0,
        le=MAX_STORED_CHAIN_BYTES,
        description="size of a chain config given to PutChain or ValidateChain, bytes",
    )
    max_nodes: int = Field(RequestLimits.max_nodes, gt=0, description="nodes a chain config may have")
    max_output_tokens: int = Field(
        RequestLimits.max_output_tokens,
        gt=0,
        le=MAX_UINT32,
        description="max_tokens a model node (PutChain, ValidateChain) or a program call (HTTP, CallModel) "
        "may ask for",
    )
    default_max_output_tokens: int = Field(
        RequestLimits.default_output_tokens,
        ge=0,
        le=MAX_UINT32,
        description="max_tokens of a program call (HTTP, CallModel) that sets none; 0 = none: the reply runs "
        "until the model stops or its context is full, as on OpenAI and vLLM (vLLM's "
        "--override-generation-config max_new_tokens does the same); at most --max-output-tokens",
    )
    http_max_body_bytes: int = Field(
        RequestLimits.http_max_body_bytes,
        gt=0,
        description="bytes of an HTTP front request body (413 over it)",
    )

    embedded_scheduler: bool = Field(
        False,
        description="run a scheduler in this router's process (its own --scheduler-port with mutual TLS, "
        "etcd lease and partition election, like any inferx-scheduler): this router's hops to the pools it "
        "owns are in-process calls, one gRPC crossing fewer per hop; other routers reach it over gRPC",
    )
    scheduler_port: int = Field(
        0, ge=0, le=65535, description="with --embedded-scheduler: its gRPC port (0 = pick a free port)"
    )
    scheduler_flags: str = Field(
        "",
        description='with --embedded-scheduler: its inferx-scheduler flags, e.g. "--policy chain-aware '
        "--max-queued-per-pool 2048\" (etcd, TLS, host, lease, drain and log settings are the router's)",
    )

    @field_validator("scheduler_flags")
    @classmethod
    def _scheduler_flags(cls, value: str) -> str:
        embedded.parse_scheduler_flags(value)  # ValueError says what is wrong
        return value

    @model_validator(mode="after")
    def _default_within_the_limit(self) -> RouterSettings:
        if self.default_max_output_tokens > self.max_output_tokens:
            raise ValueError(
                f"--default-max-output-tokens {self.default_max_output_tokens} is over "
                f"--max-output-tokens {self.max_output_tokens}"
            )
        return self

    @model_validator(mode="after")
    def _embedded_only(self) -> RouterSettings:
        if not self.embedded_scheduler and (self.scheduler_flags or self.scheduler_port):
            raise ValueError("--scheduler-flags and --scheduler-port need --embedded-scheduler")
        return self

    @property
    def request_limits(self) -> RequestLimits:
        return RequestLimits(
            max_input_bytes=self.max_input_bytes,
            max_inputs=self.max_inputs,
            max_config_bytes=self.max_config_bytes,
            max_nodes=self.max_nodes,
            max_output_tokens=self.max_output_tokens,
            default_output_tokens=self.default_max_output_tokens,
            http_max_body_bytes=self.http_max_body_bytes,
        )


class RouterComponent(ServiceComponent):
    service_names = (router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,)

    def __init__(self, runtime: ServiceRuntime, settings: RouterSettings) -> None:
        self._runtime = runtime
        self._embedded_settings = (
            embedded.scheduler_settings(settings, settings.scheduler_flags, settings.scheduler_port)
            if settings.embedded_scheduler
            else None
        )
        self.embedded: ServiceInstance[SchedulerSettings] | None = None
        self.store = ChainStore(runtime.etcd)
        self.directory = PoolDirectory()
        self.services = ServiceLocator(runtime.etcd)
        self.channels = ChannelPool(runtime.transport)
        knowledge, error = None, ""
        try:
            knowledge = KnowledgeBase.load(Path(settings.knowledge_base))
        except (OSError, ValueError) as exc:
            error = str(exc)
            log.warning("vector_search disabled: %s", exc)
        self.tools = ToolRouter(
            runtime.etcd, self.services, self.channels, knowledge, error, caching=settings.tool_cache
        )
        records.RECENT.capacity = settings.recent_runs
        self.shared = shared_runs.SharedRuns(
            runtime.etcd, retention_s=settings.run_retention_s, per_router=settings.shared_runs
        )
        records.RECENT.publish = self.shared.publish
        metrics.watch_breakers(self.tools.breaker_states)
        self.mirrors = [
            self.store.mirror,
            self.services.mirror,
            self.tools.remote,
            etcd.PrefixMirror(runtime.etcd, etcd.WORKERS, self.directory.update_workers),
            etcd.PrefixMirror(runtime.etcd, etcd.MODELS, self.directory.update_models),
        ]
        self.prices = PriceBook(etcd.PRICES)  # the pools' prices: every hop's cost
        self.mirrors.append(etcd.PrefixMirror(runtime.etcd, etcd.PRICES, self.prices.update))
        # A pool's hops go to the scheduler that owns the pool (watched, no read per hop).
        self.owners = OwnerTable(runtime.etcd, "scheduler")
        self.mirrors.append(self.owners.mirror)
        ledger = OwnerTable(runtime.etcd, "memory-pool")  # `inferx status` asks the one ledger
        self.mirrors.append(ledger.mirror)
        self.services.follow_leader("memory-pool", lambda: ledger.address_of(ALL_POOLS))
        targets = SchedulerTargets(
            self.services,
            self.owners,
            self.directory,
            # a dead owner's pools move when its lease ends; the margin covers the watch
            failover_wait_s=settings.lease_ttl_s + 2.0,
        )
        self.load = LoadMonitor(self.directory, self.services, self.channels, settings.degrade_load_threshold)
        # Tokens and tenants (docs/security.md); none of it with --insecure.
        auth = None if runtime.insecure else AuthDirectory(runtime.etcd)
        if auth is not None:
            self.mirrors.extend(auth.mirrors)
        access = AccessControl(auth)
        runtime.guard_calls(access.guard)
        quotas = TenantQuotas()  # one per router: gRPC runs and HTTP calls count alike
        # Every hop to a scheduler, from chains and programs alike, on one stream per scheduler.
        streams = scheduler_streams(self.channels, enabled=settings.hop_streams)
        self.executor = SchedulerExecutor(
            self.services, self.channels, targets, streams, pool_of=self.directory.pool_of
        )
        # Dynamic programs' calls: the HTTP front and Router.CallModel share one path.
        self.calls = ProgramCalls(
            self.directory,
            self.executor,
            access=access,
            quotas=quotas,
            default_timeout_s=settings.http_timeout_s,
            book=ProgramBook(idle_s=settings.program_idle_s),
            request_limits=settings.request_limits,
            homes=(
                (
                    lambda book: ProgramHomes(
                        runtime.etcd,
                        runtime.instance_id,
                        book,
                        lease_ttl_s=settings.lease_ttl_s,
                        handoff_wait_s=settings.program_handoff_wait_s,
                    )
                )
                if settings.shared_programs
                else None
            ),
        )
        if self.calls.homes is not None:
            self.mirrors.append(self.calls.homes.mirror)
        self._sweep_every_s = min(max(settings.program_idle_s / 4, 0.05), 5.0)
        self._sweeper: asyncio.Task[None] | None = None
        self.http: HttpServer | None = None
        if settings.http_port:
            front = OpenAIFront(self.calls, access=access, request_limits=settings.request_limits)
            tls = runtime.security.service
            self.http = HttpServer(
                front.app(),
                settings.host,
                settings.http_port,
                drain_timeout_s=settings.drain_timeout_s,
                # HTTPS with the router's certificate whenever it has one (no client certificates).
                certfile=tls.files.cert if tls is not None else None,
                keyfile=tls.files.key if tls is not None else None,
            )
        router_pb2_grpc.add_RouterServicer_to_server(
            RouterServicer(
                self.store,
                self.directory,
                self.services,
                self.channels,
                self.tools,
                self.load,
                settings.max_active_runs,
                access=access,
                quotas=quotas,
                etcd_client=runtime.etcd,
                request_limits=settings.request_limits,
                calls=self.calls,
                shared=self.shared,
                executor=self.executor,
                prices=self.prices,
            ),
            runtime.server,
        )

    async def ready(self) -> None:
        if self._embedded_settings is not None:  # serving (and campaigning) before the router is
            streams = self.executor.streams
            self.embedded = await embedded.start(self._runtime, self._embedded_settings, streams)
        for mirror in self.mirrors:
            mirror.start()
        for mirror in self.mirrors:
            await mirror.wait_synced(timeout_s=30)
        self.load.start()
        self.shared.start()
        if self.calls.homes is not None:
            self.calls.homes.start()
        self._sweeper = asyncio.create_task(self._sweep_programs(), name="program-sweep")
        if self.http is not None:  # after the mirrors: the models are known from the first call
            try:
                address = await self.http.start()
            except OSError as exc:
                raise RuntimeError(f"cannot serve HTTP on --http-port: {exc}") from None
            scheme = "https" if self.http.tls else "http"
            print(f"inferx-router OpenAI-compatible HTTP on {scheme}://{address}/v1", flush=True)

    async def _sweep_programs(self) -> None:
        """End dynamic programs idle past --program-idle-s (their records, their metrics)."""
        while True:
            await asyncio.sleep(self._sweep_every_s)
            for program in self.calls.sweep():
                log.debug("program %s of tenant %s ended: idle", program.program_id, program.tenant)

    async def stop(self) -> None:
        if self.http is not None:  # in-flight HTTP calls finish (up to the drain timeout)
            await self.http.stop()
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self.load.close()
        if self.calls.homes is not None:
            await self.calls.homes.close()  # its markers go with its lease
        await self.shared.close()  # what is queued is put first (up to 2 s)
        for mirror in self.mirrors:
            await mirror.close()
        await self.executor.streams.close()
        await self.channels.close()
        if self.embedded is not None:  # after this router's hops: they may have run on it
            await self.embedded.shutdown()


async def build(runtime: ServiceRuntime, settings: RouterSettings) -> RouterComponent:
    return RouterComponent(runtime, settings)


def main() -> None:
    run_service("router", RouterSettings, build)


if __name__ == "__main__":
    main()
