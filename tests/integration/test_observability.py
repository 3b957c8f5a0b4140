"""Observability of the running system: every process writes its spans to one
JSON-lines file, so a test can check that one run is one tree across all five
services (continuing the calling agent's trace); metric values after a known run;
`promtool check metrics` on every /metrics page; `inferx trace` and `inferx stats`."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from inferx import etcd, telemetry
from inferx.client import InferxClient
from inferx.devstack import LocalStack, read_models_file
from inferx.v1 import router_pb2, router_pb2_grpc
from tests.conftest import EXAMPLES, ROOT, make_stack, started
from tests.polling import poll_until_sync

pytestmark = pytest.mark.integration

CHAIN = "customer_service_agent"
MODEL_NODES = ("intent_recognition", "response_generation")
INFERX = str(Path(sys.executable).with_name("inferx"))


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: run `make setup` (deploy/scripts/ensure-command.sh installs it)")
    return path


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, Path]]:
    """etcd + every service + two sim workers, all exporting spans to one file."""
    tmp = tmp_path_factory.mktemp("traced")
    spans = tmp / "spans.jsonl"
    flags = ["--trace-exporter", "file", "--trace-file", str(spans)]

    def start(stack: LocalStack) -> None:
        stack.start_etcd()
        for kind in ("router", "scheduler", "memory-pool", "cache"):
            stack.start_service(kind, flags)
        stack.start_core()
        stack.load_models(read_models_file(EXAMPLES / "models.yaml"))
        for _ in range(2):
            stack.start_worker("tiny-llama", "sim", ["--sim-speed", "5", *flags])
        stack.put_chains([EXAMPLES / "chains" / f"{CHAIN}.yaml"])

    with started(make_stack(tmp), start, guard=True) as stack:
        yield stack, spans


async def run_as_agent(stack: LocalStack, query: str, traceparent: str = "") -> router_pb2.ChainFinished:
    """RunChain the way an agent with its own trace calls it: a plain channel and a
    W3C traceparent in the metadata."""
    metadata = (("traceparent", traceparent),) if traceparent else ()
    async with grpc.aio.insecure_channel(stack.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.RunChainRequest(chain=CHAIN, inputs={"query": query})
        events = [event async for event in stub.RunChain(request, metadata=metadata, timeout=30)]
    finished = events[-1].chain_finished
    assert finished.status == "ok", finished.error
    return finished


def spans_of(path: Path, trace_id: str, until: str, timeout_s: float = 10.0) -> list[dict]:
    """The trace's spans, once it is complete: the span named `until` (the last to end)
    is written, every span's parent is written (but the root's, which is the caller's),
    and every outgoing RPC's span has the callee's server span under it. Each process
    writes its spans as they end, so other processes' spans can still be on the way
    when `until` is there; a fixed pause would only guess how long."""

    def complete() -> list[dict]:
        spans = [s for s in telemetry.read_spans(str(path)) if s["trace_id"] == trace_id]
        ids = {s["span_id"] for s in spans}
        roots = [s for s in spans if s["parent_id"] not in ids]
        served = {s["parent_id"] for s in spans if s["kind"] == "SERVER"}
        done = (
            any(s["name"] == until for s in spans)
            and len(roots) == 1
            and all(s["span_id"] in served for s in spans if s["kind"] == "CLIENT")
        )
        return spans if done else []

    return poll_until_sync(complete, timeout_s=timeout_s, what=f"the spans of trace {trace_id}")


ENGINE_GAUGES = (
    "inferx_scheduler_engine_prefill_tokens_per_second",
    "inferx_scheduler_engine_kv_read_seconds_per_token",
)


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def total(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


async def metrics_addresses(stack: LocalStack) -> dict[str, list[str]]:
    """What `inferx status` lists: every service's /metrics address, from etcd."""
    async with InferxClient(stack.router_address) as client:
        status = await client.status()
    by_kind: dict[str, list[str]] = {}
    for service in status.services:
        by_kind.setdefault(service.kind, []).append(service.metrics_address)
    return by_kind


# ----- traces --------------------------------------------------------------------------


async def test_one_run_is_one_span_tree_across_all_five_services_under_the_agents_trace(traced) -> None:
    stack, path = traced
    trace_id, agent_span = secrets.token_hex(16), secrets.token_hex(8)
    finished = await run_as_agent(stack, f"Where is order {trace_id[:6]}?", f"00-{trace_id}-{agent_span}-01")
    spans = spans_of(path, trace_id, until="/inferx.v1.Router/RunChain")
    by_id = {s["span_id"]: s for s in spans}

    roots = [s for s in spans if s["parent_id"] not in by_id]
    assert [(r["name"], r["kind"], r["parent_id"]) for r in roots] == [
        ("/inferx.v1.Router/RunChain", "SERVER", agent_span)
    ]
    # The memory-pool is in the tree when a hop was reserved there (beyond the scheduler's
    # leased budget, e.g. the first hops on a worker); a hop reserved from the budget
    # makes no call to it (issue #14).
    assert (
        {"inferx-router", "inferx-scheduler", "inferx-cache", "inferx-worker"}
        <= {s["service"] for s in spans}
        <= {"inferx-router", "inferx-scheduler", "inferx-memory-pool", "inferx-cache", "inferx-worker"}
    )

    def parent(span: dict) -> dict:
        return by_id[span["parent_id"]]

    def ancestors(span: dict) -> list[str]:
        names = []
        while span["parent_id"] in by_id:
            span = parent(span)
            names.append(span["name"])
        return names

    def one(name: str, kind: str = "", service: str = "", under: str = "") -> dict:
        found = [
            s
            for s in spans
            if s["name"] == name
            and (not kind or s["kind"] == kind)
            and (not service or s["service"] == service)
            and (not under or under in ancestors(s))
        ]
        assert len(found) == 1, (name, kind, service, under, [s["name"] for s in found])
        return found[0]

    chain = one(f"chain {CHAIN}")
    assert parent(chain)["name"] == "/inferx.v1.Router/RunChain"
    assert chain["attributes"]["inferx.run_id"] == finished.run_id
    hops = {hop.node_id: hop for hop in finished.hops}
    for node_id in hops:
        node = one(f"node {node_id}")
        assert parent(node) is chain
        assert node["attributes"]["inferx.node.status"] == "ok"
    for node_id in MODEL_NODES:
        under = f"node {node_id}"
        attempt = one("model attempt", under=under)
        client = one("/inferx.v1.Scheduler/SubmitHop", "CLIENT", "inferx-router", under)
        server = one("/inferx.v1.Scheduler/SubmitHop", "SERVER", "inferx-scheduler", under)
        generate = one("/inferx.v1.ModelWorker/Generate", "SERVER", "inferx-worker", under)
        kv = one("kv reserve", "INTERNAL", "inferx-scheduler", under)
        assert parent(client) is attempt and parent(server) is client
        assert parent(parent(generate)) is server and parent(kv) is server
        assert kv["attributes"]["inferx.kv_tokens"] > 0
        if kv["attributes"]["inferx.kv.reserved_from"] == "memory-pool":
            reserve = one("/inferx.v1.MemoryPool/Reserve", "SERVER", "inferx-memory-pool", under)
            assert parent(parent(reserve)) is kv
        else:
            assert kv["attributes"]["inferx.kv.reserved_from"] == "budget"
        queue, dispatch = one("queue wait", under=under), one("dispatch", under=under)
        engine = one("engine", under=under)
        prefill, decode = one("prefill", under=under), one("decode", under=under)
        assert parent(queue) is attempt and parent(dispatch) is attempt
        assert parent(engine) is dispatch and parent(prefill) is engine and parent(decode) is engine
        usage = hops[node_id].usage
        assert engine["attributes"]["gen_ai.usage.input_tokens"] == usage.prompt_tokens
        assert engine["attributes"]["gen_ai.usage.output_tokens"] == usage.completion_tokens
        assert prefill["attributes"]["inferx.cached_prefix_tokens"] == usage.cached_prompt_tokens
        assert queue["start_ns"] <= dispatch["start_ns"] <= engine["start_ns"] <= decode["end_ns"]
        assert generate["attributes"]["rpc.grpc.status_code"] == 0
    attempt = one("tool attempt", under="node knowledge_retrieval")
    lookup = one("/inferx.v1.Cache/Get", "CLIENT", "inferx-router", "node knowledge_retrieval")
    served = one("/inferx.v1.Cache/Get", "SERVER", "inferx-cache", "node knowledge_retrieval")
    assert attempt in [parent(lookup), parent(parent(lookup))] and parent(served) is lookup
    # The hops went on the long-lived hop streams (issue #14), whose calls have the same
    # spans as plain calls; the streams themselves have none.
    assert not [s for s in spans if s["name"].endswith(("/Hops", "/GenerateStream"))]
    addresses = await metrics_addresses(stack)
    for kind, method in (("scheduler", "Scheduler/Hops"), ("worker", "ModelWorker/GenerateStream")):
        samples = [scrape(address) for address in addresses[kind]]
        calls = "inferx_hop_stream_calls_total"
        served_on_streams = sum(total(each, calls, method=f"/inferx.v1.{method}") for each in samples)
        assert served_on_streams >= len(MODEL_NODES), (kind, served_on_streams)


async def test_an_agent_using_opentelemetry_and_our_sdk_continues_its_trace(traced) -> None:
    stack, path = traced
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # OTel allows one provider per process
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    agent_spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(agent_spans))
    with provider.get_tracer("agent").start_as_current_span("agent step") as step:
        async with InferxClient(stack.router_address) as client:
            events = [e async for e in client.run_chain(CHAIN, {"query": "Is there a warranty?"})]
    assert events[-1].chain_finished.status == "ok"
    trace_id = format(step.get_span_context().trace_id, "032x")
    ours = spans_of(path, trace_id, until="/inferx.v1.Router/RunChain")
    server = next(s for s in ours if s["name"] == "/inferx.v1.Router/RunChain")
    client_span = next(s for s in agent_spans.get_finished_spans() if s.kind.name == "CLIENT")
    assert server["parent_id"] == format(client_span.context.span_id, "016x")
    assert client_span.parent is not None and client_span.parent.span_id == step.get_span_context().span_id


async def test_without_a_traceparent_each_run_starts_its_own_trace(traced) -> None:
    stack, path = traced
    first = await run_as_agent(stack, "What is the refund policy?")
    second = await run_as_agent(stack, "What is the refund policy?")
    traces = {}
    for finished in (first, second):
        async with InferxClient(stack.router_address) as client:
            trace = await client._unary(client._stub.GetRun, router_pb2.GetRunRequest(run_id=finished.run_id))
        traces[finished.run_id] = trace.trace_id
    assert len(set(traces.values())) == 2 and all(len(t) == 32 for t in traces.values())
    for trace_id in traces.values():
        spans = spans_of(path, trace_id, until="/inferx.v1.Router/RunChain")
        assert [s["name"] for s in spans if s["parent_id"] == ""] == ["/inferx.v1.Router/RunChain"]


# ----- metrics -------------------------------------------------------------------------


async def test_metric_values_after_a_known_run(traced) -> None:
    stack, _ = traced
    addresses = await metrics_addresses(stack)
    pages = ("router", "scheduler", "memory-pool", "worker")
    before = {kind: [scrape(a) for a in addresses[kind]] for kind in pages}
    finished = await run_as_agent(stack, f"How do I return item {secrets.token_hex(3)}?")
    after = {kind: [scrape(a) for a in addresses[kind]] for kind in pages}

    def delta(service: str, name: str, **labels: str) -> float:
        return sum(total(page, name, **labels) for page in after[service]) - sum(
            total(page, name, **labels) for page in before[service]
        )

    hops = {hop.node_id: hop for hop in finished.hops}
    chain = {"chain": CHAIN}
    version = str(finished.chain_version)
    assert (
        delta("router", "inferx_chain_latency_seconds_count", version=version, tier="realtime", **chain) == 1
    )
    assert delta("router", "inferx_chain_slo_runs_total", result="met", **chain) == 1
    assert delta("router", "inferx_chain_latency_seconds_sum", **chain) == pytest.approx(
        finished.latency_ms / 1000, rel=1e-6
    )
    for node_id, hop in hops.items():
        assert delta("router", "inferx_node_latency_seconds_count", node=node_id, status="ok", **chain) == 1
        assert delta("router", "inferx_node_latency_seconds_sum", node=node_id, **chain) == pytest.approx(
            hop.latency_ms / 1000, rel=1e-6
        )
    prompt = sum(hops[n].usage.prompt_tokens for n in MODEL_NODES)
    cached = sum(hops[n].usage.cached_prompt_tokens for n in MODEL_NODES)
    completion = sum(hops[n].usage.completion_tokens for n in MODEL_NODES)
    assert delta("router", "inferx_model_prompt_tokens_total", **chain) == prompt
    assert delta("router", "inferx_model_cached_prompt_tokens_total", **chain) == cached
    assert delta("router", "inferx_model_completion_tokens_total", **chain) == completion
    assert delta("router", "inferx_hop_queue_wait_seconds_count", pool="tiny-llama", tier="realtime") == 2
    assert delta("router", "inferx_tool_cache_lookups_total", tool="vector_search", result="miss") == 1
    # The same hops, counted by the services that ran them.
    assert delta("scheduler", "inferx_scheduler_dispatches_total", pool="tiny-llama") == 2
    # What the workers reported of their engine reached chain-aware's engine fit: its
    # figures are exported (the prior: these prompts are too short to learn a prefill rate from).
    engine = {n: [total(page, n, pool="tiny-llama") for page in after["scheduler"]] for n in ENGINE_GAUGES}
    assert engine["inferx_scheduler_engine_prefill_tokens_per_second"] == [15_000.0]
    assert engine["inferx_scheduler_engine_kv_read_seconds_per_token"][0] >= 0
    # Each hop's KV room: from the scheduler's leased budget, or the memory-pool's Reserve beyond it.
    local = delta("scheduler", "inferx_scheduler_kv_reservations_total", path="budget", kind="hop")
    granted = delta("memory-pool", "inferx_memory_reservations_total", result="granted")
    assert local + granted == 2
    assert delta("worker", "inferx_worker_prompt_tokens_total") == prompt
    assert delta("worker", "inferx_worker_cached_prompt_tokens_total") == cached
    assert delta("worker", "inferx_worker_completion_tokens_total") == completion


async def test_every_service_lists_a_metrics_page_that_promtool_accepts(traced) -> None:
    stack, _ = traced
    addresses = await metrics_addresses(stack)
    assert set(addresses) == {"router", "scheduler", "memory-pool", "cache", "worker"}
    assert len(addresses["worker"]) == 2
    for kind, listed in addresses.items():
        for address in listed:
            page = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read()
            checked = subprocess.run([promtool(), "check", "metrics"], input=page, capture_output=True)
            assert checked.returncode == 0, f"{kind} {address}: {checked.stdout!r} {checked.stderr!r}"
            assert b"inferx_" in page


# ----- for people ----------------------------------------------------------------------


def cli(stack: LocalStack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80", "INFERX_ROUTER": stack.router_address}
    return subprocess.run([INFERX, *args], capture_output=True, text=True, timeout=60, env=env)


async def test_inferx_trace_and_stats_from_the_routers_recent_runs(traced) -> None:
    stack, _ = traced
    finished = await run_as_agent(stack, "Can I change my shipping address?")
    for _ in range(4):
        await run_as_agent(stack, "Can I change my shipping address?")
    shown = cli(stack, "trace", finished.run_id[:8])
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert f"run {finished.run_id}" in shown.stdout
    rows = [line for line in lines if "█" in line and line.endswith(" ms")]
    assert len(rows) == 3 and sum(row.startswith("* ") for row in rows) == 2  # the critical path
    assert next(r for r in rows if "response_generation" in r).startswith("* ")
    assert "critical path" in lines[-1]
    latest = cli(stack, "trace", "--chain", CHAIN, "--json")
    assert latest.returncode == 0 and '"critical": true' in latest.stdout

    stats = cli(stack, "stats", CHAIN, "--last", "5")
    assert stats.returncode == 0, stats.stderr
    assert "5 recent runs" in stats.stdout
    for node_id in ("intent_recognition", "knowledge_retrieval", "response_generation"):
        assert node_id in stats.stdout
    assert "contributes most to the P99" in stats.stdout
    assert all(len(line) <= 80 for line in stats.stdout.splitlines())

    missing = cli(stack, "trace", "ffffffffffffffff")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr and "recent-runs" in missing.stderr
    unknown = cli(stack, "stats", "no_such_chain")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def test_tracing_writes_no_errors_to_the_logs(traced) -> None:
    stack, _ = traced
    for proc in [*stack.services.values(), *stack.workers]:
        log = proc.log_path.read_text(errors="replace")
        for bad in ("Traceback", "Failed to detach context", "Exception while exporting"):
            assert bad not in log, f"{proc.name}: {bad}\n{proc.log_tail()}"


def test_compose_seed_script_loads_the_examples_into_a_running_system(traced) -> None:
    stack, _ = traced
    seeded = subprocess.run(
        [sys.executable, str(ROOT / "deploy/scripts/seed.py"), "--etcd", stack.etcd_endpoint]
        + ["--router", stack.router_address, "--wait-s", "5", "--insecure"],  # the test stack is plaintext
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert seeded.returncode == 0, seeded.stderr
    assert "model qwen-7b -> pool tiny-llama" in seeded.stdout
    assert f"chain {CHAIN} unchanged" in seeded.stdout

    async def stored() -> dict:
        async with stack.etcd_client() as client:
            found = await client.get(etcd.model_key("qwen-7b").encode())
        return json.loads(found.value)

    assert asyncio.run(stored()) == {"pool": "tiny-llama"}  # the mapping as the router reads it
