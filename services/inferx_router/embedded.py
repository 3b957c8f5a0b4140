"""The router's embedded scheduler (`inferx-router --embedded-scheduler`, issue #14).

A hop through InferX crosses two processes more than a direct call to the worker:
router -> scheduler, scheduler -> worker, each about one direct call's cost on a small
box. With this option the router runs a scheduler in its own process and event loop: a
real `inferx-scheduler` in every respect -- its own port (`--scheduler-port`, mutual TLS
like every internal port), etcd lease, registration, partition election, health and
drain -- so other routers reach it over gRPC and it fails over like any scheduler. What
changes is this router's hops to the pools it owns: they call the scheduler's handler
in-process (`hopstream.LocalPeer`), one gRPC crossing fewer per hop. A pool owned by
another scheduler is reached over gRPC as before.

What the embedded scheduler takes from the router: etcd, TLS, host, lease TTL, hop
streams, drain and log settings (one process, one identity on the network); the rest of
`inferx-scheduler`'s flags (policy, queue bounds, reservations...) go in
`--scheduler-flags`. Its metrics are on the router's metrics endpoint (one registry per
process) and it traces as the router's process.

Costs, said plainly: the scheduler's dispatch shares the router's CPU core (one event
loop), so a router replica sized for N hops/s now also carries the scheduler's share of
them; and a router that dies takes its pools' partitions with it (they move to another
scheduler after the lease TTL, as when a scheduler dies).
"""

from __future__ import annotations

import shlex

from inferx.hopstream import StreamPool
from inferx.server import ServiceInstance, ServiceRuntime, StartupError, start_embedded
from inferx.settings import ConfigError, ServiceSettings, parse_settings
from inferx_scheduler.__main__ import SchedulerComponent
from inferx_scheduler.__main__ import build as build_scheduler
from inferx_scheduler.config import SchedulerSettings

# What the embedded scheduler takes from its router, whatever --scheduler-flags say.
INHERITED = (
    "etcd",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "insecure",
    "etcd_ca",
    "etcd_cert",
    "etcd_key",
    "tls_server_name",
    "etcd_server_name",
    "host",
    "advertise_host",
    "lease_ttl_s",
    "deregister_grace_s",
    "drain_timeout_s",
    "max_connection_age_s",
    "max_connection_age_grace_s",
    "keepalive_time_s",
    "keepalive_timeout_s",
    "hop_streams",
    "uvloop",
    "log_level",
    "trace_exporter",
    "otlp_endpoint",
    "trace_file",
)

PROG = "inferx-router --scheduler-flags"


def parse_scheduler_flags(flags: str) -> SchedulerSettings:
    """`--scheduler-flags` as `inferx-scheduler` would read them (a `--config FILE` among
    them included; $INFERX_CONFIG is the router's, not read here); ValueError naming the
    problem (a flag it does not take, a bad value, a bad file) -- checked when the router
    starts."""
    try:
        argv = shlex.split(flags)
    except ValueError as exc:
        raise ValueError(f"cannot split into flags: {exc}") from None
    try:
        return parse_settings(SchedulerSettings, PROG, argv, config_env=False)
    except SystemExit:  # argparse said why on stderr (an unknown flag, a missing value)
        raise ValueError(f"not flags of inferx-scheduler: {flags!r} (see above)") from None
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def scheduler_settings(router: ServiceSettings, flags: str, port: int) -> SchedulerSettings:
    """The embedded scheduler's settings: `flags`, with the router's transport, etcd,
    host and drain settings, on `port`, without a metrics or health port of its own."""
    parsed = parse_scheduler_flags(flags)
    inherited = {name: getattr(router, name) for name in INHERITED}
    return parsed.model_copy(
        update={
            **inherited,
            "port": port,
            "metrics_port": 0,
            "health_port": 0,
            "instance_id": "",
            "tls_client_auth": True,  # an internal port: only peers with the stack's certificate
        }
    )


async def start(
    runtime: ServiceRuntime, settings: SchedulerSettings, streams: StreamPool
) -> ServiceInstance[SchedulerSettings]:
    """Start the scheduler in this process and send this router's hops for it in-process."""
    try:
        instance = await start_embedded("scheduler", settings, build_scheduler, runtime)
    except StartupError as exc:
        raise StartupError(f"the embedded scheduler: {exc}") from None
    component = instance.component
    assert isinstance(component, SchedulerComponent) and instance.runtime is not None
    streams.serve_locally(instance.runtime.address, component.servicer.SubmitHop)
    return instance
