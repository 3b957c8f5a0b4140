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
