"""OpenTelemetry traces across router -> scatter/combine -> cache tier, context in gRPC metadata.

Each process gets a TracerProvider named after its role. Spans are exported to an OTLP endpoint
when one is given and the OTLP exporter is installed; otherwise they are kept in memory (the last
few hundred, for tests and debugging).
"""

from __future__ import annotations

import logging

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

log = logging.getLogger("hybridcache.tracing")
# the last spans a process finished, for tests and debugging: bounded (unbounded, a serving
# process kept every request's spans for as long as it ran)
KEPT_SPANS = 512
_memory = InMemorySpanExporter(max_spans=KEPT_SPANS)
_configured = False


def setup_tracing(role: str, otlp_endpoint: str | None = None) -> None:
    global _configured
    if _configured:
        return
    provider = TracerProvider(resource=Resource.create({"service.name": f"hybridcache-{role}"}))
    provider.add_span_processor(SimpleSpanProcessor(_memory))
    if otlp_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)))
        except ImportError:
            log.warning("--otlp-endpoint given but opentelemetry-exporter-otlp is not installed; spans stay local")
    trace.set_tracer_provider(provider)
    _configured = True


def tracer():
    return trace.get_tracer("hybridcache")


def outgoing_metadata() -> list[tuple[str, str]]:
    """The current span's context as gRPC metadata (W3C traceparent)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def incoming_context(grpc_context):
    """The caller's span context from gRPC metadata (None-safe)."""
    md = dict(grpc_context.invocation_metadata() or ()) if grpc_context is not None else {}
    return propagate.extract(md)


def current_trace_id() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def finished_spans():
    return _memory.get_finished_spans()
