"""For people writing tool servers in Python: make a non-idempotent tool safe to retry.

InferX sends every tool call an idempotency key that stays the same across retries of
the same node in the same run. A tool server that registers with
`"idempotency_keys": true` promises to perform the side effect once per key; this
helper keeps that promise by recording each key's result in the InferX cache service,
so a retry after a lost reply returns the recorded result instead of acting again.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from inferx.errors import from_rpc_error
from inferx.tls import Transport
from inferx.v1 import cache_pb2, cache_pb2_grpc


class IdempotencyRecords:
    def __init__(self, cache_address: str, transport: Transport, *, ttl_s: float = 86_400.0) -> None:
        """`transport`: the tool server's own (mutual TLS with its certificate: the cache
        service accepts only peers with a certificate from the stack's CA)."""
        self._channel = transport.aio_channel(cache_address)
        self._stub = cache_pb2_grpc.CacheStub(self._channel)
        self._ttl_s = ttl_s

    async def close(self) -> None:
        await self._channel.close()

    async def run_once(self, tool: str, key: str, action: Callable[[], Awaitable[Any]]) -> Any:
        """Run `action` unless `key` already has a recorded result; return the result."""
        if not key:
            return await action()
        record = f"idem:{tool}:{key}"
        try:
            found = await self._stub.Get(cache_pb2.CacheGetRequest(key=record), timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            # Without the records we cannot know whether it already ran: refuse rather
            # than risk doing it twice.
            raise from_rpc_error(exc, target="the InferX cache") from None
        if found.hit:
            return json.loads(found.value)
        result = await action()
        try:
            await self._stub.Put(
                cache_pb2.CachePutRequest(key=record, value=json.dumps(result).encode(), ttl_s=self._ttl_s),
                timeout=2.0,
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, target="the InferX cache") from None
        return result
