"""For people writing tool servers in Python: serve an `inferx.v1.ToolService` the way
the router calls it, registered in etcd under a lease.

The registration, at `/inferx/v1/tools/<tool>/<instance-id>`, is
`{"address": "host:port", "version": "1", "idempotency_keys": false, "tls": true}`;
`"tls": true` says the port serves TLS and requires a client certificate from the
stack's CA (mutual TLS), which is how a router with TLS files calls it. A router calls
only endpoints of its own kind: TLS ones when it has TLS files, plaintext ones when it
runs --insecure.

A tool server takes the flags every service takes for this (`ToolServerSettings`):
`--etcd`, `--tls-ca/--tls-cert/--tls-key` or `--insecure`, `--etcd-ca/--etcd-cert/
--etcd-key`; see `examples/tools/weather_tool.py` and `run_tool_server`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable

import grpc
from pydantic import Field

from inferx import etcd
from inferx.etcd import LeaseKeeper, make_client
from inferx.settings import TransportSettings, load_settings
from inferx.tls import Security, TlsError, insecure_warning
from inferx.v1 import tool_pb2_grpc

log = logging.getLogger("inferx.toolserver")


class ToolServerSettings(TransportSettings):
    """What a tool server process takes (flags and INFERX_* variables, as services)."""

    host: str = Field("127.0.0.1", description="address to bind the gRPC server to")
    advertise_host: str = Field("", description="host the router uses to reach this server (default: --host)")
    port: int = Field(0, ge=0, le=65535, description="gRPC port (0 = pick a free port)")
    instance_id: str = Field("", description="registration id (default: generated)")
    lease_ttl_s: int = Field(10, ge=2, le=300, description="etcd lease TTL in seconds")


class ToolServer:
    """A ToolService on a gRPC port (TLS unless `security` is insecure), registered in
    etcd for `tool` under a lease for as long as it runs."""

    def __init__(
        self,
        servicer: tool_pb2_grpc.ToolServiceServicer,
        tool: str,
        *,
        security: Security,
        etcd_endpoint: str,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str = "",
        instance_id: str = "",
        version: str = "1",
        idempotency_keys: bool = False,
        lease_ttl_s: int = 10,
        require_client_auth: bool = True,
    ) -> None:
        self.tool = tool
        self.security = security
        self._servicer = servicer
        self._etcd_endpoint = etcd_endpoint
        self._host, self._port = host, port
        self._advertise_host = advertise_host or ("127.0.0.1" if host in ("0.0.0.0", "::") else host)
        self.instance_id = instance_id or f"{tool}-{socket.gethostname()}-{os.getpid()}"
        self._version = version
        self._idempotency_keys = idempotency_keys
        self._lease_ttl_s = lease_ttl_s
        self._require_client_auth = require_client_auth
        self.address = ""
        self._server: grpc.aio.Server | None = None
        self._etcd = None
        self.keeper: LeaseKeeper | None = None

    def registration(self) -> dict[str, object]:
        return {
            "address": self.address,
            "version": self._version,
            "idempotency_keys": self._idempotency_keys,
            "tls": not self.security.insecure,
        }

    async def start(self) -> str:
        """Serve, then register (the lease keeper retries while etcd is unreachable or
        refuses this process); the address it serves on."""
        server = grpc.aio.server()
        tool_pb2_grpc.add_ToolServiceServicer_to_server(self._servicer, server)
        listen = f"{self._host}:{self._port}"
        credentials = self.security.server_credentials(require_client_auth=self._require_client_auth)
        port = (
            server.add_insecure_port(listen)
            if credentials is None
            else server.add_secure_port(listen, credentials)
        )
        if port == 0:
            raise OSError(f"cannot listen on {listen}")
        await server.start()
        self._server = server
        self.address = f"{self._advertise_host}:{port}"
        self._etcd = make_client(
            self._etcd_endpoint, tls=self.security.etcd, server_name=self.security.etcd_server_name
        )
        self.keeper = LeaseKeeper(self._etcd, ttl_s=self._lease_ttl_s)
        await self.keeper.put(
            etcd.tool_key(self.tool, self.instance_id), json.dumps(self.registration()).encode()
        )
        self.keeper.start()
        return self.address

    async def wait_registered(self, timeout_s: float) -> bool:
        return self.keeper is not None and await self.keeper.wait_registered(timeout_s)

    async def stop(self, grace_s: float = 0.0) -> None:
        if self.keeper is not None:
            await self.keeper.close(revoke=True)
        if self._etcd is not None:
            try:
                await self._etcd.close()
            except Exception:  # closing a dead channel is not worth reporting
                pass
        if self._server is not None:
            await self._server.stop(grace_s)

    async def __aenter__(self) -> ToolServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def run_tool_server(
    tool: str,
    make_servicer: Callable[[], tool_pb2_grpc.ToolServiceServicer],
    argv: list[str] | None = None,
    *,
    version: str = "1",
    idempotency_keys: bool = False,
) -> None:
    """The body of a tool server's `main`: flags, then serve until SIGTERM/SIGINT.
    A TLS problem, or neither TLS files nor --insecure, is one line and exit 1."""
    prog = f"{tool}-tool"
    settings = load_settings(ToolServerSettings, prog, argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {prog} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aetcd").setLevel(logging.WARNING)
    try:
        security = settings.security()
    except TlsError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    if security.insecure:
        print(insecure_warning(prog), file=sys.stderr, flush=True)

    async def serve() -> None:
        server = ToolServer(
            make_servicer(),
            tool,
            security=security,
            etcd_endpoint=settings.etcd,
            host=settings.host,
            port=settings.port,
            advertise_host=settings.advertise_host,
            instance_id=settings.instance_id,
            version=version,
            idempotency_keys=idempotency_keys,
            lease_ttl_s=settings.lease_ttl_s,
            require_client_auth=settings.tls_client_auth,
        )
        address = await server.start()
        how = "PLAINTEXT" if security.insecure else "mutual TLS"
        print(f"{prog} listening on {address} ({how})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if await server.wait_registered(5.0):
            print(f"{prog} registered in etcd as {etcd.tool_key(tool, server.instance_id)}", flush=True)
        else:
            log.warning("etcd at %s refuses or cannot be reached; will register when it can", settings.etcd)
        await stop.wait()
        await server.stop(grace_s=5.0)

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
