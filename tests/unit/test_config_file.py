"""`--config FILE`: every service's settings from a YAML file (inferx.settings), below
flags and INFERX_* variables, above defaults; what it refuses, by name; the examples of
deploy/config/ are valid."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from inferx.settings import ConfigError, TransportSettings, load_settings, parse_settings
from inferx.toolserver import ToolServerSettings
from inferx_cache.__main__ import CacheSettings
from inferx_router.__main__ import RouterSettings
from inferx_router.embedded import parse_scheduler_flags
from inferx_worker.config import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "config"
# deploy/config/<name>.yaml -> the settings class of the service it is for
SERVICES = {
    "router": ("inferx_router.__main__", "RouterSettings"),
    "scheduler": ("inferx_scheduler.config", "SchedulerSettings"),
    "memory-pool": ("inferx_memory_pool.__main__", "MemoryPoolSettings"),
    "cache": ("inferx_cache.__main__", "CacheSettings"),
    "worker": ("inferx_worker.config", "WorkerSettings"),
}


@pytest.fixture(autouse=True)
def no_inferx_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what a test sets: none of the environment's INFERX_* variables."""
    for name in list(os.environ):
        if name.upper().startswith("INFERX_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def cache(*argv: str) -> CacheSettings:
    return parse_settings(CacheSettings, "inferx-cache", list(argv))


def refused(capsys: pytest.CaptureFixture[str], cls: type[TransportSettings], *argv: str) -> list[str]:
    """The error lines of a start that load_settings refuses (exit status 2, no traceback)."""
    with pytest.raises(SystemExit) as exit_:
        load_settings(cls, "inferx-x", list(argv))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert lines and all(line.startswith("inferx-x: error: ") for line in lines), err
    return [line.removeprefix("inferx-x: error: ") for line in lines]


def test_the_file_sets_what_flags_and_environment_do_not(tmp_path: Path) -> None:
    path = write(tmp_path, "port: 7001\nmax_bytes: 4096\ninsecure: true\nlog_level: debug\n")
    settings = cache("--config", str(path))
    assert (settings.port, settings.max_bytes, settings.insecure) == (7001, 4096, True)
    assert settings.log_level == "DEBUG"  # through the same validators as a flag
    assert settings.default_ttl_s == 300.0  # not in the file: the default
    assert settings.config == str(path)


def test_precedence_is_flags_then_environment_then_file_then_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, "port: 7001\nmetrics_port: 9001\nhealth_port: 8001\n")
    argv = ["--config", str(path)]
    monkeypatch.setenv("INFERX_PORT", "7002")
    monkeypatch.setenv("INFERX_METRICS_PORT", "9002")
    settings = cache(*argv, "--port", "7003")
    assert settings.port == 7003  # flag > environment > file
    assert settings.metrics_port == 9002  # environment > file
    assert settings.health_port == 8001  # file > default
    assert settings.lease_ttl_s == 10  # the default
    assert cache("--port", "7003").health_port == 0  # no file: the default


def test_keys_are_setting_names_or_flag_spellings(tmp_path: Path) -> None:
    path = write(tmp_path, "max-bytes: 2048\ndefault_ttl_s: 5\nlease-ttl-s: 4\n")
    settings = cache("--config", str(path))
    assert (settings.max_bytes, settings.default_ttl_s, settings.lease_ttl_s) == (2048, 5.0, 4)
    assert cache(f"--config={path}").max_bytes == 2048


def test_inferx_config_names_the_file_when_the_flag_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERX_CONFIG", str(write(tmp_path, "port: 7001\n", "env.yaml")))
    assert cache().port == 7001
    assert cache("--config", str(write(tmp_path, "port: 7002\n", "flag.yaml"))).port == 7002


def test_an_empty_file_sets_nothing(tmp_path: Path) -> None:
    assert cache("--config", str(write(tmp_path, "# nothing yet\n"))).port == 0


def test_a_required_setting_may_come_from_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "model: qwen-7b\nengine: sim\n")
    settings = parse_settings(WorkerSettings, "inferx-worker", ["--config", str(path)])
    assert (settings.model, settings.engine) == ("qwen-7b", "sim")


def test_tool_servers_take_a_config_file_too(tmp_path: Path) -> None:
    path = write(tmp_path, "port: 7005\ninstance_id: weather-1\n")
    settings = parse_settings(ToolServerSettings, "weather-tool", ["--config", str(path)])
    assert (settings.port, settings.instance_id) == (7005, "weather-1")


def test_an_unknown_key_is_refused_naming_it_and_the_file(tmp_path: Path, capsys) -> None:
    path = write(tmp_path, "port: 7001\nmax_byte: 1\nbogus: 2\n")
    assert refused(capsys, CacheSettings, "--config", str(path)) == [
        f"config file {path}: unknown key 'max_byte' (did you mean 'max_bytes'?)",
        f"config file {path}: unknown key 'bogus' (docs/configuration.md lists the keys)",
    ]
    # a setting of another service is unknown here
    other = write(tmp_path, "knowledge_base: kb.jsonl\n", "router-only.yaml")
    assert refused(capsys, CacheSettings, "--config", str(other)) == [
        f"config file {other}: unknown key 'knowledge_base' (docs/configuration.md lists the keys)"
    ]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("max_bytes: 1\nmax-bytes: 2\n", "'max_bytes' and 'max-bytes' are the same setting"),
        ("config: other.yaml\n", "unknown key 'config' (a config file cannot name another)"),
        ("1: x\n", "unknown key 1"),
        ("- port: 1\n", "must be a mapping of settings (key: value), not a list"),
        ("just words\n", "must be a mapping of settings (key: value), not a single value ('just words')"),
        ("port: [1\n", "not valid YAML: line 2, column 1: expected ',' or ']'"),
        (
            "port: 1\n---\nport: 2\n",
            "not valid YAML: line 2, column 1: expected a single document in the stream, but found another",
        ),
    ],
)
def test_a_file_that_is_not_a_mapping_of_settings_is_refused(
    tmp_path: Path, capsys, text: str, problem: str
) -> None:
    path = write(tmp_path, text)
    [line] = refused(capsys, CacheSettings, "--config", str(path))
    assert line.startswith(f"config file {path}: {problem}"), line


def test_a_missing_or_unreadable_file_is_refused(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "missing.yaml"
    assert refused(capsys, CacheSettings, "--config", str(missing)) == [
        f"config file {missing}: no such file"
    ]
    assert refused(capsys, CacheSettings, "--config", str(tmp_path)) == [
        f"config file {tmp_path}: is a directory, not a file"
    ]
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"port: \xff\xfe\n")
    assert refused(capsys, CacheSettings, "--config", str(binary)) == [
        f"config file {binary}: not UTF-8 text"
    ]
    if os.geteuid() != 0:  # root reads it anyway
        locked = write(tmp_path, "port: 1\n", "locked.yaml")
        locked.chmod(0)
        assert refused(capsys, CacheSettings, "--config", str(locked)) == [
            f"config file {locked}: cannot read it: Permission denied"
        ]


def test_a_bad_value_names_where_it_came_from(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, "port: 70000\nmax_bytes: lots\n")
    assert refused(capsys, CacheSettings, "--config", str(path)) == [
        f"config file {path}: port: Input should be less than or equal to 65535",
        f"config file {path}: max_bytes: Input should be a valid integer, "
        "unable to parse string as an integer",
    ]
    # overridden, the file's bad value is not used, so not refused
    settings = cache("--config", str(path), "--port", "1", "--max-bytes", "10")
    assert (settings.port, settings.max_bytes) == (1, 10)
    monkeypatch.setenv("INFERX_MAX_BYTES", "0")  # the environment's bad value: as a flag's
    assert refused(capsys, CacheSettings, "--config", str(path), "--port", "1") == [
        "--max-bytes: Input should be greater than 0"
    ]


def test_a_rule_across_settings_sees_the_file(tmp_path: Path, capsys) -> None:
    path = write(tmp_path, "max_output_tokens: 10\ndefault_max_output_tokens: 20\n")
    assert refused(capsys, RouterSettings, "--config", str(path)) == [
        "--default-max-output-tokens 20 is over --max-output-tokens 10"
    ]
    settings = load_settings(
        RouterSettings, "inferx-router", ["--config", str(path), "--max-output-tokens", "30"]
    )
    assert settings.request_limits.default_output_tokens == 20


def test_errors_are_config_errors_for_callers_that_do_not_exit(tmp_path: Path) -> None:
    path = write(tmp_path, "bogus: 1\n")
    with pytest.raises(ConfigError) as exc:
        cache("--config", str(path))
    assert exc.value.problems == [
        f"config file {path}: unknown key 'bogus' (docs/configuration.md lists the keys)"
    ]


def test_the_embedded_scheduler_reads_its_own_file_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = write(tmp_path, "policy: session-affinity\nmax_queued_per_pool: 77\n", "scheduler.yaml")
    parsed = parse_scheduler_flags(f"--config {scheduler} --max-queued-per-pool 78")
    assert (parsed.policy, parsed.max_queued_per_pool) == ("session-affinity", 78)
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        parse_scheduler_flags(f"--config {write(tmp_path, 'bogus: 1', 'bad.yaml')}")
    # The router's file (--config or $INFERX_CONFIG) sets the router, not its scheduler.
    router_file = write(
        tmp_path,
        "insecure: true\nembedded_scheduler: true\nport: 7001\nhttp_port: 8001\n"
        f"scheduler_flags: --config {scheduler}\n",
        "router.yaml",
    )
    monkeypatch.setenv("INFERX_CONFIG", str(router_file))
    router = load_settings(RouterSettings, "inferx-router", [])
    assert (router.port, router.http_port, router.embedded_scheduler) == (7001, 8001, True)
    embedded = parse_scheduler_flags(router.scheduler_flags)
    assert embedded.policy == "session-affinity" and embedded.port == 0 and embedded.config == str(scheduler)
    assert parse_scheduler_flags("").config == ""  # $INFERX_CONFIG is not read for it


def test_help_lists_config(capsys) -> None:
    with pytest.raises(SystemExit):
        load_settings(CacheSettings, "inferx-cache", ["--help"])
    assert "--config str" in capsys.readouterr().out


def test_every_example_is_a_valid_config_of_its_service() -> None:
    examples = sorted(EXAMPLES.glob("*.yaml"))
    assert {p.stem for p in examples} == set(SERVICES), "deploy/config/: one example per service"
    for path in examples:
        module, name = SERVICES[path.stem]
        cls = getattr(importlib.import_module(module), name)
        settings = parse_settings(cls, f"inferx-{path.stem}", ["--config", str(path)])
        assert settings.config == str(path)
        assert settings.model_fields_set - {"config"}, f"{path} sets nothing"
