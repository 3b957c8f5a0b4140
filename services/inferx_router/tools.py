"""Tool calls: built-in tools, remote ToolService servers found in etcd, and the
tool-result cache in front of both."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aetcd
import grpc

from inferx import etcd
from inferx.auth.model import DEFAULT_TENANT
from inferx.discovery import ChannelPool, ServiceLocator
from inferx.errors import (
    FailedPrecondition,
    InferxError,
    InvalidArgument,
    NotFound,
    Unavailable,
    from_rpc_error,
)
from inferx.resilience import BreakerBoard, BreakerState
from inferx.v1 import tool_pb2, tool_pb2_grpc
from inferx_router.knowledge import KnowledgeBase
from inferx_router.tool_cache import TieredCache

log = logging.getLogger("inferx.router.tools")

SESSION_MEMORY = "session_memory"
# Bounds on session memory. A chain whose output holds its own recall (a
# memory_retrieval node as a sink) would otherwise remember ever larger turns, each
# holding the ones before: geometric growth, until a run's events pass what gRPC
# clients take (4 MiB by default). A turn's output is kept to MAX_TURN_OUTPUT_BYTES, a
# recall to MAX_RECALL_BYTES (the newest turns first, at least one); what is cut says
# so in the text.
MAX_TURN_OUTPUT_BYTES = 64 * 1024
MAX_RECALL_BYTES = 1024 * 1024


STALE_TTL_S = 86_400.0  # how long the last good result stays usable as a degraded answer


@dataclass(frozen=True)
class ToolCall:
    tool: str
    arguments: dict[str, Any]
    run_id: str
    session_id: str
    timeout_s: float
    idempotency_key: str = ""
    tenant: str = DEFAULT_TENANT  # cached results and session memory are the tenant's own


@dataclass(frozen=True)
class ToolResult:
    value: Any
    cache_hit: bool = False
    cache_unavailable: bool = False  # cacheable, but the cache service could not be reached


@dataclass(frozen=True)
class ResolvedTool:
    """A tool ready to call: its version (part of the cache key), the breaker target,
    and whether a retry is safe (idempotent, or the server honours idempotency keys)."""

    name: str
    version: str
    target: str
    honours_idempotency_key: bool
    invoke: Callable[[ToolCall], Awaitable[Any]]


class CircuitOpen(Unavailable):
    """The tool's circuit breaker is open: calls are refused until a probe succeeds."""


BuiltinTool = Callable[[ToolCall], Awaitable[Any]]


def cache_key(tool: str, version: str, arguments: dict[str, Any], *, tenant: str = DEFAULT_TENANT) -> str:
    """tool + version + tenant + canonical JSON of the arguments (key order never matters).
    The tool comes first so that one prefix drops a tool's results of every tenant."""
    canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    return f"tool:{tool}:{version}:{tenant}:{digest}"


def stale_key(key: str) -> str:
    return f"stale:{key}"


def bounded_turn(turn: dict[str, Any]) -> bytes:
    """A turn as session memory keeps it: JSON, its output cut until it takes at most
    MAX_TURN_OUTPUT_BYTES there (escapes counted), with a note of how much was left out
    (its inputs are bounded by --max-input-bytes)."""
    output = str(turn.get("output", ""))
    room = MAX_TURN_OUTPUT_BYTES - 100  # (the note)
    kept, size = output, len(json.dumps(output).encode())
    while size > room:  # shrinks every time: size > room
        kept = kept[: len(kept) * room // size]
        size = len(json.dumps(kept).encode())
    if kept != output:
        output = (
            f"{kept}[... {len(output.encode()) - len(kept.encode()):,} bytes of this turn's output left out]"
        )
    return json.dumps({**turn, "output": output}).encode()


def memory_key(session_id: str, tenant: str = DEFAULT_TENANT) -> str:
    return f"memory:{tenant}:{session_id}"


class ToolRouter:
    def __init__(
        self,
        client: aetcd.Client,
        services: ServiceLocator,
        channels: ChannelPool,
        knowledge: KnowledgeBase | None,
        knowledge_error: str = "",
        *,
        caching: bool = True,
    ) -> None:
        self._services = services
        self._channels = channels
        self.cache = TieredCache(services, channels)
        self.caching = caching
        self.breakers = BreakerBoard()
        # Single flight: identical cacheable calls in progress share one tool call.
        self._in_flight: dict[str, asyncio.Future[Any]] = {}
        self.single_flight_joins = 0
        self.remote = etcd.PrefixMirror(client, etcd.TOOLS)
        self._knowledge = knowledge
        self._knowledge_error = knowledge_error
        self._builtins: dict[str, tuple[str, BuiltinTool]] = {
            "vector_search": ("1", self._vector_search),
            SESSION_MEMORY: ("1", self._session_memory),
        }

    def names(self) -> list[str]:
        """Every tool a chain can call now: built-in ones and registered servers."""
        remote = {key.removeprefix(etcd.TOOLS).split("/", 1)[0] for key in self.remote.items}
        return sorted(set(self._builtins) | remote)

    def breaker_states(self) -> dict[str, BreakerState]:
        """The breakers of the tool endpoints registered now (`inferx status`, metrics):
        one whose server deregistered takes its breaker with it, or the board would list
        it for as long as the router runs and only grow as tool servers come and go."""
        live = {f"tool:{name}" for name in self._builtins}
        for key, value in self.remote.items.items():
            name = key.removeprefix(etcd.TOOLS).split("/", 1)[0]
            with contextlib.suppress(ValueError, KeyError, TypeError):  # malformed: resolve() says so
                live.add(f"tool:{name}@{json.loads(value)['address']}")
        for gone in [target for target in self.breakers.breakers if target not in live]:
            del self.breakers.breakers[gone]
        return self.breakers.states()

    def _remote_registrations(self, tool: str) -> list[dict[str, Any]]:
        prefix = f"{etcd.TOOLS}{tool}/"
        found = []
        for key, value in sorted(self.remote.items.items()):
            if key.startswith(prefix):
                try:
                    row = json.loads(value)
                    found.append(
                        {
                            "address": str(row["address"]),
                            "version": str(row.get("version", "1")),
                            "idempotency_keys": bool(row.get("idempotency_keys", False)),
                            # A TLS endpoint: called with mutual TLS (this router's certificate).
                            "tls": row.get("tls", False) is True,
                        }
                    )
                except (ValueError, KeyError, TypeError):
                    log.warning("ignoring malformed tool registration at %s", key)
        return found

    def resolve(self, tool: str) -> ResolvedTool:
        if tool in self._builtins:
            version, builtin = self._builtins[tool]
            return ResolvedTool(tool, version, f"tool:{tool}", True, builtin)
        registered = self._remote_registrations(tool)
        if not registered:
            raise NotFound(f"tool '{tool}' is neither built in nor registered under {etcd.TOOLS}{tool}/")
        # A TLS router calls TLS endpoints only (a plaintext one would see prompts and
        # answers in the clear); an --insecure router has no certificate to call TLS ones.
        secure = not self._channels.transport.insecure
        remotes = [r for r in registered if r["tls"] == secure]
        if not remotes:
            where = ", ".join(r["address"] for r in registered)
            if secure:
                raise FailedPrecondition(
                    f"tool '{tool}' is registered only as a plaintext endpoint ({where}); this router "
                    'calls tools over mutual TLS: serve it with TLS and register it with "tls": true'
                )
            raise FailedPrecondition(
                f"tool '{tool}' is registered only as a TLS endpoint ({where}); this router runs "
                "--insecure and has no certificate to call it with"
            )
        # Prefer an endpoint whose breaker is not open: one bad replica must not take
        # the tool down.
        usable = [
            r for r in remotes if self.breakers.get(f"tool:{tool}@{r['address']}").state != BreakerState.OPEN
        ]
        chosen = (usable or remotes)[0]
        address = chosen["address"]

        async def invoke(call: ToolCall) -> Any:
            stub = tool_pb2_grpc.ToolServiceStub(self._channels.get(address))
            try:
                reply = await stub.Invoke(
                    tool_pb2.ToolRequest(
                        tool=call.tool,
                        arguments_json=json.dumps(call.arguments),
                        run_id=call.run_id,
                        session_id=call.session_id,
                        idempotency_key=call.idempotency_key,
                    ),
                    timeout=call.timeout_s,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise TimeoutError from None
                raise from_rpc_error(exc, target=f"tool '{call.tool}' at {address}") from None
            try:
                return json.loads(reply.result_json) if reply.result_json else None
            except ValueError:
                raise InferxError(f"tool '{call.tool}' returned invalid JSON") from None

        return ResolvedTool(
            tool, chosen["version"], f"tool:{tool}@{address}", chosen["idempotency_keys"], invoke
        )

    async def call(self, call: ToolCall, *, cacheable: bool, cache_ttl_s: float) -> ToolResult:
        """One attempt: cache look-up, then the tool behind its circuit breaker."""
        tool = self.resolve(call.tool)
        key = (
            cache_key(call.tool, tool.version, call.arguments, tenant=call.tenant)
            if cacheable and self.caching
            else ""
        )
        cache_down = False
        if key:
            cached, cache_down = await self.cache.get(key)
            if cached is not None:
                return ToolResult(json.loads(cached), cache_hit=True)
            leader = self._in_flight.get(key)
            if leader is not None:
                self.single_flight_joins += 1
                return ToolResult(await asyncio.shield(leader), cache_hit=True)
            self._in_flight[key] = asyncio.get_running_loop().create_future()
        try:
            value = await self._invoke_guarded(tool, call)
        except BaseException as exc:
            if key:
                self._settle(key, error=exc)
            raise
        if key:
            self._settle(key, value=value)
            encoded = json.dumps(value).encode()
            cache_down = not await self.cache.put(key, encoded, cache_ttl_s) or cache_down
            await self.cache.put(stale_key(key), encoded, STALE_TTL_S, use_l1=False)
        return ToolResult(value, cache_unavailable=cache_down)

    def _settle(self, key: str, *, value: Any = None, error: BaseException | None = None) -> None:
        future = self._in_flight.pop(key, None)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(value)
            return
        if isinstance(error, asyncio.CancelledError):
            # The leader's own node gave up; the others did not: they see a retryable error.
            error = Unavailable("the shared tool call was abandoned by its caller")
        future.set_exception(error)
        future.add_done_callback(lambda f: f.exception())  # no "never retrieved" noise

    async def _invoke_guarded(self, tool: ResolvedTool, call: ToolCall) -> Any:
        breaker = self.breakers.get(tool.target)
        if not breaker.allow(time.monotonic()):
            raise CircuitOpen(f"circuit open for {tool.target}: recent calls failed")
        try:
            value = await tool.invoke(call)
        except (InferxError, TimeoutError):
            breaker.record(False, time.monotonic())
            raise
        breaker.record(True, time.monotonic())
        return value

    async def stale_result(
        self, tool_name: str, arguments: dict[str, Any], *, tenant: str = DEFAULT_TENANT
    ) -> tuple[bool, Any]:
        """The last good result of this call, however old (a degraded answer)."""
        try:
            tool = self.resolve(tool_name)
        except NotFound:
            return False, None
        found, _ = await self.cache.get(
            stale_key(cache_key(tool_name, tool.version, arguments, tenant=tenant)), use_l1=False
        )
        return (True, json.loads(found)) if found is not None else (False, None)

    async def remember(
        self, session_id: str, turn: dict[str, Any], ttl_s: float = 86_400.0, *, tenant: str = DEFAULT_TENANT
    ) -> None:
        """Append a finished turn to the session's memory (kept in the cache service)."""
        if session_id:
            await self.cache.append(memory_key(session_id, tenant), bounded_turn(turn), ttl_s)

    # ----- built-in tools -----------------------------------------------------------

    async def _vector_search(self, call: ToolCall) -> Any:
        if self._knowledge is None:
            raise Unavailable(f"vector_search has no knowledge base: {self._knowledge_error}")
        query = call.arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            raise InvalidArgument("vector_search: argument 'query' must be a non-empty string")
        top_k = call.arguments.get("top_k", 3)
        if not isinstance(top_k, int) or not 1 <= top_k <= 20:
            raise InvalidArgument("vector_search: argument 'top_k' must be an integer 1-20")
        return self._knowledge.search(query, top_k)

    async def _session_memory(self, call: ToolCall) -> Any:
        if not call.session_id:
            return []
        limit = call.arguments.get("limit", 5)
        values = await self.cache.get_list(memory_key(call.session_id, call.tenant))
        if values is None:
            raise Unavailable("session memory needs the cache service, which cannot be reached")
        recent = values[-int(limit) :] if limit else values
        kept: list[Any] = []
        size = 0
        for value in reversed(recent):  # the newest first, up to MAX_RECALL_BYTES
            size += len(value)
            if size > MAX_RECALL_BYTES and kept:
                break
            kept.append(json.loads(value))
        return kept[::-1]
