"""deploy/ checked offline (Docker is not needed): the compose file is consistent with
itself and the repository, the Grafana dashboard uses only metrics that exist, and
Prometheus accepts the config, the rules and the alert unit tests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

import inferx_cache.__main__  # noqa: F401  (registers the cache's metrics)
import inferx_memory_pool.metrics  # noqa: F401
import inferx_scheduler.metrics  # noqa: F401
import inferx_worker.metrics  # noqa: F401
from inferx_router import metrics as router_metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMQL_WORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: run `make setup` (deploy/scripts/ensure-command.sh installs it)")
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def known_metric_names() -> set[str]:
    """Every series name our services can expose, plus recording rules and `up`."""
    names = {"up", router_metrics.BreakerCollector(dict).describe().__next__().name}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for family in REGISTRY.collect():
        for suffix in suffixes.get(family.type, ("",)):
            names.add(family.name + suffix)
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    names |= {rule["record"] for group in rules["groups"] for rule in group["rules"] if "record" in rule}
    return names


def metric_names(expr: str) -> set[str]:
    """Series names an expression selects (functions, labels and keywords removed)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    found = set()
    for match in re.finditer(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        if expr[match.end() :].lstrip().startswith("(") or match.group(0).lower() in PROMQL_WORDS:
            continue
        found.add(match.group(0))
    return found


def test_metric_name_extraction() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, chain) "
        '(rate(inferx_chain_latency_seconds_bucket{chain=~"$chain"}[5m]))) '
        "/ on (chain) group_left max by (chain) (inferx_chain_slo_target_ratio) > bool 0.5"
    )
    assert metric_names(expr) == {"inferx_chain_latency_seconds_bucket", "inferx_chain_slo_target_ratio"}


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "inferx.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    # Template variables: label_values(METRIC, LABEL) -> METRIC
    exprs += [
        re.sub(r"label_values\((\w+),.*", r"\1", v["definition"]) for v in dashboard["templating"]["list"]
    ]
    return exprs


def test_dashboard_parses_and_uses_only_metrics_that_exist() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "inferx.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    exprs = dashboard_exprs()
    assert len(exprs) > 20
    known = known_metric_names()
    used = set().union(*(metric_names(e) for e in exprs))
    assert used - known == set()
    # The list: SLO, per-hop latency, queues, KV, caches, degradations.
    for needed in (
        "inferx:chain_slo_attainment:ratio_rate5m",
        "inferx_node_latency_seconds_bucket",
        "inferx_scheduler_queue_depth",
        "inferx_hop_queue_wait_seconds_bucket",
        "inferx_memory_kv_usage_ratio",
        "inferx_model_cached_prompt_tokens_total",
        "inferx_tool_cache_lookups_total",
        "inferx_degradations_total",
        "inferx_circuit_breaker_state",
    ):
        assert needed in used, needed


def test_dashboard_and_datasource_provisioning_agree() -> None:
    sources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/datasources.yml").read_text())
    uids = {s["uid"] for s in sources["datasources"]}
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "inferx.json").read_text())
    for panel in dashboard["panels"]:
        if "datasource" in panel:
            assert panel["datasource"]["uid"] in uids
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/dashboards.yml").read_text())
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.endswith(":" + providers["providers"][0]["options"]["path"] + ":ro") for m in mounts)


def test_compose_file_is_consistent_with_the_repository() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"etcd", "router", "scheduler", "memory-pool", "cache", "prometheus", "grafana", "jaeger"} <= set(
        services
    )
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source}"
        command = service.get("command", [])
        if command and command[0].startswith("inferx-"):
            assert command[0] in scripts, command[0]
            assert service["environment"]["INFERX_METRICS_PORT"] == "9100"
            assert service["environment"]["INFERX_TRACE_EXPORTER"] == "otlp"
        if "build" in service:
            assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).exists()
    # Prometheus scrapes every InferX container, by its compose name.
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t.split(":")[0]
        for job in config["scrape_configs"]
        for sc in job["static_configs"]
        for t in sc["targets"]
    }
    inferx = {n for n, s in services.items() if str(s.get("command", [""])[0]).startswith("inferx-")}
    assert targets == inferx


def test_prometheus_accepts_the_config_and_the_rules() -> None:
    checked = promtool("check", "config", "deploy/prometheus/prometheus.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    checked = promtool("check", "rules", "deploy/prometheus/alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule}
    assert alerts == {
        "InferxKvUsageHigh",
        "InferxSloAttainmentLow",
        "InferxDegradationRateHigh",
        "InferxServiceDown",
    }
    known = known_metric_names()
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert metric_names(rule["expr"]) - known == set(), rule


def test_alerts_fire_on_the_series_they_are_for() -> None:
    tested = promtool("test", "rules", "deploy/prometheus/alerts_test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout
