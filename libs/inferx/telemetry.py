"""OpenTelemetry tracing for every InferX service.

* `setup_tracing` -- once per process, from the service's settings. Nothing is set up
  (and nothing is exported, so nothing can fail noisily) unless an exporter is asked
  for or an OTLP endpoint is configured.
* `server_interceptors` / `client_interceptors` -- the OpenTelemetry gRPC instrumentation
  for grpc.aio, limited to our own `inferx.v1.*` services (no spans for health checks or
  reflection), and only where tracing is on. The client side writes the W3C
  `traceparent` into the call metadata and the server side reads it, so a trace
  crosses all five services -- and a caller (an agent) that sends its own
  `traceparent` with RunChain sees our spans in its trace.
* `JsonLinesSpanExporter` -- one JSON object per span, appended to a file several
  processes may share (tests read the whole cross-process tree back from it).
* `HopSpans` -- the queue-wait / dispatch / engine (prefill, decode) breakdown of one
  model hop, built from the timings the scheduler and worker report with the hop.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor, filters
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span, Status, StatusCode

from inferx import __version__

TRACER_NAME = "inferx"
EXPORTERS = ("none", "console", "otlp", "file")
# Only our own RPCs get spans: health probes and reflection would drown the traces. The
# long-lived hop streams (Scheduler.Hops, ModelWorker.GenerateStream) get none either:
# each call on them gets its own client and server span instead (`start_call_span`).
STREAM_METHODS = ("Hops", "GenerateStream")
_OUR_RPCS = filters.all_of(
    filters.service_prefix("inferx.v1."),
    filters.negate(filters.any_of(*(filters.method_name(m) for m in STREAM_METHODS))),
)


class TelemetryError(Exception):
    """A tracing option that cannot work (e.g. `file` without a path)."""


def choose_exporter(exporter: str, otlp_endpoint: str, env: Mapping[str, str] = os.environ) -> str:
    """The exporter to use: the one asked for, else OTLP if an endpoint is configured
    (ours or the standard OTEL_EXPORTER_OTLP_* variables), else none."""
    if exporter:
        return exporter
    if (
        otlp_endpoint
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return "otlp"
    return "none"


def setup_tracing(
    service: str,
    instance_id: str,
    exporter: str = "",
    *,
    otlp_endpoint: str = "",
    trace_file: str = "",
    span_exporter: SpanExporter | None = None,
    install: bool = True,
) -> TracerProvider | None:
    """Create (and with `install`, make global) the tracer provider of this process.

    Returns None when tracing is off: no provider, hence no interceptors and nothing
    exported; the spans the code opens are the API's free no-op spans.
    """
    kind = choose_exporter(exporter, otlp_endpoint)
    if kind not in EXPORTERS:
        raise TelemetryError(f"unknown trace exporter '{kind}' (choose from {', '.join(EXPORTERS)})")
    if kind == "none" and span_exporter is None:
        return None
    resource = Resource.create(
        {
            "service.name": f"inferx-{service}",
            "service.namespace": "inferx",
            "service.instance.id": instance_id,
            "service.version": __version__,
        }
    )
    provider = TracerProvider(resource=resource)
    if span_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    elif kind == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # Batching keeps the collector's latency off the request path.
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint or None)))
    elif kind == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(formatter=_one_line)))
    elif kind == "file":
        if not trace_file:
            raise TelemetryError("--trace-exporter file needs --trace-file PATH")
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(trace_file)))
    if install:
        trace.set_tracer_provider(provider)
    return provider


def _one_line(span: ReadableSpan) -> str:
    return json.dumps(span_to_dict(span), sort_keys=True) + "\n"


# Where the API keeps the installed provider (None until one is), and whether the
# environment names one for the API to load on first use: read once, not per span.
_API_HOLDS_PROVIDER = hasattr(trace, "_TRACER_PROVIDER")
_PROVIDER_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ


def enabled() -> bool:
    """Whether this process records spans (an SDK tracer provider is installed).
    Asked several times per hop: with no provider installed it answers without the
    API's environment lookup (issue #14's profile: ~2% of the router's CPU)."""
    if _API_HOLDS_PROVIDER and trace._TRACER_PROVIDER is None and not _PROVIDER_FROM_ENV:
        return False
    return isinstance(trace.get_tracer_provider(), TracerProvider)


# With tracing off the interceptors would only cost time (~0.1 ms per call on each
# side) to pass on a context nobody records, so they are left out.


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    return [aio_server_interceptor(filter_=_OUR_RPCS)] if enabled() else []


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    return list(aio_client_interceptors(filter_=_OUR_RPCS)) if enabled() else []


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME, __version__)


def trace_id_of(span: Span | None = None) -> str:
    """32 hex digits of the span's (default: the current span's) trace, '' without one."""
    ctx = (span or trace.get_current_span()).get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


class _NoSpan:
    """What `span` gives with tracing off: the API's no-op span, without the API's cost
    per span (a tracer lookup, a context attached and detached, the attributes cleaned:
    ~20 us a span, several spans per hop; issue #14)."""

    __slots__ = ()

    def __enter__(self) -> Span:
        return trace.INVALID_SPAN

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()


def span(
    name: str, attributes: Mapping[str, Any] | None = None, *, parent: otel_context.Context | None = None
) -> AbstractContextManager[Span]:
    """A child span of the current one (or of `parent`), current while the block runs."""
    if not enabled():
        return _NO_SPAN
    return _recorded_span(name, attributes, parent)


@contextmanager
def _recorded_span(
    name: str, attributes: Mapping[str, Any] | None, parent: otel_context.Context | None
) -> Iterator[Span]:
    with tracer().start_as_current_span(
        name, context=parent, attributes=clean_attributes(attributes or {})
    ) as current:
        yield current


def start_call_span(method: str, *, server: bool = False, carrier: Mapping[str, str] | None = None) -> Span:
    """The span a call of `method` ("/inferx.v1.Scheduler/SubmitHop") has as a plain call
    (the gRPC instrumentation's: same name, kind and attributes), for a call multiplexed
    on a hop stream: the client's, a child of the current span, or (`server`) the
    callee's, a child of the caller's span that `carrier` holds. Not made current here
    (`current`); `end_call_span` ends it with the call's status."""
    service, _, name = method.lstrip("/").partition("/")
    attributes: dict[str, str | int] = {
        "rpc.system": "grpc",
        "rpc.service": service,
        "rpc.method": name,
        "rpc.grpc.status_code": 0,
    }
    parent = None
    if carrier:
        from opentelemetry import propagate

        parent = propagate.extract(dict(carrier))
    kind = trace.SpanKind.SERVER if server else trace.SpanKind.CLIENT
    return tracer().start_span(method, context=parent, kind=kind, attributes=attributes)


def end_call_span(current: Span, code: grpc.StatusCode, message: str = "") -> None:
    current.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        current.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))
    current.end()


def inject_context(carrier: Any, current: Span) -> None:
    """`current`'s trace context (W3C traceparent) into `carrier` (a dict or a protobuf
    map field), as the gRPC instrumentation puts it into a call's metadata."""
    from opentelemetry import propagate

    propagate.inject(carrier, context=trace.set_span_in_context(current))


@contextmanager
def current(span_: Span) -> Iterator[Span]:
    """`span_` current while the block runs (in one task: attach and detach meet)."""
    token = otel_context.attach(trace.set_span_in_context(span_))
    try:
        yield span_
    finally:
        otel_context.detach(token)


def context_from_headers(headers: Mapping[str, str]) -> otel_context.Context | None:
    """The trace context an HTTP caller sent (W3C `traceparent`), None when there is
    none or this process records no spans."""
    if not enabled() or not any(key.lower() == "traceparent" for key in headers):
        return None
    from opentelemetry import propagate

    return propagate.extract(dict(headers))


def clean_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """OTel takes str/bool/int/float (and sequences of them); drop empty values."""
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None or value == "":
            continue
        if isinstance(value, str | bool | int | float):
            out[key] = value
        elif isinstance(value, Sequence):
            out[key] = [str(v) for v in value]
        else:
            out[key] = str(value)
    return out


# ----- chain nodes ------------------------------------------------------------------------


def node_attributes(result: Any) -> dict[str, Any]:
    """Span attributes of a finished chain node (an inferx.v1.NodeFinished)."""
    attributes: dict[str, Any] = {
        "inferx.node.status": result.status,
        "inferx.node.latency_ms": round(result.latency_ms, 3),
        "inferx.node.error": result.error,
        "inferx.node.retries": getattr(result, "retries", 0),
        "inferx.node.degradation": getattr(result, "degradation", ""),
        "inferx.node.degradation_reason": getattr(result, "degradation_reason", ""),
    }
    if result.model:
        attributes |= {
            "gen_ai.request.model": result.model,
            "gen_ai.usage.input_tokens": result.usage.prompt_tokens,
            "gen_ai.usage.output_tokens": result.usage.completion_tokens,
            "inferx.usage.cached_prompt_tokens": result.usage.cached_prompt_tokens,
            "inferx.node.queue_ms": round(result.queue_ms, 3),
            "inferx.worker": result.worker_id,
        }
    if result.tool:
        attributes |= {"inferx.tool": result.tool, "inferx.tool.cache_hit": result.cache_hit}
    return clean_attributes(attributes)


def finish_node_span(current: Span, result: Any) -> None:
    if not current.is_recording():  # tracing off: nothing to build the attributes for
        return
    current.set_attributes(node_attributes(result))
    if result.status not in ("ok", "skipped"):
        current.set_status(Status(StatusCode.ERROR, result.error or result.status))


# ----- model hops -------------------------------------------------------------------------


def _ms_to_ns(ms: float) -> int:
    return int(max(ms, 0.0) * 1_000_000)


class HopSpans:
    """Spans of one model hop, built when it finishes from the scheduler's report.

    The scheduler and worker time the queue wait (queue_ms), the engine (engine_ms)
    and the first token (ttft_ms); placing those on the router's clock gives a
    breakdown without clock skew between machines: queue wait from submission,
    dispatch from the end of the queue wait until the result arrived, and inside it
    the engine's prefill (up to the first token) and decode.
    """

    def __init__(self, clock_ns: Callable[[], int] = time.time_ns) -> None:
        self._clock_ns = clock_ns
        self._on = enabled()  # off: nothing is timed or built (issue #14)
        self._parent = otel_context.get_current() if self._on else None
        self.submitted_ns = clock_ns() if self._on else 0
        self.dispatched_ns = 0

    def dispatched(self) -> None:
        if self._on:
            self.dispatched_ns = self._clock_ns()

    def finished(self, event: Any, *, tier: str = "") -> None:
        """`event`: the scheduler's FINISHED HopEvent (queue_ms, engine_ms, ttft_ms, usage)."""
        if not self._on:
            return
        done_ns = self._clock_ns()
        tracer_ = tracer()
        queue_end = min(self.submitted_ns + _ms_to_ns(event.queue_ms), done_ns)
        common = {"inferx.pool": event.pool, "inferx.worker": event.worker_id}
        queue = tracer_.start_span(
            "queue wait",
            context=self._parent,
            start_time=self.submitted_ns,
            attributes=clean_attributes({**common, "inferx.tier": tier, "inferx.queue_ms": event.queue_ms}),
        )
        queue.end(end_time=queue_end)
        dispatch = tracer_.start_span(
            "dispatch", context=self._parent, start_time=queue_end, attributes=clean_attributes(common)
        )
        engine_start = max(done_ns - _ms_to_ns(event.engine_ms), queue_end)
        first_token = min(engine_start + _ms_to_ns(event.ttft_ms), done_ns)
        usage = event.usage
        under_dispatch = trace.set_span_in_context(dispatch, self._parent)
        engine = tracer_.start_span(
            "engine",
            context=under_dispatch,
            start_time=engine_start,
            attributes=clean_attributes(
                {
                    **common,
                    "inferx.engine_ms": event.engine_ms,
                    "inferx.ttft_ms": event.ttft_ms,
                    "gen_ai.usage.input_tokens": usage.prompt_tokens,
                    "gen_ai.usage.output_tokens": usage.completion_tokens,
                    "inferx.usage.cached_prompt_tokens": usage.cached_prompt_tokens,
                    "gen_ai.response.finish_reasons": [event.finish_reason] if event.finish_reason else None,
                }
            ),
        )
        under_engine = trace.set_span_in_context(engine, self._parent)
        prefill = tracer_.start_span(
            "prefill",
            context=under_engine,
            start_time=engine_start,
            attributes={
                "inferx.prefill_tokens": usage.prompt_tokens,
                "inferx.cached_prefix_tokens": usage.cached_prompt_tokens,
            },
        )
        prefill.end(end_time=first_token)
        decode = tracer_.start_span(
            "decode",
            context=under_engine,
            start_time=first_token,
            attributes={"inferx.decode_tokens": usage.completion_tokens},
        )
        decode.end(end_time=done_ns)
        engine.end(end_time=done_ns)
        dispatch.end(end_time=done_ns)


# ----- JSON lines ------------------------------------------------------------------------


def span_to_dict(span_: ReadableSpan) -> dict[str, Any]:
    ctx = span_.get_span_context()
    parent = span_.parent
    resource = span_.resource.attributes if span_.resource is not None else {}
    return {
        "name": span_.name,
        "service": resource.get("service.name", ""),
        "trace_id": format(ctx.trace_id, "032x") if ctx is not None else "",
        "span_id": format(ctx.span_id, "016x") if ctx is not None else "",
        "parent_id": format(parent.span_id, "016x") if parent is not None else "",
        "kind": span_.kind.name,
        "start_ns": span_.start_time,
        "end_ns": span_.end_time,
        "status": span_.status.status_code.name,
        "attributes": {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in (span_.attributes or {}).items()
        },
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per span; an exclusive lock per batch keeps the lines of
    several processes writing to the same file whole."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        text = "".join(json.dumps(span_to_dict(s), sort_keys=True) + "\n" for s in spans)
        try:
            with open(self.path, "a", encoding="utf-8") as out:
                fcntl.flock(out, fcntl.LOCK_EX)
                out.write(text)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def read_spans(path: str) -> list[dict[str, Any]]:
    """Spans a JsonLinesSpanExporter wrote (a torn last line is ignored)."""
    spans = []
    try:
        with open(path, encoding="utf-8") as source:
            for line in source:
                try:
                    spans.append(json.loads(line))
                except ValueError:
                    continue
    except FileNotFoundError:
        return []
    return spans
