"""Typed service configuration: one pydantic-settings object per service, read from
command-line flags and `INFERX_*` environment variables (flags win), printed at start."""

from __future__ import annotations

import sys
from typing import TypeVar

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

from inferx.etcd import parse_endpoint

S = TypeVar("S", bound="ServiceSettings")


class ServiceSettings(BaseSettings):
    """Options every service takes."""

    model_config = SettingsConfigDict(
        env_prefix="INFERX_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        extra="ignore",
    )

    etcd: str = Field("127.0.0.1:2379", description="etcd endpoint HOST:PORT")
    host: str = Field("127.0.0.1", description="address to bind the gRPC server to")
    advertise_host: str = Field("", description="host other services use to reach this one (default: --host)")
    port: int = Field(0, ge=0, le=65535, description="gRPC port (0 = pick a free port)")
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
    max_request_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        le=2**31 - 1,
        description="largest gRPC request this service accepts, in bytes; gRPC refuses a larger "
        "one with RESOURCE_EXHAUSTED (internal calls carry whole prompts, hence the room)",
    )
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    instance_id: str = Field("", description="unique id of this instance (default: generated)")
    # Tracing stays off unless asked for, so a plain start prints no exporter errors.
    trace_exporter: str = Field(
        "", description="none | console | otlp | file (default: otlp if an OTLP endpoint is set, else none)"
    )
    otlp_endpoint: str = Field("", description="OTLP/gRPC collector for traces, e.g. http://jaeger:4317")
    trace_file: str = Field("", description="with --trace-exporter file: append spans here as JSON lines")

    @field_validator("etcd")
    @classmethod
    def _etcd_endpoint(cls, value: str) -> str:
        parse_endpoint(value)
        return value

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
            field = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-")
            print(f"{prog}: error: {field}: {err['msg']}", file=sys.stderr)
        raise SystemExit(2) from None


def _set_prog(cls: type[BaseSettings], prog: str) -> None:
    # CliApp takes the program name from the model config; set it per service.
    cls.model_config["cli_prog_name"] = prog
