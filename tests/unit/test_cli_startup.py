"""The CLI's start-up stays light: building the parser (what `inferx --help` does)
imports neither the gRPC client, protobuf messages, OpenTelemetry, the engines nor the
benchmark code; those load when a command that needs them runs. Checked by module,
not by time (no timing in unit tests); the figures are in docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from inferx.bench import results
from inferx.cli import bench_args

HEAVY = (
    "inferx.client",
    "inferx.telemetry",
    "inferx.discovery",
    "inferx.v1.router_pb2",
    "google.protobuf.json_format",
    "opentelemetry",
    "aetcd",
    "httpx",
    "pydantic",
    "numpy",
    "inferx_worker.engines.registry",
    "inferx.cli.bench",
    "inferx.bench.runner",
    "inferx.sim.profile",
    "rich.progress",
    "cryptography",
)
# What `up --help` may load besides: it lists the registered engines, so the engine
# registry imports the engine modules (and what they import).
ENGINES = ("inferx_worker", "httpx", "pydantic", "numpy", "inferx.sim", "rich.progress")

PROBE = """
import json, sys
from inferx.cli.main import build_parser
parser = build_parser()
try:
    parser.parse_args(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""


def loaded_after(*argv: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60, check=True
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["bench", "--help"], ["up", "--help"]])
def test_building_the_parser_and_help_import_nothing_heavy(argv: list[str]) -> None:
    loaded = loaded_after(*argv)
    heavy = sorted(
        m
        for m in loaded
        if m in HEAVY or m.split(".")[0] in ("opentelemetry", "aetcd", "numpy", "cryptography")
    )
    if argv == ["up", "--help"]:
        assert "inferx_worker.engines.registry" in loaded
        heavy = [m for m in heavy if not m.startswith(ENGINES)]
    assert heavy == []


def test_up_checks_its_engine_against_the_registry_when_used(capsys) -> None:
    from inferx.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["up", "--engine", "sim"]).engine == "sim"
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--engine", "bogus"])
    assert "invalid choice: 'bogus' (choose from 'vllm', 'sim')" in capsys.readouterr().err


def test_the_parsers_results_directory_is_the_one_results_are_written_to() -> None:
    assert bench_args.RESULTS_DIR == results.RESULTS_DIR.as_posix()


def test_up_takes_a_replica_count_of_at_least_one(capsys) -> None:
    from inferx.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["up"]).replicas == 1
    assert parser.parse_args(["up", "--replicas", "3"]).replicas == 3
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["up", "--replicas", bad])
    err = capsys.readouterr().err
    assert "must be at least 1, got 0" in err and "expected a whole number, got 'two'" in err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["call", "m", "p", "--max-tokens", "-1"], "argument --max-tokens: must be at least 0, got -1"),
        (["call", "m", "p", "--max-tokens", str(2**32)], "must be at most 4,294,967,295, got 4,294,967,296"),
        (["call", "m", "p", "--deadline-ms", "-5"], "argument --deadline-ms: must be at least 0"),
        (["run", "c", "--version", "-1"], "argument --version: must be at least 0"),
        (
            ["chain", "put", "f.yaml", "--expect-version", "-1"],
            "argument --expect-version: must be at least 0",
        ),
        (["chain", "get", "c", "--version", "-2"], "argument --version: must be at least 0"),
        (["chain", "diff", "c", "0", "2"], "argument v1: must be at least 1, got 0"),
        (["chain", "label", "c", "prod", "x"], "argument version: expected a whole number, got 'x'"),
        (["chain", "rollback", "c", "--to", "-1"], "argument --to: must be at least 0"),
        (["stats", "c", "--last", "-1"], "argument --last: must be at least 0"),
        (
            ["tenant", "create", "t", "--tokens-per-minute", "-1"],
            "argument --tokens-per-minute: must be at least 0",
        ),
        (["up", "--http-port", "70000"], "argument --http-port: must be at most 65,535"),
        (["up", "--workers", "-1"], "argument --workers: must be at least 0"),
        (["bench", "--chains", "-1"], "argument --chains: must be at least 1, got -1"),
        (["workload", "-o", "x", "--seed", "-3"], "argument --seed: must be at least 0"),
    ],
)
def test_a_whole_number_out_of_range_is_a_usage_error_naming_its_option(argv, said, capsys) -> None:
    """Not a protobuf "Value out of range" traceback from the request, nor a stack
    started for -1 chains: argparse's usage error (exit 2), naming the option."""
    from inferx.cli.main import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def test_replicas_listen_on_their_kinds_port_plus_100_each() -> None:
    from inferx.devstack import StackPorts

    ports = StackPorts()
    assert [ports.replica_port("router", i) for i in range(3)] == [50051, 50151, 50251]
    assert ports.replica_port("scheduler", 1) == 50152
    assert ports.replica_port("cache", 2) == 50254
    # the tests' free ports: every replica on a port of its own choosing
    assert StackPorts.free().replica_port("router", 1) == 0


def test_up_with_embedded_scheduler_starts_routers_that_run_it_on_the_scheduler_s_port(
    monkeypatch, tmp_path
) -> None:
    from inferx.cli.main import build_parser
    from inferx.devstack import LocalStack, ManagedProcess, StackPorts

    assert build_parser().parse_args(["up", "--embedded-scheduler"]).embedded_scheduler
    # The default (issue #45): the faster stack, one process crossing fewer per hop.
    assert build_parser().parse_args(["up"]).embedded_scheduler
    assert not build_parser().parse_args(["up", "--no-embedded-scheduler"]).embedded_scheduler
    monkeypatch.setattr(ManagedProcess, "start", lambda self: None)  # argv only, nothing started
    stack = LocalStack(
        tmp_path,
        StackPorts(),
        insecure=True,
        embedded_scheduler=True,
        scheduler_flags=["--policy", "session-affinity"],
    )
    argv = [stack.start_service("router", replica=i).argv for i in range(2)]
    for replica, args in enumerate(argv):
        assert "--embedded-scheduler" in args
        assert args[args.index("--scheduler-port") + 1] == str(50052 + 100 * replica)
        assert args[args.index("--scheduler-flags") + 1] == "--policy session-affinity"
