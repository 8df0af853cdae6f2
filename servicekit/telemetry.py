"""OpenTelemetry tracing: the provider each process sets up, and W3C context on every hop.

With ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, spans go to that collector (Jaeger
on 4317 in compose) through a batch processor and the standard ``OTEL_*``
variables; without it nothing is exported and nothing waits on a collector,
but spans still exist, so every call still has a trace id to return.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from servicekit.tracefile import TRACE_FILE_ENV, JsonLinesSpanExporter

log = logging.getLogger(__name__)

TRACE_ID_KEY = "x-trace-id"


def configure_tracing(service: str, version: str = "0.1.0") -> TracerProvider:
    """Install this process's tracer provider (once); return it so shutdown can flush it."""
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    resource = Resource.create({
        "service.name": f"agent-gateway-{service}",
        "service.version": version,
        "service.instance.id": f"{socket.gethostname()}-{os.getpid()}",
    })
    provider = TracerProvider(resource=resource)
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(timeout=_export_timeout_s())))
        log.info("tracing: exporting spans over OTLP to %s", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    else:
        log.info("tracing: no OTEL_EXPORTER_OTLP_ENDPOINT, spans are not exported")
    if trace_file := os.environ.get(TRACE_FILE_ENV):
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(trace_file)))
        log.info("tracing: appending spans to %s (read them with: agentgw trace TRACE_ID)", trace_file)
    trace.set_tracer_provider(provider)
    return provider


#: Seconds one export may take, retries included, unless OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT says.
#: The OpenTelemetry default (10 s) is what a process's shutdown flush waited
#: on when the collector was down; telemetry must not hold a drain that long.
DEFAULT_EXPORT_TIMEOUT_S = 2.0


def _export_timeout_s() -> float | None:
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT"):
        return None  # the exporter reads the standard variable itself
    return DEFAULT_EXPORT_TIMEOUT_S


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None):
    """The caller's trace context from gRPC invocation metadata (W3C traceparent)."""
    carrier = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
    return propagate.extract(carrier)


def outgoing_metadata() -> list[tuple[str, str]]:
    """W3C trace context of the current span, as gRPC metadata for a backend call."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def trace_id_hex(span: trace.Span | None = None) -> str:
    """The trace id as 32 hex digits (what Jaeger's search box takes); empty if none."""
    context = (span or trace.get_current_span()).get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""
