"""`inferx-router --embedded-scheduler`'s flags: what the embedded scheduler takes from
`--scheduler-flags` and what from its router, and a clear error for each bad input."""

from __future__ import annotations

import pytest

from inferx.settings import load_settings
from inferx_router.__main__ import RouterSettings
from inferx_router.embedded import parse_scheduler_flags, scheduler_settings


def router(*argv: str) -> RouterSettings:
    return load_settings(RouterSettings, "inferx-router", ["--insecure", *argv])


def test_the_scheduler_takes_its_flags_and_the_router_s_transport_and_drain() -> None:
    settings = router(
        "--embedded-scheduler",
        "--scheduler-port",
        "50099",
        "--scheduler-flags",
        "--policy session-affinity --max-queued-per-pool 77 --etcd 10.0.0.9:2379 --port 1",
        "--etcd",
        "127.0.0.1:23790",
        "--lease-ttl-s",
        "4",
        "--drain-timeout-s",
        "3",
        "--host",
        "0.0.0.0",
    )
    scheduler = scheduler_settings(settings, settings.scheduler_flags, settings.scheduler_port)
    assert scheduler.policy == "session-affinity" and scheduler.max_queued_per_pool == 77
    # one process, one identity on the network: the router's, whatever the flags said
    assert scheduler.etcd == "127.0.0.1:23790" and scheduler.port == 50099
    assert scheduler.lease_ttl_s == 4 and scheduler.drain_timeout_s == 3 and scheduler.host == "0.0.0.0"
    assert scheduler.insecure and scheduler.tls_client_auth  # an internal port
    assert scheduler.metrics_port == 0 and scheduler.health_port == 0


def test_scheduler_options_without_embedded_scheduler_are_an_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        router("--scheduler-flags", "--policy chain-aware")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "inferx-router: error: --scheduler-flags and --scheduler-port need --embedded-scheduler" in err


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ("--policy nope", "unknown policy 'nope'"),
        ("--max-queued-per-pool 0", "--max-queued-per-pool: Input should be greater than 0"),
        ("--bogus 1", "not flags of inferx-scheduler"),
        ("--policy 'unclosed", "cannot split into flags"),
    ],
)
def test_bad_scheduler_flags_are_refused_at_start_saying_why(flags: str, said: str, capsys) -> None:
    with pytest.raises(ValueError, match=said.replace("(", r"\(")):
        parse_scheduler_flags(flags)
    with pytest.raises(SystemExit) as exit_:
        router("--embedded-scheduler", "--scheduler-flags", flags)
    assert exit_.value.code == 2
    assert "--scheduler-flags" in capsys.readouterr().err
