"""Mesh-friendly connections: a server started with the bootstrap's options
(`inferx.wire.server_options`) closes a client's connection once it is older than the
max connection age -- a call in flight then still completes within the grace -- and
the client's channel (`CHANNEL_OPTIONS`) reconnects by itself, so later calls succeed
over a new connection (which an L4 balancer may place on another replica). Real gRPC
over localhost TCP."""

from __future__ import annotations

import asyncio

import grpc

from inferx import wire
from inferx.settings import ServiceSettings

METHOD = "/inferx.test.Slow/Sleep"


async def _start(max_age_s: float, grace_s: float) -> tuple[grpc.aio.Server, int, list[str]]:
    peers: list[str] = []

    async def sleep(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        peers.append(context.peer())  # ipv4:127.0.0.1:PORT: the client's end of the connection
        await asyncio.sleep(float(request.decode()))
        return b"done"

    handler = grpc.method_handlers_generic_handler(
        "inferx.test.Slow", {"Sleep": grpc.unary_unary_rpc_method_handler(sleep)}
    )
    options = wire.server_options(
        max_connection_age_s=max_age_s,
        max_connection_age_grace_s=grace_s,
        keepalive_time_s=60,
        keepalive_timeout_s=20,
    )
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, peers


async def test_aged_connection_is_closed_after_its_calls_finish_and_the_client_reconnects() -> None:
    server, port, peers = await _start(max_age_s=1.0, grace_s=5.0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=wire.CHANNEL_OPTIONS) as channel:
            call = channel.unary_unary(METHOD)
            assert await call(b"0") == b"done"
            # In flight across the connection's max age (1 s): the grace lets it finish.
            assert await asyncio.wait_for(call(b"2.5"), timeout=10) == b"done"
            # The connection aged out meanwhile: the next calls go over a new one.
            for _ in range(3):
                assert await asyncio.wait_for(call(b"0"), timeout=10) == b"done"
                await asyncio.sleep(0.6)
        assert peers[0] == peers[1], "the first two calls shared the first connection"
        assert len(set(peers)) >= 2, f"the client never reconnected: {peers}"
    finally:
        await server.stop(None)


async def test_without_a_max_age_the_connection_stays() -> None:
    server, port, peers = await _start(max_age_s=0, grace_s=0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=wire.CHANNEL_OPTIONS) as channel:
            call = channel.unary_unary(METHOD)
            for _ in range(4):
                assert await call(b"0") == b"done"
                await asyncio.sleep(0.5)
        assert len(set(peers)) == 1
    finally:
        await server.stop(None)


def test_service_settings_give_the_server_its_connection_options() -> None:
    settings = ServiceSettings()
    options = dict(
        wire.server_options(
            max_connection_age_s=settings.max_connection_age_s,
            max_connection_age_grace_s=settings.max_connection_age_grace_s,
            keepalive_time_s=settings.keepalive_time_s,
            keepalive_timeout_s=settings.keepalive_timeout_s,
        )
    )
    assert options["grpc.max_connection_age_ms"] == 300_000
    assert options["grpc.max_connection_age_grace_ms"] == 3_600_000
    # The server accepts the clients' keepalive pings (else: GOAWAY too_many_pings).
    client_ping_ms = dict(wire.CHANNEL_OPTIONS)["grpc.keepalive_time_ms"]
    assert options["grpc.http2.min_recv_ping_interval_without_data_ms"] < client_ping_ms
    assert "grpc.max_connection_age_ms" not in dict(
        wire.server_options(
            max_connection_age_s=0, max_connection_age_grace_s=0, keepalive_time_s=1, keepalive_timeout_s=1
        )
    )
