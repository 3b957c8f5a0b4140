"""The one service bootstrap all five InferX services share.

Start-up: flags/env -> gRPC server with health (NOT_SERVING) and reflection ->
component servicers -> etcd lease registration -> component warm-up -> SERVING.

Shutdown on SIGTERM/SIGINT, in this order and for these reasons:
  1. health NOT_SERVING   -- load balancers and health-checking callers stop sending;
  2. revoke the lease     -- the registration vanishes at once, so the scheduler stops
                             dispatching here without waiting for the TTL;
  3. a short grace       -- --deregister-grace-s: calls already on their way (sent
                             before callers saw the lease go) are still accepted;
  4. drain in-flight RPCs -- bounded by --drain-timeout-s, so a hop already running
                             finishes instead of failing;
  5. component cleanup, close etcd, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import aetcd
import grpc
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from inferx import __version__, hopstream, telemetry, wire
from inferx.errors import InferxError, Internal, InvalidArgument, abort_with
from inferx.etcd import LeaseKeeper, make_client, service_key
from inferx.settings import ServiceSettings, load_settings
from inferx.tls import Security, TlsError, Transport, insecure_warning
from inferx.v1 import common_pb2

log = logging.getLogger("inferx.server")

S = TypeVar("S", bound=ServiceSettings)

OUR_METHOD_PREFIX = "/inferx.v1."


# Checks a call before its handler runs (the router's token check): raises an
# InferxError to refuse it. Runs in the handler's own task, so what it sets in a
# ContextVar (who is calling) is what the handler sees.
CallGuard = Callable[[str, grpc.aio.ServicerContext], None]


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns domain errors raised by our handlers into gRPC status codes.

    Handlers raise `InferxError`; anything else is a bug, logged with its traceback
    and reported as INTERNAL without leaking internals to the caller. A component may
    install a `CallGuard` (`ServiceRuntime.guard_calls`), checked before every handler
    of ours, whose refusals map the same way.
    """

    def __init__(self) -> None:
        self.guard: CallGuard | None = None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(OUR_METHOD_PREFIX):
            return handler
        method = handler_call_details.method
        # The request is decoded here, not by gRPC: a message that is not valid protobuf
        # is the caller's INVALID_ARGUMENT, where gRPC itself would answer UNKNOWN.
        decode = _decoder(handler.request_deserializer, method)
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(raw, context):
                try:
                    if self.guard is not None:
                        self.guard(method, context)
                    return await inner_uu(decode(raw), context)
                except InferxError as exc:
                    await abort_with(context, exc)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    log.exception("unhandled error in %s", method)
                    await abort_with(context, Internal(f"internal error in {method}: {exc}"))

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=None,  # raw bytes: `decode` turns them into the request
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(raw, context):
                try:
                    if self.guard is not None:
                        self.guard(method, context)
                    async for item in inner_us(decode(raw), context):
                        yield item
                except InferxError as exc:
                    await abort_with(context, exc)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    log.exception("unhandled error in %s", method)
                    await abort_with(context, Internal(f"internal error in {method}: {exc}"))

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=None,  # raw bytes: `decode` turns them into the request
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None and self.guard is not None:
            # The hop streams (inferx.hopstream): the guard checks the stream once, when
            # it opens (its calls come from the peer that opened it); each call's errors
            # travel as that call's status on the stream.
            inner_ss = handler.stream_stream
            guard = self.guard

            async def stream_stream(request_iterator, context):
                try:
                    guard(method, context)
                except InferxError as exc:
                    await abort_with(context, exc)
                return await inner_ss(request_iterator, context)

            return grpc.stream_stream_rpc_method_handler(
                stream_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _decoder(deserialize: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any]:
    if deserialize is None:
        return lambda raw: raw

    def decode(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:  # protobuf's DecodeError, whichever implementation
            raise InvalidArgument(f"{method}: the request is not a valid protobuf message ({exc})") from None

    return decode


class ServiceComponent:
    """What a service plugs into the bootstrap. Override what you need."""

    #: fully-qualified gRPC service names, for health and reflection
    service_names: Sequence[str] = ()

    async def ready(self) -> None:
        """Warm up (load a model, sync from etcd). Health is NOT_SERVING until done."""

    async def draining(self) -> None:
        """Shutdown began (before deregistering and draining): hand over what others
        should take now rather than a lease TTL later (the scheduler's partitions)."""

    async def ending_streams(self) -> None:
        """The drain begins (no new calls are taken): end calls that would never end by
        themselves (server streams that follow state), so the drain does not wait on them."""

    async def stop(self) -> None:
        """Release resources after in-flight RPCs have drained."""


@dataclass
class ServiceRuntime:
    """What a component gets from the bootstrap."""

    kind: str
    settings: ServiceSettings
    server: grpc.aio.Server
    etcd: aetcd.Client
    leases: LeaseKeeper
    instance_id: str
    address: str
    metrics_address: str
    #: TLS or --insecure, decided at start-up: `transport` opens every channel this
    #: service opens (ChannelPool(runtime.transport)), with its own certificate.
    security: Security
    errors: ErrorMappingInterceptor = field(default_factory=ErrorMappingInterceptor)
    started_unix_ms: int = field(default_factory=lambda: int(time.time() * 1000))

    @property
    def transport(self) -> Transport:
        return self.security.transport

    @property
    def insecure(self) -> bool:
        """--insecure: plaintext, no peer certificates and (router) no token checks."""
        return self.security.insecure

    def guard_calls(self, guard: CallGuard) -> None:
        """Check every call to this service's own methods with `guard` first."""
        self.errors.guard = guard


BuildComponent = Callable[[ServiceRuntime], Awaitable[ServiceComponent]]


def run_service(
    kind: str,
    settings_cls: type[S],
    build: Callable[[ServiceRuntime, S], Awaitable[ServiceComponent]],
    argv: list[str] | None = None,
) -> None:
    """Entry point body shared by `inferx-<kind>` console scripts."""
    prog = f"inferx-{kind}"
    settings = load_settings(settings_cls, prog, argv)
    logging.basicConfig(
        level=settings.log_level,
        format=f"%(asctime)s {kind} %(levelname)s %(name)s: %(message)s",
    )
    # grpc/aetcd are chatty at INFO about reconnects we already report ourselves.
    logging.getLogger("aetcd").setLevel(logging.WARNING)
    try:
        with asyncio.Runner(loop_factory=_loop_factory(settings.uvloop)) as runner:
            runner.run(_serve(kind, settings, build))
    except StartupError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        pass


def _loop_factory(use_uvloop: bool) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed and wanted (--uvloop, the default): the
    loop's own cost per callback is part of every hop (issue #14); else asyncio's."""
    if not use_uvloop:
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class StartupError(Exception):
    """A clear, user-facing reason why a service could not start."""


def _health_only_server(
    health_servicer: health.aio.HealthServicer, host: str, port: int
) -> grpc.aio.Server | None:
    """--health-port: grpc.health.v1 alone, in plaintext, for probes that cannot present a
    client certificate (Kubernetes' native gRPC probes). It tells only SERVING or not."""
    if not port:
        return None
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:
        raise StartupError(f"cannot listen on {host}:{port} (--health-port): {exc}") from None
    if bound == 0:
        raise StartupError(f"cannot listen on {host}:{port} (--health-port; port in use?)")
    return server


def _start_metrics(host: str, port: int) -> str:
    from prometheus_client import start_http_server

    try:
        httpd, _thread = start_http_server(port, addr=host)
    except OSError as exc:
        raise StartupError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
    return f"{host}:{httpd.server_port}"


class ServiceInstance(Generic[S]):
    """One service in this process, from its gRPC server to its shutdown: `open` (server,
    etcd, the component built, NOT_SERVING), `start_serving` (warm-up, etcd registration,
    SERVING), `shutdown` (the order in this module's docstring).

    A process runs one (`run_service`), or a second one inside it: the router's embedded
    scheduler (`embedded=True`) shares the process's tracing and metrics endpoint (the
    metrics registry is the process's), and has its own port, etcd lease, registration,
    health and drain."""

    def __init__(
        self,
        kind: str,
        settings: S,
        build: Callable[[ServiceRuntime, S], Awaitable[ServiceComponent]],
        *,
        embedded_in: ServiceRuntime | None = None,
    ) -> None:
        self.kind = kind
        self.settings: S = settings
        self._build = build
        self._host = embedded_in
        self.runtime: ServiceRuntime | None = None
        self.component: ServiceComponent | None = None
        self._names: list[str] = []

    async def open(self) -> ServiceRuntime:
        kind, settings, host = self.kind, self.settings, self._host
        instance_id = (
            settings.instance_id or f"{kind}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        try:  # first: a service that cannot be secured says so and nothing else
            security = settings.security()
        except TlsError as exc:
            raise StartupError(str(exc)) from None
        log.info("starting %s %s with %s", kind, instance_id, settings.model_dump_json())
        if host is None:
            if security.insecure:
                print(insecure_warning(f"inferx-{kind}"), file=sys.stderr, flush=True)
            if security.etcd is None and not security.insecure:
                log.warning(
                    "etcd at %s is reached in PLAINTEXT (no --etcd-ca): anyone who can reach it can "
                    "register workers and tools",
                    settings.etcd,
                )
            try:
                telemetry.setup_tracing(
                    kind,
                    instance_id,
                    settings.trace_exporter,
                    otlp_endpoint=settings.otlp_endpoint,
                    trace_file=settings.trace_file,
                )
            except telemetry.TelemetryError as exc:
                raise StartupError(str(exc)) from None

        errors = ErrorMappingInterceptor()
        server = grpc.aio.server(
            # Tracing outermost: its span also covers the status the error mapping sets.
            interceptors=[*telemetry.server_interceptors(), errors],
            options=[
                ("grpc.so_reuseport", 0),
                # Larger messages are refused by gRPC itself, with RESOURCE_EXHAUSTED.
                ("grpc.max_receive_message_length", settings.max_request_bytes),
                *wire.server_options(
                    max_connection_age_s=settings.max_connection_age_s,
                    max_connection_age_grace_s=settings.max_connection_age_grace_s,
                    keepalive_time_s=settings.keepalive_time_s,
                    keepalive_timeout_s=settings.keepalive_timeout_s,
                ),
            ],
        )
        self._server = server
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)

        listen = f"{settings.host}:{settings.port}"
        credentials = security.server_credentials(require_client_auth=settings.tls_client_auth)
        try:
            if credentials is None:
                port = server.add_insecure_port(listen)
            else:
                port = server.add_secure_port(listen, credentials)
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on {settings.host}:{settings.port}: {exc}") from None
        if port == 0:
            raise StartupError(f"cannot listen on {settings.host}:{settings.port} (port in use?)")
        address = f"{settings.public_host}:{port}"
        self._health_server = _health_only_server(self._health, settings.host, settings.health_port)
        metrics_address = (
            host.metrics_address if host is not None else _start_metrics(settings.host, settings.metrics_port)
        )

        self._etcd = make_client(settings.etcd, tls=security.etcd, server_name=security.etcd_server_name)
        self._leases = LeaseKeeper(self._etcd, ttl_s=settings.lease_ttl_s)
        runtime = ServiceRuntime(
            kind=kind,
            settings=settings,
            server=server,
            etcd=self._etcd,
            leases=self._leases,
            instance_id=instance_id,
            address=address,
            metrics_address=metrics_address,
            security=security,
            errors=errors,
        )
        self.runtime = runtime
        self.component = await self._build(runtime, settings)
        self._names = list(self.component.service_names)
        reflection.enable_server_reflection(
            [*self._names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        for name in ["", *self._names]:
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

        await server.start()
        if self._health_server is not None:
            await self._health_server.start()
        if credentials is None:
            how = "PLAINTEXT"
        else:
            how = "TLS, client certificates required" if settings.tls_client_auth else "TLS"
        inside = " (in this router's process)" if host is not None else ""
        print(
            f"inferx-{kind} listening on {address}{inside} ({how}; metrics http://{metrics_address}/metrics)",
            flush=True,
        )
        return runtime

    async def start_serving(self) -> None:
        """Warm up, register in etcd, and answer SERVING; a failed warm-up raises
        StartupError (the caller shuts the instance down)."""
        assert self.runtime is not None and self.component is not None
        runtime = self.runtime
        try:
            await self.component.ready()
        except (asyncio.CancelledError, StartupError):
            raise  # a StartupError says what is wrong already
        except Exception as exc:
            raise StartupError(f"warm-up failed: {exc}") from None
        info = common_pb2.ServiceInfo(
            kind=self.kind,
            instance_id=runtime.instance_id,
            address=runtime.address,
            metrics_address=runtime.metrics_address,
            version=__version__,
            started_unix_ms=runtime.started_unix_ms,
        )
        await self._leases.put(service_key(self.kind, runtime.instance_id), to_json_bytes(info))
        self._leases.start()
        if not await self._leases.wait_registered(5.0):
            log.warning("etcd at %s not reachable yet; will register when it is", self.settings.etcd)
        for name in ["", *self._names]:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        print(f"inferx-{self.kind} ready ({runtime.instance_id})", flush=True)

    async def shutdown(self, *, now: bool = False) -> None:
        """Drain and stop (`now`: no grace, after a failed start)."""
        assert self.component is not None
        settings = self.settings
        if not now:
            log.info("%s shutting down: draining for up to %.1fs", self.kind, settings.drain_timeout_s)
        await _shutdown(
            self.kind,
            self._server,
            self._health,
            self._leases,
            self.component,
            self._etcd,
            0.0 if now else settings.drain_timeout_s,
            0.0 if now else settings.deregister_grace_s,
            self._health_server,
            self._names,
        )


async def start_embedded(
    kind: str,
    settings: S,
    build: Callable[[ServiceRuntime, S], Awaitable[ServiceComponent]],
    host: ServiceRuntime,
) -> ServiceInstance[S]:
    """Another service inside `host`'s process, serving once this returns (see
    `ServiceInstance`); StartupError if it cannot start (nothing of it is left running)."""
    instance = ServiceInstance(kind, settings, build, embedded_in=host)
    try:
        await instance.open()
        await instance.start_serving()
    except BaseException:
        if instance.component is not None:
            await instance.shutdown(now=True)
        raise
    return instance


async def _serve(
    kind: str, settings: S, build: Callable[[ServiceRuntime, S], Awaitable[ServiceComponent]]
) -> None:
    instance = ServiceInstance(kind, settings, build)
    await instance.open()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    warm_up = asyncio.create_task(instance.start_serving(), name="warm-up")
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({warm_up, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if warm_up.done() and warm_up.exception() is not None:
        failure = warm_up.exception()
        waiter.cancel()
        await instance.shutdown(now=True)
        assert failure is not None
        raise failure
    if not stop.is_set():
        await stop.wait()
    else:
        warm_up.cancel()
    waiter.cancel()
    await instance.shutdown()


async def _shutdown(
    kind: str,
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    leases: LeaseKeeper,
    component: ServiceComponent,
    etcd: aetcd.Client,
    grace_s: float,
    deregister_grace_s: float,
    health_server: grpc.aio.Server | None = None,
    service_names: Sequence[str] = (),
) -> None:
    await health_servicer.enter_graceful_shutdown()
    try:
        await component.draining()
    except Exception:
        log.exception("%s hand-over failed", kind)
    await leases.close(revoke=True)
    # Callers learn of the revoked lease through their etcd watch a moment later; keep
    # accepting calls that were already on their way meanwhile, so none is refused.
    await asyncio.sleep(deregister_grace_s)
    # Long-lived hop streams take no new hop from here on and end once theirs are done,
    # so the drain below waits for hops, not for streams that would never end. Only this
    # service's: an embedded scheduler's streams drain with it, after its router.
    hopstream.drain_all(service_names or None)
    stopping = asyncio.ensure_future(server.stop(grace_s))  # refuses new calls at once
    try:
        await component.ending_streams()  # and the component's own endless streams
    except Exception:
        log.exception("%s drain hook failed", kind)
    await stopping
    if health_server is not None:  # probes saw NOT_SERVING for the whole drain
        await health_server.stop(0)
    try:
        await component.stop()
    except Exception:
        log.exception("%s cleanup failed", kind)
    try:
        await etcd.close()
    except Exception:  # closing a dead channel is not worth reporting
        pass
    print(f"inferx-{kind} stopped", flush=True)


def to_json_bytes(message: Any) -> bytes:
    return json_format.MessageToJson(message, indent=None).encode()
