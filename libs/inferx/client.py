"""Python SDK: a thin async client of inferx.v1.Router whose failures are typed
InferxError exceptions (one mapping, in inferx.errors) instead of raw gRPC errors."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from inferx import DEFAULT_ROUTER
from inferx.errors import Internal, from_rpc_error
from inferx.tls import Transport
from inferx.v1 import common_pb2, router_pb2, router_pb2_grpc
from inferx.wire import CHANNEL_OPTIONS

__all__ = ["DEFAULT_ROUTER", "InferxClient"]


def _interceptors() -> list[grpc.aio.ClientInterceptor]:
    """OpenTelemetry's client interceptors when this process records spans. Only a
    process that installed the OpenTelemetry SDK's tracer provider does (see
    `inferx.telemetry.enabled`), so when the SDK is not even imported the answer is
    no, without importing the instrumentation (~60 ms of a CLI call's start-up)."""
    if "opentelemetry.sdk.trace" not in sys.modules:
        return []
    from inferx import telemetry

    return telemetry.client_interceptors()


def _program_message(message: Mapping[str, Any]) -> router_pb2.ProgramMessage:
    """An OpenAI-shaped chat message as CallModel takes it."""
    content = message.get("content") or ""
    if not isinstance(content, str):  # a list of text parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    tool_calls = message.get("tool_calls")
    return router_pb2.ProgramMessage(
        role=str(message.get("role", "")),
        content=content,
        name=str(message.get("name") or ""),
        tool_call_id=str(message.get("tool_call_id") or ""),
        tool_calls_json=json.dumps(list(tool_calls)) if tool_calls else "",
    )


class InferxClient:
    """A client of the router at `address`.

    `tls_ca`: the CA (PEM file) that issued the router's certificate: the channel is TLS,
    verifying the router (no client certificate: the public port does not ask for one).
    Without it the channel is plaintext (a stack run with --insecure). `token`: sent as
    `authorization: Bearer <token>` with every call. `transport` replaces `tls_ca` where
    the caller has its own (a service's mutual TLS). A bad CA file raises TlsError."""

    def __init__(
        self,
        address: str = DEFAULT_ROUTER,
        *,
        token: str | None = None,
        tls_ca: str | Path | None = None,
        timeout_s: float | None = None,
        transport: Transport | None = None,
    ) -> None:
        self.address = address
        self._timeout_s = timeout_s
        if transport is None:
            transport = Transport.server_auth(tls_ca) if tls_ca else Transport.plaintext()
        self.transport = transport
        token = (token or "").strip()
        self._metadata: tuple[tuple[str, str], ...] | None = (
            (("authorization", f"Bearer {token}"),) if token else None
        )
        # An agent that set up OpenTelemetry gets its trace continued by ours.
        self._channel = transport.aio_channel(address, options=CHANNEL_OPTIONS, interceptors=_interceptors())
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def __aenter__(self) -> InferxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _unary(self, method, request, timeout_s: float | None = 30.0):
        try:
            return await method(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(
                exc, target=f"the router at {self.address}", plaintext=self.transport.insecure
            ) from None

    async def run_chain(
        self,
        chain: str,
        inputs: dict[str, str] | None = None,
        *,
        version: int = 0,
        label: str = "",
        session_id: str = "",
        tier: common_pb2.Tier = common_pb2.TIER_UNSPECIFIED,
        final_only: bool = False,
        batch_events: bool = True,
        schedule: str = "",
        off_peak_within_ms: int = 0,
    ) -> AsyncIterator[router_pb2.RunEvent]:
        """The run's events: node_started / node_finished per node, then chain_finished
        (every hop's result is in it too); `final_only`: chain_finished alone.

        `batch_events` (RunChainRequest.batch_events) asks the router to send the events
        that are ready together in one message; they are yielded here one by one, as
        they would be without it (each without `following`)."""
        request = router_pb2.RunChainRequest(
            chain=chain,
            inputs=inputs or {},
            version=version,
            label=label,
            session_id=session_id,
            tier=tier,
            final_only=final_only,
            batch_events=batch_events,
            schedule=schedule,
            off_peak_within_ms=off_peak_within_ms,
        )
        try:
            async for event in self._stub.RunChain(request, timeout=self._timeout_s, metadata=self._metadata):
                following = list(event.following)
                if following:
                    del event.following[:]
                yield event
                for queued in following:
                    yield queued
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(
                exc, target=f"the router at {self.address}", plaintext=self.transport.insecure
            ) from None

    async def chain_result(
        self,
        chain: str,
        inputs: dict[str, str] | None = None,
        *,
        version: int = 0,
        label: str = "",
        session_id: str = "",
        tier: common_pb2.Tier = common_pb2.TIER_UNSPECIFIED,
        schedule: str = "",
        off_peak_within_ms: int = 0,
    ) -> router_pb2.ChainFinished:
        """Run a chain and return its `ChainFinished` (every hop's result is in `hops`),
        asking the router for that event alone (`final_only`): the cheapest way to run a
        chain when its progress is not shown."""
        finished = None
        async for event in self.run_chain(
            chain,
            inputs,
            version=version,
            label=label,
            session_id=session_id,
            tier=tier,
            final_only=True,
            schedule=schedule,
            off_peak_within_ms=off_peak_within_ms,
        ):
            if event.HasField("chain_finished"):
                finished = event.chain_finished
        if finished is None:
            raise Internal(f"the router at {self.address} ended the run of '{chain}' without its result")
        return finished

    async def call_model(
        self,
        model: str,
        prompt: str = "",
        *,
        messages: Sequence[Mapping[str, Any]] = (),
        tools: Sequence[Mapping[str, Any]] = (),
        tool_choice: str | Mapping[str, Any] | None = None,
        max_tokens: int = 0,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
        program_id: str = "",
        program_name: str = "",
        tier: common_pb2.Tier = common_pb2.TIER_UNSPECIFIED,
        deadline_ms: int = 0,
        program_end: bool = False,
        parent_program_id: str = "",
        priority: int = 0,
        kv_retention_s: float | None = None,
    ) -> AsyncIterator[router_pb2.ProgramCallEvent]:
        """One model call of a dynamic program (`Router.CallModel`): the reply's content
        as it is generated (`event.text`; a reasoning model's thinking before it as
        `event.reasoning`, where its pool has a reasoning parser), each tool call as soon
        as it has been read whole (`event.tool_call`: index, id, name, arguments_json; held until the reply
        has ended where a "required" or named `tool_choice` must be checked), then
        `event.finished` (usage, finish reason, worker, the program's run id, all the
        tool calls again). Tell them apart with `event.WhichOneof("event")`. A prompt,
        or OpenAI-shaped chat `messages` (role, content, name, tool_call_id, tool_calls)
        with optional `tools` / `tool_choice`. Calls with the same `program_id` are hops
        of one program (`inferx trace`); `kv_retention_s`: how long to keep the
        program's KV after this call (0 = let it go at once). `stop`: the reply ends
        before the first of these the model writes (OpenAI's `stop`)."""
        request = router_pb2.ProgramCallRequest(
            model=model,
            prompt=prompt,
            messages=[_program_message(m) for m in messages],
            tools_json=json.dumps(list(tools)) if tools else "",
            tool_choice_json=(
                tool_choice
                if isinstance(tool_choice, str)
                else json.dumps(tool_choice)
                if tool_choice is not None
                else ""
            ),
            max_tokens=max_tokens,
            program_id=program_id,
            program_name=program_name,
            tier=tier,
            deadline_ms=deadline_ms,
            program_end=program_end,
            parent_program_id=parent_program_id,
            priority=priority,
            stop=list(stop),
        )
        if temperature is not None:
            request.temperature = temperature
        if top_p is not None:
            request.top_p = top_p
        if seed is not None:
            request.seed = seed
        if kv_retention_s is not None:
            request.kv_retention_s = kv_retention_s
        try:
            async for event in self._stub.CallModel(
                request, timeout=self._timeout_s, metadata=self._metadata
            ):
                yield event
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(
                exc, target=f"the router at {self.address}", plaintext=self.transport.insecure
            ) from None

    async def put_chain(
        self,
        config: str,
        *,
        message: str = "",
        expect_version: int = 0,
        activate: bool = True,
        author: str = "",
    ) -> router_pb2.PutChainResponse:
        return await self._unary(
            self._stub.PutChain,
            router_pb2.PutChainRequest(
                config=config,
                message=message,
                expect_version=expect_version,
                no_activate=not activate,
                author=author,
            ),
        )

    async def get_chain(self, name: str, *, version: int = 0, label: str = "") -> router_pb2.ChainVersion:
        return await self._unary(
            self._stub.GetChain, router_pb2.GetChainRequest(name=name, version=version, label=label)
        )

    async def list_chains(self) -> router_pb2.ListChainsResponse:
        return await self._unary(self._stub.ListChains, router_pb2.ListChainsRequest())

    async def validate_chain(self, config: str) -> router_pb2.ValidateChainResponse:
        return await self._unary(self._stub.ValidateChain, router_pb2.ValidateChainRequest(config=config))

    async def chain_history(self, name: str) -> router_pb2.ChainHistory:
        return await self._unary(self._stub.GetChainHistory, router_pb2.ChainHistoryRequest(name=name))

    async def diff_chain(self, name: str, from_version: int, to_version: int) -> str:
        reply = await self._unary(
            self._stub.DiffChain,
            router_pb2.DiffChainRequest(name=name, from_version=from_version, to_version=to_version),
        )
        return reply.diff

    async def label_chain(self, name: str, label: str, version: int) -> int:
        reply = await self._unary(
            self._stub.LabelChain, router_pb2.LabelChainRequest(name=name, label=label, version=version)
        )
        return reply.previous_version

    async def rollback_chain(self, name: str, to_version: int = 0) -> router_pb2.RollbackChainResponse:
        return await self._unary(
            self._stub.RollbackChain, router_pb2.RollbackChainRequest(name=name, to_version=to_version)
        )

    async def invalidate_tool_cache(
        self, tool: str, arguments_json: str = ""
    ) -> router_pb2.InvalidateToolCacheResponse:
        return await self._unary(
            self._stub.InvalidateToolCache,
            router_pb2.InvalidateToolCacheRequest(tool=tool, arguments_json=arguments_json),
        )

    async def tool_cache_stats(self) -> router_pb2.ToolCacheStats:
        return await self._unary(self._stub.GetToolCacheStats, router_pb2.ToolCacheStatsRequest())

    async def status(self) -> router_pb2.SystemStatus:
        return await self._unary(self._stub.GetStatus, router_pb2.GetStatusRequest(), timeout_s=10.0)

    # ----- access (admin) -------------------------------------------------------------

    async def whoami(self) -> router_pb2.WhoAmIResponse:
        return await self._unary(self._stub.WhoAmI, router_pb2.WhoAmIRequest())

    async def create_tenant(
        self,
        name: str,
        *,
        max_concurrent_runs: int = 0,
        tokens_per_minute: int = 0,
        max_tier: common_pb2.Tier = common_pb2.TIER_UNSPECIFIED,
        cost_per_hour: float = 0.0,
    ) -> router_pb2.Tenant:
        limits = router_pb2.TenantLimits(
            max_concurrent_runs=max_concurrent_runs,
            tokens_per_minute=tokens_per_minute,
            max_tier=max_tier,
            cost_per_hour=cost_per_hour,
        )
        return await self._unary(
            self._stub.CreateTenant, router_pb2.CreateTenantRequest(name=name, limits=limits)
        )

    async def list_tenants(self) -> router_pb2.ListTenantsResponse:
        return await self._unary(self._stub.ListTenants, router_pb2.ListTenantsRequest())

    async def create_token(
        self, tenant: str, role: str, *, ttl_s: float = 0, name: str = ""
    ) -> router_pb2.CreateTokenResponse:
        return await self._unary(
            self._stub.CreateToken,
            router_pb2.CreateTokenRequest(tenant=tenant, role=role, ttl_s=ttl_s, name=name),
        )

    async def revoke_token(self, token_id: str) -> router_pb2.TokenInfo:
        return await self._unary(self._stub.RevokeToken, router_pb2.RevokeTokenRequest(token_id=token_id))

    async def list_tokens(self, tenant: str = "") -> router_pb2.ListTokensResponse:
        return await self._unary(self._stub.ListTokens, router_pb2.ListTokensRequest(tenant=tenant))

    # ----- prices of model pools (cost) -------------------------------------------------

    async def set_pool_price(
        self,
        pool: str,
        *,
        prompt_per_1k: float = 0.0,
        cached_per_1k: float | None = None,
        output_per_1k: float = 0.0,
        gpu_second: float = 0.0,
    ) -> router_pb2.PoolPrice:
        request = router_pb2.PoolPrice(
            pool=pool, prompt_per_1k=prompt_per_1k, output_per_1k=output_per_1k, gpu_second=gpu_second
        )
        if cached_per_1k is not None:
            request.cached_per_1k = cached_per_1k
        return await self._unary(self._stub.SetPoolPrice, request)

    async def get_pool_price(self, pool: str) -> router_pb2.PoolPrice:
        return await self._unary(self._stub.GetPoolPrice, router_pb2.GetPoolPriceRequest(pool=pool))

    # ----- A/B tests of chain configs --------------------------------------------------

    async def start_ab_test(
        self, chain: str, a: int, b: int, split_pct: float, *, margin: float = 0.0, min_runs: int = 0
    ) -> router_pb2.AbTest:
        request = router_pb2.StartAbTestRequest(
            chain=chain, a=a, b=b, split_pct=split_pct, margin=margin, min_runs=min_runs
        )
        return await self._unary(self._stub.StartAbTest, request)

    async def ab_status(self, chain: str) -> router_pb2.AbStatus:
        return await self._unary(self._stub.GetAbStatus, router_pb2.AbStatusRequest(chain=chain))

    async def stop_ab_test(self, chain: str, keep: str) -> router_pb2.StopAbTestResponse:
        return await self._unary(self._stub.StopAbTest, router_pb2.StopAbTestRequest(chain=chain, keep=keep))
