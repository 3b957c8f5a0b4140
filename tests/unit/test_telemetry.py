"""Tracing: exporter choice, context propagation over grpc.aio through our
interceptors (unary and streaming, with the ErrorMappingInterceptor in place), an
agent's traceparent continuing into our spans, the hop breakdown, the JSON-lines file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inferx import telemetry
from inferx.discovery import ChannelPool
from inferx.errors import NotFound, Unavailable
from inferx.server import ErrorMappingInterceptor
from inferx.settings import ServiceSettings, load_settings
from inferx.tls import Transport
from inferx.v1 import cache_pb2, cache_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.polling import poll_until

EXPORTER = InMemorySpanExporter()
_attached_to: list[TracerProvider] = []


@pytest.fixture
def spans() -> InMemorySpanExporter:
    """Spans of the process-wide provider (OTel allows one per process, and another
    test module may have installed it first), emptied per test."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    if provider not in _attached_to:
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        _attached_to.append(provider)
    EXPORTER.clear()
    return EXPORTER


# ----- options -----------------------------------------------------------------------


def test_nothing_configured_means_no_exporter_and_no_provider(monkeypatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert telemetry.choose_exporter("", "") == "none"
    assert telemetry.setup_tracing("router", "r-1", "", install=False) is None
    assert telemetry.setup_tracing("router", "r-1", "none", install=False) is None


def test_an_otlp_endpoint_alone_selects_otlp() -> None:
    assert telemetry.choose_exporter("", "http://jaeger:4317", env={}) == "otlp"
    assert telemetry.choose_exporter("", "", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}) == "otlp"
    assert telemetry.choose_exporter("console", "http://jaeger:4317", env={}) == "console"


def test_without_a_recording_provider_no_interceptor_is_installed(monkeypatch) -> None:
    monkeypatch.setattr(telemetry.trace, "get_tracer_provider", lambda: trace.ProxyTracerProvider())
    monkeypatch.setattr(telemetry.trace, "_TRACER_PROVIDER", None)  # what the API holds before one is set
    assert not telemetry.enabled()
    assert telemetry.server_interceptors() == [] and telemetry.client_interceptors() == []
    monkeypatch.setattr(telemetry.trace, "get_tracer_provider", lambda: TracerProvider())
    monkeypatch.setattr(telemetry.trace, "_TRACER_PROVIDER", TracerProvider())
    assert len(telemetry.server_interceptors()) == 1 and len(telemetry.client_interceptors()) == 4


def test_an_otlp_endpoint_gets_our_spans_with_the_service_name() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def __init__(self) -> None:
            self.requests: list = []

        def Export(self, request, context):
            self.requests.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    collector = Collector()
    server = grpc.server(ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        provider = telemetry.setup_tracing(
            "router", "r-7", "", otlp_endpoint=f"http://127.0.0.1:{port}", install=False
        )
        assert provider is not None
        with provider.get_tracer("t").start_as_current_span("hello"):
            pass
        assert provider.force_flush(10_000)
        provider.shutdown()
    finally:
        server.stop(None)
    exported = [
        (rs.resource, span.name)
        for request in collector.requests
        for rs in request.resource_spans
        for scope in rs.scope_spans
        for span in scope.spans
    ]
    assert [name for _, name in exported] == ["hello"]
    resource = {a.key: a.value.string_value for a in exported[0][0].attributes}
    assert resource["service.name"] == "inferx-router" and resource["service.instance.id"] == "r-7"


def test_file_exporter_needs_a_path() -> None:
    with pytest.raises(telemetry.TelemetryError, match="--trace-file"):
        telemetry.setup_tracing("router", "r-1", "file", install=False)


def test_settings_accept_the_four_exporters_and_reject_others(capsys) -> None:
    for name in ("none", "console", "otlp", "file"):
        assert load_settings(ServiceSettings, "x", ["--trace-exporter", name.upper()]).trace_exporter == name
    with pytest.raises(SystemExit):
        load_settings(ServiceSettings, "x", ["--trace-exporter", "jaeger"])
    assert "--trace-exporter" in capsys.readouterr().err


# ----- propagation over gRPC ---------------------------------------------------------

AGENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
AGENT_SPAN = "00f067aa0ba902b7"


class Downstream(cache_pb2_grpc.CacheServicer):
    async def Get(self, request, context):
        if request.key == "missing":
            raise NotFound("no such key")
        if request.key == "broken":
            raise Unavailable("store is down")
        return cache_pb2.CacheGetResponse(hit=True, value=b"v")


class Upstream(scheduler_pb2_grpc.SchedulerServicer):
    """A streaming handler that calls another service, like the scheduler does."""

    def __init__(self, channels: ChannelPool, downstream: str) -> None:
        self.channels, self.downstream = channels, downstream

    async def SubmitHop(self, request, context):
        stub = cache_pb2_grpc.CacheStub(self.channels.get(self.downstream))
        yield scheduler_pb2.HopEvent(kind=scheduler_pb2.HopEvent.KIND_DISPATCHED)
        reply = await stub.Get(cache_pb2.CacheGetRequest(key=request.prompt), timeout=5)
        yield scheduler_pb2.HopEvent(kind=scheduler_pb2.HopEvent.KIND_FINISHED, text=str(reply.hit))


async def _server(add) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=[*telemetry.server_interceptors(), ErrorMappingInterceptor()])
    add(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_one_trace_crosses_two_servers_and_continues_the_agents_trace(spans) -> None:
    channels = ChannelPool(Transport.plaintext())
    down, down_addr = await _server(lambda s: cache_pb2_grpc.add_CacheServicer_to_server(Downstream(), s))
    up, up_addr = await _server(
        lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(Upstream(channels, down_addr), s)
    )
    try:
        # The agent: a plain channel, its trace context only in the metadata.
        async with grpc.aio.insecure_channel(up_addr) as channel:
            call = scheduler_pb2_grpc.SchedulerStub(channel).SubmitHop(
                scheduler_pb2.HopRequest(prompt="k"),
                metadata=(("traceparent", f"00-{AGENT_TRACE}-{AGENT_SPAN}-01"),),
                timeout=5,
            )
            events = [event async for event in call]
        assert events[-1].text == "True"
    finally:
        await channels.close()
        await up.stop(None)
        await down.stop(None)
    finished = {s.name: s for s in spans.get_finished_spans()}
    up_server = finished["/inferx.v1.Scheduler/SubmitHop"]
    down_client = next(
        s for s in spans.get_finished_spans() if s.name == "/inferx.v1.Cache/Get" and s.kind.name == "CLIENT"
    )
    down_server = next(
        s for s in spans.get_finished_spans() if s.name == "/inferx.v1.Cache/Get" and s.kind.name == "SERVER"
    )
    assert {format(s.context.trace_id, "032x") for s in (up_server, down_client, down_server)} == {
        AGENT_TRACE
    }
    assert format(up_server.parent.span_id, "016x") == AGENT_SPAN
    assert down_client.parent.span_id == up_server.context.span_id
    assert down_server.parent.span_id == down_client.context.span_id


@pytest.mark.parametrize(
    ("key", "code", "server_status"),
    # OTel's semantic conventions: a caller's mistake is not a server error.
    [("missing", grpc.StatusCode.NOT_FOUND, "UNSET"), ("broken", grpc.StatusCode.UNAVAILABLE, "ERROR")],
)
async def test_domain_errors_are_still_mapped_and_recorded_on_the_spans(
    spans, key, code, server_status
) -> None:
    server, address = await _server(lambda s: cache_pb2_grpc.add_CacheServicer_to_server(Downstream(), s))
    channels = ChannelPool(Transport.plaintext())
    try:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await cache_pb2_grpc.CacheStub(channels.get(address)).Get(
                cache_pb2.CacheGetRequest(key=key), timeout=5
            )
    finally:
        await channels.close()
        await server.stop(None)
    assert raised.value.code() == code
    # The server's span may end a moment after the caller has its error (CI: not yet there).
    finished_kinds = lambda: {s.kind.name for s in spans.get_finished_spans()} >= {"SERVER", "CLIENT"}  # noqa: E731
    await poll_until(finished_kinds, timeout_s=5, what="both spans to end")
    by_kind = {s.kind.name: s for s in spans.get_finished_spans()}
    assert by_kind["SERVER"].attributes["rpc.grpc.status_code"] == code.value[0]
    assert by_kind["SERVER"].status.status_code.name == server_status
    assert by_kind["CLIENT"].status.status_code.name == "ERROR"


async def test_health_checks_get_no_spans(spans) -> None:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server, address = await _server(
        lambda s: health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), s)
    )
    try:
        async with grpc.aio.insecure_channel(address, interceptors=telemetry.client_interceptors()) as ch:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        await server.stop(None)
    assert spans.get_finished_spans() == ()


# ----- the hop breakdown -------------------------------------------------------------


class FakeClock:
    def __init__(self, start_ns: int) -> None:
        self.now = start_ns

    def __call__(self) -> int:
        return self.now

    def advance_ms(self, ms: float) -> None:
        self.now += int(ms * 1_000_000)


def test_hop_spans_place_queue_engine_prefill_and_decode_on_the_routers_clock(spans) -> None:
    clock = FakeClock(1_000_000_000_000)
    with telemetry.span("node answer") as node:
        hop = telemetry.HopSpans(clock)
        clock.advance_ms(30)
        hop.dispatched()
        clock.advance_ms(120)
        hop.finished(
            SimpleNamespace(
                queue_ms=25.0,
                engine_ms=100.0,
                ttft_ms=40.0,
                pool="tiny",
                worker_id="worker-1",
                finish_reason="length",
                usage=common_pb2.TokenUsage(prompt_tokens=50, completion_tokens=8, cached_prompt_tokens=32),
            ),
            tier="realtime",
        )
    by_name = {s.name: s for s in spans.get_finished_spans()}
    ms = 1_000_000
    t0 = 1_000_000_000_000
    queue, dispatch, engine = by_name["queue wait"], by_name["dispatch"], by_name["engine"]
    prefill, decode = by_name["prefill"], by_name["decode"]
    assert (queue.start_time, queue.end_time) == (t0, t0 + 25 * ms)
    assert (dispatch.start_time, dispatch.end_time) == (t0 + 25 * ms, t0 + 150 * ms)
    assert (engine.start_time, engine.end_time) == (t0 + 50 * ms, t0 + 150 * ms)
    assert (prefill.start_time, prefill.end_time) == (t0 + 50 * ms, t0 + 90 * ms)
    assert (decode.start_time, decode.end_time) == (t0 + 90 * ms, t0 + 150 * ms)
    node_id = node.get_span_context().span_id
    assert queue.parent.span_id == node_id and dispatch.parent.span_id == node_id
    assert engine.parent.span_id == dispatch.context.span_id
    assert prefill.parent.span_id == engine.context.span_id == decode.parent.span_id
    assert prefill.attributes["inferx.cached_prefix_tokens"] == 32
    assert decode.attributes["inferx.decode_tokens"] == 8
    assert engine.attributes["gen_ai.usage.input_tokens"] == 50
    assert queue.attributes["inferx.tier"] == "realtime"


def test_engine_time_longer_than_the_dispatch_is_clamped_to_it(spans) -> None:
    clock = FakeClock(5_000_000_000)
    hop = telemetry.HopSpans(clock)
    clock.advance_ms(10)
    hop.finished(
        SimpleNamespace(
            queue_ms=5.0,
            engine_ms=500.0,  # another machine's clock: must not start before the dispatch
            ttft_ms=900.0,
            pool="p",
            worker_id="w",
            finish_reason="",
            usage=common_pb2.TokenUsage(),
        )
    )
    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert by_name["engine"].start_time == by_name["dispatch"].start_time
    assert by_name["decode"].start_time <= by_name["decode"].end_time


# ----- files ---------------------------------------------------------------------------


def test_json_lines_exporter_round_trips_spans_and_their_parents(tmp_path, spans) -> None:
    path = tmp_path / "spans.jsonl"
    provider = telemetry.setup_tracing("cache", "c-1", "file", trace_file=str(path), install=False)
    assert provider is not None
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("outer", attributes={"k": ("a", "b")}):
        with tracer.start_as_current_span("inner"):
            pass
    path.open("a").write('{"torn": ')  # a writer killed mid-line
    rows = telemetry.read_spans(str(path))
    assert [r["name"] for r in rows] == ["inner", "outer"]
    inner, outer = rows
    assert inner["parent_id"] == outer["span_id"] and outer["parent_id"] == ""
    assert inner["trace_id"] == outer["trace_id"] and len(inner["trace_id"]) == 32
    assert outer["service"] == "inferx-cache"
    assert outer["attributes"] == {"k": ["a", "b"]}
    json.dumps(rows)  # plain JSON all the way down
    provider.shutdown()


def test_recording_is_seen_as_soon_as_a_provider_is_installed_and_not_before() -> None:
    """`enabled()` answers without the API's lookup while no provider is installed, but
    never keeps that answer: a provider installed later (once per process) is seen, and
    one the environment names is loaded as the API would."""
    script = (
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from inferx import telemetry\n"
        "assert not telemetry.enabled() and not telemetry.enabled()\n"
        "with telemetry.span('off') as s: assert not s.is_recording()\n"
        "trace.set_tracer_provider(TracerProvider())\n"
        "assert telemetry.enabled()\n"
        "with telemetry.span('on') as s: assert s.is_recording()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OTEL_PYTHON_TRACER_PROVIDER"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    env["OTEL_PYTHON_TRACER_PROVIDER"] = "sdk_tracer_provider"
    from_env = "from inferx import telemetry\nassert telemetry.enabled()\n"
    done = subprocess.run(
        [sys.executable, "-c", from_env], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
