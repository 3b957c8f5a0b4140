"""Tool calls: built-in tools, remote ToolService servers found in etcd, and the
tool-result cache in front of both."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aetcd
import grpc

from inferx import etcd
from inferx.discovery import ChannelPool, ServiceLocator
from inferx.errors import InferxError, InvalidArgument, NotFound, Unavailable, from_rpc_error
from inferx.v1 import cache_pb2, cache_pb2_grpc, tool_pb2, tool_pb2_grpc
from inferx_router.knowledge import KnowledgeBase

log = logging.getLogger("inferx.router.tools")

SESSION_MEMORY = "session_memory"


@dataclass(frozen=True)
class ToolCall:
    tool: str
    arguments: dict[str, Any]
    run_id: str
    session_id: str
    timeout_s: float


@dataclass(frozen=True)
class ToolResult:
    value: Any
    cache_hit: bool = False


BuiltinTool = Callable[[ToolCall], Awaitable[Any]]


def cache_key(tool: str, version: str, arguments: dict[str, Any]) -> str:
    """tool + version + canonical JSON of the arguments (key order never matters)."""
    canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    return f"tool:{tool}:{version}:{digest}"


def memory_key(session_id: str) -> str:
    return f"memory:{session_id}"


class ToolRouter:
    def __init__(
        self,
        client: aetcd.Client,
        services: ServiceLocator,
        channels: ChannelPool,
        knowledge: KnowledgeBase | None,
        knowledge_error: str = "",
    ) -> None:
        self._services = services
        self._channels = channels
        self.remote = etcd.PrefixMirror(client, etcd.TOOLS)
        self._knowledge = knowledge
        self._knowledge_error = knowledge_error
        self._builtins: dict[str, tuple[str, BuiltinTool]] = {
            "vector_search": ("1", self._vector_search),
            SESSION_MEMORY: ("1", self._session_memory),
        }

    def known(self, tool: str) -> bool:
        return tool in self._builtins or bool(self._remote_addresses(tool))

    def _remote_addresses(self, tool: str) -> list[tuple[str, str]]:
        prefix = f"{etcd.TOOLS}{tool}/"
        found = []
        for key, value in sorted(self.remote.items.items()):
            if key.startswith(prefix):
                try:
                    row = json.loads(value)
                    found.append((str(row["address"]), str(row.get("version", "1"))))
                except (ValueError, KeyError, TypeError):
                    log.warning("ignoring malformed tool registration at %s", key)
        return found

    async def call(self, call: ToolCall, *, cacheable: bool, cache_ttl_s: float) -> ToolResult:
        version, invoke = self._resolve(call.tool)
        key = cache_key(call.tool, version, call.arguments) if cacheable else ""
        if key:
            cached = await self._cache_get(key)
            if cached is not None:
                return ToolResult(json.loads(cached), cache_hit=True)
        value = await invoke(call)
        if key:
            await self._cache_put(key, json.dumps(value).encode(), cache_ttl_s)
        return ToolResult(value)

    def _resolve(self, tool: str) -> tuple[str, BuiltinTool]:
        if tool in self._builtins:
            return self._builtins[tool]
        remotes = self._remote_addresses(tool)
        if not remotes:
            raise NotFound(f"tool '{tool}' is neither built in nor registered under {etcd.TOOLS}{tool}/")
        address, version = remotes[0]

        async def invoke(call: ToolCall) -> Any:
            stub = tool_pb2_grpc.ToolServiceStub(self._channels.get(address))
            try:
                reply = await stub.Invoke(
                    tool_pb2.ToolRequest(
                        tool=call.tool,
                        arguments_json=json.dumps(call.arguments),
                        run_id=call.run_id,
                        session_id=call.session_id,
                    ),
                    timeout=call.timeout_s,
                )
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc, target=f"tool '{call.tool}' at {address}") from None
            try:
                return json.loads(reply.result_json) if reply.result_json else None
            except ValueError:
                raise InferxError(f"tool '{call.tool}' returned invalid JSON") from None

        return version, invoke

    # ----- cache service (best effort: chains continue without it) --------------------

    def _cache_stub(self) -> cache_pb2_grpc.CacheStub | None:
        address = self._services.pick("cache")
        return cache_pb2_grpc.CacheStub(self._channels.get(address)) if address else None

    async def _cache_get(self, key: str) -> bytes | None:
        stub = self._cache_stub()
        if stub is None:
            return None
        try:
            reply = await stub.Get(cache_pb2.CacheGetRequest(key=key), timeout=1.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("cache get failed (%s); calling the tool", exc.code().name)
            return None
        return reply.value if reply.hit else None

    async def _cache_put(self, key: str, value: bytes, ttl_s: float) -> None:
        stub = self._cache_stub()
        if stub is None:
            return
        try:
            await stub.Put(cache_pb2.CachePutRequest(key=key, value=value, ttl_s=ttl_s), timeout=1.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("cache put failed (%s)", exc.code().name)

    async def remember(self, session_id: str, turn: dict[str, Any], ttl_s: float = 86_400.0) -> None:
        """Append a finished turn to the session's memory (kept in the cache service)."""
        stub = self._cache_stub()
        if stub is None or not session_id:
            return
        try:
            await stub.Append(
                cache_pb2.CacheAppendRequest(
                    key=memory_key(session_id), value=json.dumps(turn).encode(), ttl_s=ttl_s
                ),
                timeout=1.0,
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("could not store session memory (%s)", exc.code().name)

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
        stub = self._cache_stub()
        if stub is None:
            raise Unavailable("session memory needs the cache service, and none is registered")
        limit = call.arguments.get("limit", 5)
        try:
            reply = await stub.GetList(
                cache_pb2.CacheGetRequest(key=memory_key(call.session_id)), timeout=1.0
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, target="cache") from None
        turns = [json.loads(v) for v in reply.values]
        return turns[-int(limit) :] if limit else turns
