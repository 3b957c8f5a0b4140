"""Typed service configuration: one pydantic-settings object per service, read from
command-line flags, `INFERX_*` environment variables and a YAML file (`--config`), in
that order of precedence over the defaults, and printed at start.

The file's keys are the settings' names, as in docs/configuration.md (generated from
these classes by `inferx.settings_doc`): `max_bytes`, or the flag's spelling without its
dashes, `max-bytes`. A key the service does not take, a missing or unreadable file, or
one that is not a mapping is an error naming the file (and the key), never ignored.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import Field, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from inferx.etcd import parse_endpoint
from inferx.tls import ETCD_FLAGS, Security, TlsError, TlsFiles, check_server_name

S = TypeVar("S", bound="TransportSettings")

#: the environment variable naming the config file when --config does not
CONFIG_ENV = "INFERX_CONFIG"


class ConfigError(ValueError):
    """Settings that cannot be used: one line per problem, each naming the flag, or the
    file and its key, that is wrong (without the program's name)."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


# The file read for the settings class being built now (parse_settings): a source of
# that class alone, so settings built meanwhile for another class (the router's
# embedded scheduler, validating --scheduler-flags) never see another service's file.
_FILE_VALUES: ContextVar[tuple[type[BaseSettings], dict[str, Any]] | None] = ContextVar(
    "inferx_config_file", default=None
)


class ConfigFileSource(PydanticBaseSettingsSource):
    """The values of the --config file, below flags and environment, above defaults."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ gives the file's values whole

    def __call__(self) -> dict[str, Any]:
        loaded = _FILE_VALUES.get()
        if loaded is None or loaded[0] is not self.settings_cls:
            return {}
        return dict(loaded[1])


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

    config: str = Field(
        "",
        description="YAML file of settings, keyed by these settings' names (snake_case, or the flags' "
        "kebab-case spelling); flags and INFERX_* variables win over it",
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

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags come before all of these (pydantic-settings puts the CLI source first),
        # the defaults after: flags > keyword arguments > INFERX_* > --config file > defaults.
        return (
            init_settings,
            env_settings,
            dotenv_settings,
            file_secret_settings,
            ConfigFileSource(settings_cls),
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
    """Parse flags + env + --config file into `cls`; on bad input print one line per
    problem and exit 2."""
    args = sys.argv[1:] if argv is None else argv
    try:
        return parse_settings(cls, prog, args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"{prog}: error: {problem}", file=sys.stderr)
        raise SystemExit(2) from None


def parse_settings(cls: type[S], prog: str, argv: Sequence[str], *, config_env: bool = True) -> S:
    """`argv` (flags), the INFERX_* environment and the config file (--config, else
    $INFERX_CONFIG where `config_env`) as `cls`. ConfigError, one line per problem,
    for bad values or a bad file; argparse's SystemExit(2) for flags it cannot parse."""
    cli: CliSettingsSource[S] = CliSettingsSource(
        cls, cli_prog_name=prog, case_sensitive=cls.model_config.get("case_sensitive", False)
    )
    cli(args=list(argv))
    given = cli()
    path = str(given.get("config") or "")
    if not path and config_env:
        path = _config_from_env()
    values = read_config_file(cls, path) if path else {}
    token = _FILE_VALUES.set((cls, values))
    try:
        settings = cls(_cli_settings_source=cli)
    except ValidationError as exc:
        raise ConfigError(_problems(cls, exc, set(given), path, values)) from None
    finally:
        _FILE_VALUES.reset(token)
    settings.config = path  # the file read (an INFERX_CONFIG left unread by config_env is not)
    return settings


def _config_from_env() -> str:
    # As pydantic-settings reads INFERX_* (case_sensitive off): any case.
    for name, value in os.environ.items():
        if name.upper() == CONFIG_ENV and value:
            return value
    return ""


def config_keys(cls: type[BaseSettings]) -> dict[str, str]:
    """Every key a config file of `cls` may have -> the setting it sets: each setting's
    name and its flag's spelling (kebab-case), except `config` itself."""
    keys: dict[str, str] = {}
    for name in cls.model_fields:
        if name != "config":
            keys[name] = keys[name.replace("_", "-")] = name
    return keys


def read_config_file(cls: type[BaseSettings], path: str) -> dict[str, Any]:
    """The settings a YAML config file gives `cls`, by setting name (values unvalidated:
    `cls` validates them with its other sources). ConfigError naming the file and each
    key it does not take, or why it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"config file {path}: no such file"]) from None
    except IsADirectoryError:
        raise ConfigError([f"config file {path}: is a directory, not a file"]) from None
    except UnicodeDecodeError:
        raise ConfigError([f"config file {path}: not UTF-8 text"]) from None
    except OSError as exc:
        raise ConfigError([f"config file {path}: cannot read it: {exc.strerror or exc}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"config file {path}: not valid YAML: {_yaml_problem(exc)}"]) from None
    if data is None:  # empty, or comments only
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [f"config file {path}: must be a mapping of settings (key: value), not {_kind(data)}"]
        )
    keys = config_keys(cls)
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    problems = []
    for key, value in data.items():
        name = keys.get(key) if isinstance(key, str) else None
        if name is None:
            problems.append(f"config file {path}: unknown key {key!r}{_did_you_mean(key, keys)}")
        elif name in values:
            problems.append(f"config file {path}: {spelled[name]!r} and {key!r} are the same setting")
        else:
            values[name], spelled[name] = value, key
    if problems:
        raise ConfigError(problems)
    return values


def _did_you_mean(key: object, keys: dict[str, str]) -> str:
    if key == "config":
        return " (a config file cannot name another)"
    close = difflib.get_close_matches(str(key), [k for k in keys if "-" not in k], n=1)
    return f" (did you mean {close[0]!r}?)" if close else " (docs/configuration.md lists the keys)"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        context = exc.context or ""
        said = f"{context}, {exc.problem}" if context and not context.startswith("while ") else exc.problem
        return f"line {mark.line + 1}, column {mark.column + 1}: {said}"
    return " ".join(str(exc).split())


def _kind(data: object) -> str:
    if isinstance(data, list):
        return "a list"
    return f"a single value ({data!r})"


def _problems(
    cls: type[BaseSettings],
    exc: ValidationError,
    flags: set[str],
    path: str,
    values: dict[str, Any],
) -> list[str]:
    """One line per error, naming where the bad value came from: its flag (or its
    INFERX_* variable, as --flag), or the config file and key."""
    env: set[str] | None = None
    problems = []
    for err in exc.errors():
        if not err["loc"]:  # a rule across settings: its message names them
            problems.append(err["msg"].removeprefix("Value error, "))
            continue
        field = str(err["loc"][0])
        if field in values and field not in flags:
            if env is None:
                env = set(EnvSettingsSource(cls)())
            if field not in env:
                where = ".".join(str(p) for p in err["loc"])
                problems.append(f"config file {path}: {where}: {err['msg']}")
                continue
        flag = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-")
        problems.append(f"{flag}: {err['msg']}")
    return problems
