"""OpenTelemetry set-up shared by the gateway and the workers.

One trace per request: the gateway's span is the root (or a child of the
client's ``traceparent``); every worker call carries the context in gRPC
metadata (the grpc.aio instrumentation injects and extracts it), or, on the
multiplexed DecodeMany stream, in each request's start message, and the
workers add spans for their phases (prefill compute, KV transfer, decode).

Exporters, chosen at start-up:
- ``OTEL_EXPORTER_OTLP_ENDPOINT`` set: OTLP over gRPC (the standard variable).
- ``TANDEM_TRACE_FILE`` set: finished spans as JSON lines in that file (tests
  read the spans of every process from it).
- neither: no provider is installed; spans are non-recording and cost
  next to nothing.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

_configured = False


class JsonLinesExporter(SpanExporter):
    """Appends each finished span as one JSON object per line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for s in spans:
            ctx = s.get_span_context()
            lines.append(json.dumps({
                "name": s.name,
                "trace_id": format(ctx.trace_id, "032x"),
                "span_id": format(ctx.span_id, "016x"),
                "parent_id": format(s.parent.span_id, "016x") if s.parent else None,
                "service": s.resource.attributes.get("service.name"),
                "start": s.start_time, "end": s.end_time,
                "attributes": {k: v if isinstance(v, (int, float, str, bool)) else str(v)
                               for k, v in (s.attributes or {}).items()},
            }))
        with self._lock, open(self.path, "a") as f:
            f.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def read_trace_file(path) -> list[dict]:
    """The spans a ``TANDEM_TRACE_FILE`` holds so far ([] before the first).
    Other processes append to it while it is read, so a last line without
    its newline is a span still being written: it is left for a later read."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    complete = text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def setup_tracing(service_name: str) -> bool:
    """Install a tracer provider if an exporter is configured. Returns
    whether tracing is on. Call before creating gRPC servers or channels."""
    global _configured
    if _configured:
        return True
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    trace_file = os.environ.get("TANDEM_TRACE_FILE")
    if not endpoint and not trace_file:
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if trace_file:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(trace_file)))
    trace.set_tracer_provider(provider)
    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,
        GrpcAioInstrumentorServer,
        filters,
    )

    # NOTE: not the multiplexed DecodeMany call: it lives as long as the
    # gateway, and each request on it carries its own trace context instead.
    per_request = filters.negate(filters.method_name("DecodeMany"))
    GrpcAioInstrumentorServer(filter_=per_request).instrument()
    GrpcAioInstrumentorClient(filter_=per_request).instrument()
    _configured = True
    return True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def context_from_headers(headers: Mapping[str, str]) -> otel_context.Context:
    """The caller's trace context from HTTP headers (``traceparent``)."""
    return propagate.extract(dict(headers))


def context_from_grpc(metadata) -> otel_context.Context:
    return propagate.extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})


def current_trace_id() -> str | None:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


@contextmanager
def current(span: trace.Span) -> Iterator[None]:
    """Make ``span`` current while a gRPC call is created, so the grpc.aio
    instrumentation sends its context. Hold it only around the call's
    creation: in an async generator, a context held across a ``yield``
    would leak into the consumer."""
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        otel_context.detach(token)


def end_span(span: trace.Span, error: BaseException | None = None) -> None:
    """End ``span`` (once: a second call does nothing), recording ``error``."""
    if not span.is_recording():
        return
    if error is not None and not isinstance(error, (GeneratorExit,)):
        span.record_exception(error)
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(error) or type(error).__name__))
    span.end()
