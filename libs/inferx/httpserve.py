"""An ASGI app served by uvicorn as a task of the running event loop (the worker's
`--openai-http-port`): no thread, no signal handlers of its own, so the service's
bootstrap keeps SIGTERM and graceful drain.

The router's front has the same server in `inferx_router.http_front.HttpServer`; this
is the shared one for services that are not the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket whose connections send small writes at once (TCP_NODELAY).

    `socket.create_server` makes sockets with proto 0, and asyncio sets TCP_NODELAY only
    on transports whose socket says IPPROTO_TCP; without it a response written in two
    parts (headers, then body) on a kept-alive connection waits for the client's delayed
    ACK: ~40 ms per call on Linux. Set on the listener, the option is inherited by the
    accepted connections."""
    sock = socket.create_server(
        (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=1024
    )
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class _CoalescingTransport:
    """A connection's transport that sends a response's headers with its body: uvicorn
    writes them apart, and on a TCP_NODELAY socket each write is a send of its own (two
    packets, two wake-ups of the client). A write is held until the next one, which sends
    both at once, or until the end of the event loop's turn (`call_soon`) when none
    follows: a body written in the same turn as its headers (every whole response, a
    stream's first piece) goes out with them and no later than before."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._pending.append(bytes(data))
        if len(self._pending) > 1:
            self._flush()
        else:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if self._pending and not self._transport.is_closing():
            self._transport.write(b"".join(self._pending))
        self._pending.clear()

    def close(self) -> None:
        self._flush()  # what was written before the close goes out before it
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:  # everything else is the transport's
        return getattr(self._transport, name)


class _CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through a `_CoalescingTransport`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CoalescingTransport(transport))  # type: ignore[arg-type]


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # SIGTERM/SIGINT belong to the service's bootstrap (graceful drain), not uvicorn


class EmbeddedHttpServer:
    """uvicorn serving `app` as a task of the running event loop."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        drain_timeout_s: float = 5.0,
        certfile: Path | None = None,
        keyfile: Path | None = None,
    ) -> None:
        """With `certfile` and `keyfile`, HTTPS (clients are not asked for a certificate)."""
        self._app = app
        self._certfile = certfile
        self._keyfile = keyfile
        self._host = host
        self._port = port
        self._drain_timeout_s = drain_timeout_s
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.address = ""

    async def start(self) -> str:
        """Bind and serve; the HOST:PORT it listens on. OSError when it cannot bind."""
        sock = listen_socket(self._host, self._port)
        config = uvicorn.Config(
            self._app,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            # Nothing reads a caller's address, so X-Forwarded-* need no rewriting of the
            # scope on every request (uvicorn's ProxyHeadersMiddleware, on by default).
            proxy_headers=False,
            http=_CoalescingHttpToolsProtocol,
            timeout_graceful_shutdown=int(self._drain_timeout_s) or None,
            ssl_certfile=str(self._certfile) if self._certfile else None,
            ssl_keyfile=str(self._keyfile) if self._keyfile else None,
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="http")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"the HTTP server on {self._host}:{self._port} stopped during start-up")
            await asyncio.sleep(0.01)
        self.address = f"{self._host}:{sock.getsockname()[1]}"
        return self.address

    @property
    def tls(self) -> bool:
        return self._certfile is not None

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
