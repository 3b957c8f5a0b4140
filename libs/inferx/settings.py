"""Typed service configuration: one pydantic-settings object per service, read from
command-line flags and `INFERX_*` environment variables (flags win), printed at start."""

from __future__ import annotations

import sys
from typing import TypeVar

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

from inferx.etcd import parse_endpoint
from inferx.tls import ETCD_FLAGS, Security, TlsError, TlsFiles, check_server_name

S = TypeVar("S", bound="TransportSettings")


class TransportSettings(BaseSettings):
    """How a process reaches etcd and its peers: what every service and tool server takes.

    Secure by default: without --tls-ca/--tls-cert/--tls-key a process refuses to start
    unless --insecure says plaintext on purpose (see `security()`)."""

    model_config = SettingsConfigDict(
        env_prefix="INFERX_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        extra="ignore",
    )

    etcd: str = Field("127.0.0.1:2379", description="etcd endpoint HOST:PORT")
    tls_ca: str = Field("", description="CA bundle (PEM) that issued every peer's certificate (mutual TLS)")
    tls_cert: str = Field("", description="this process's certificate chain (PEM), server and client")
    tls_key: str = Field("", description="the private key of --tls-cert (PEM, unencrypted)")
    tls_client_auth: bool = Field(
        True, description="require callers to present a certificate issued by --tls-ca (mutual TLS)"
    )
    insecure: bool = Field(
        False,
        description="plaintext everywhere, no certificates, and (router) no tokens: development only; "
        "without it, the --tls-* files are required",
    )
    etcd_ca: str = Field("", description="CA bundle (PEM) of etcd's server certificate: reach etcd over TLS")
    etcd_cert: str = Field("", description="client certificate (PEM) presented to etcd (--client-cert-auth)")
    etcd_key: str = Field("", description="the private key of --etcd-cert (PEM)")
    tls_server_name: str = Field(
        "",
        description="verify every peer's certificate (services, workers, tool servers) against this "
        "DNS name instead of the address dialled, e.g. inferx.internal: peers are dialled by the pod "
        "IPs they register, so one certificate with this name serves every pod; empty = the address",
    )
    etcd_server_name: str = Field(
        "", description="verify etcd's certificate against this DNS name instead of the host of --etcd"
    )

    @field_validator("etcd")
    @classmethod
    def _etcd_endpoint(cls, value: str) -> str:
        parse_endpoint(value)
        return value

    @field_validator("tls_server_name", "etcd_server_name")
    @classmethod
    def _server_name(cls, value: str) -> str:
        if value:
            try:
                check_server_name(value)
            except TlsError:
                raise ValueError(
                    f"{value!r} is not a DNS name (e.g. inferx.internal; no port, no scheme)"
                ) from None
        return value

    def security(self) -> Security:
        """Read and check the TLS files (or accept --insecure); TlsError, one line, when
        they cannot work or when neither TLS files nor --insecure were given."""
        service = TlsFiles.from_options(self.tls_ca, self.tls_cert, self.tls_key)
        etcd = TlsFiles.from_options(self.etcd_ca, self.etcd_cert, self.etcd_key, ETCD_FLAGS)
        return Security.resolve(
            service,
            etcd,
            insecure=self.insecure,
            server_name=self.tls_server_name,
            etcd_server_name=self.etcd_server_name,
        )


class ServiceSettings(TransportSettings):
    """Options every service takes."""

    host: str = Field("127.0.0.1", description="address to bind the gRPC server to")
    advertise_host: str = Field("", description="host other services use to reach this one (default: --host)")
    port: int = Field(0, ge=0, le=65535, description="gRPC port (0 = pick a free port)")
    health_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="plaintext port serving only grpc.health.v1, for probes that cannot present a "
        "client certificate (Kubernetes gRPC probes); 0 = off",
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus /metrics port (0 = pick a free port)"
    )
    lease_ttl_s: int = Field(10, ge=2, le=300, description="etcd lease TTL in seconds")
    deregister_grace_s: float = Field(
        1.0, ge=0, le=30, description="on SIGTERM, keep accepting calls this long after deregistering"
    )
    drain_timeout_s: float = Field(
        15.0, ge=0, description="on SIGTERM, how long in-flight RPCs may take to finish"
    )
    # Mesh-friendly connections: gRPC channels live for ever, so an L4 load balancer (a
    # Kubernetes Service, a mesh's TCP proxy) would never move them to a new replica.
    max_connection_age_s: float = Field(
        300.0,
        ge=0,
        description="close each client connection after this long (a GOAWAY: clients reconnect, "
        "through the load balancer, so new replicas get their share); 0 = never",
    )
    # Long: a chain run, an agent's call or a model hop may take minutes, and a call still
    # running when the grace ends is cut; the aged connection closes as soon as its calls
    # are done, so a long grace costs nothing (hop streams move off it: inferx.hopstream).
    max_connection_age_grace_s: float = Field(
        3600.0, ge=0, description="calls in flight on a connection that aged out get this long to finish"
    )
    keepalive_time_s: float = Field(
        60.0, gt=0, description="ping a client whose connection has been quiet this long"
    )
    keepalive_timeout_s: float = Field(
        20.0, gt=0, description="close a connection whose ping went unanswered this long"
    )
    max_request_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        le=2**31 - 1,
        description="largest gRPC request this service accepts, in bytes; gRPC refuses a larger "
        "one with RESOURCE_EXHAUSTED (internal calls carry whole prompts, hence the room)",
    )
    hop_streams: bool = Field(
        True,
        description="send hops to schedulers and workers as messages on one long-lived stream per "
        "peer (Scheduler.Hops, ModelWorker.GenerateStream) instead of a call each",
    )
    uvloop: bool = Field(True, description="run the service on uvloop's event loop where it is installed")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    instance_id: str = Field("", description="unique id of this instance (default: generated)")
    # Tracing stays off unless asked for, so a plain start prints no exporter errors.
    trace_exporter: str = Field(
        "", description="none | console | otlp | file (default: otlp if an OTLP endpoint is set, else none)"
    )
    otlp_endpoint: str = Field("", description="OTLP/gRPC collector for traces, e.g. http://jaeger:4317")
    trace_file: str = Field("", description="with --trace-exporter file: append spans here as JSON lines")

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError("must be DEBUG, INFO, WARNING or ERROR")
        return level

    @field_validator("trace_exporter")
    @classmethod
    def _trace_exporter(cls, value: str) -> str:
        exporter = value.strip().lower()
        if exporter not in {"", "none", "console", "otlp", "file"}:
            raise ValueError("must be none, console, otlp or file")
        return exporter

    @property
    def public_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "[::]") else self.host


def load_settings(cls: type[S], prog: str, argv: list[str] | None = None) -> S:
    """Parse flags + env into `cls`; on bad input print one line per problem and exit 2."""
    args = sys.argv[1:] if argv is None else argv
    _set_prog(cls, prog)
    try:
        return CliApp.run(cls, cli_args=args, cli_settings_source=None)
    except ValidationError as exc:
        for err in exc.errors():
            if err["loc"]:
                field = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-")
                print(f"{prog}: error: {field}: {err['msg']}", file=sys.stderr)
            else:  # a rule across flags: its message names them
                print(f"{prog}: error: {err['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        raise SystemExit(2) from None


def _set_prog(cls: type[BaseSettings], prog: str) -> None:
    # CliApp takes the program name from the model config; set it per service.
    cls.model_config["cli_prog_name"] = prog
