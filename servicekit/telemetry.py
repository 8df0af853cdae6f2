"""OpenTelemetry tracing: the provider each process sets up, and W3C context on every hop.

With ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, spans go to that collector (Jaeger
on 4317 in compose) through a batch processor and the standard ``OTEL_*``
variables; the same with ``AGW_TRACE_FILE``, to a file. Without either nothing
would read a span, so none is recorded: every call still gets a trace id (the
SDK makes one for a span it does not sample), returned to clients and passed
to backends, marked unsampled.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from servicekit.tracefile import JsonLinesSpanExporter

log = logging.getLogger(__name__)

TRACE_ID_KEY = "x-trace-id"


def configure_tracing(service: str, version: str = "0.1.0", *, trace_file: Path | None = None) -> TracerProvider:
    """Install this process's tracer provider (once); return it so shutdown can flush it.

    The ``OTEL_*`` variables are OpenTelemetry's own, read by its SDK; ours
    (``AGW_TRACE_FILE``) comes through the service's settings.
    """
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    resource = Resource.create({
        "service.name": f"agent-gateway-{service}",
        "service.version": version,
        "service.instance.id": f"{socket.gethostname()}-{os.getpid()}",
    })
    exporting = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    # A span no processor takes is built, filled and dropped: 20-35 µs of a gateway call's CPU
    # (bench/edge_costs.py --spans recorded), a tenth of what the edge adds. With nothing to take them, sample none
    # (the SDK's sampler otherwise, which honours OTEL_TRACES_SAMPLER).
    provider = TracerProvider(resource=resource, sampler=None if exporting or trace_file else ALWAYS_OFF)
    if exporting:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(timeout=_export_timeout_s())))
        log.info("tracing: exporting spans over OTLP to %s", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    elif not trace_file:
        log.info("tracing: no OTEL_EXPORTER_OTLP_ENDPOINT nor AGW_TRACE_FILE, spans are not recorded "
                 "(trace ids still are returned)")
    if trace_file:
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(trace_file)))
        log.info("tracing: appending spans to %s (read them with: agentgw trace TRACE_ID)", trace_file)
    trace.set_tracer_provider(provider)
    return provider


def spans_recorded(provider: trace.TracerProvider | None = None) -> bool:
    """Whether ``provider`` (this process's, by default) may record spans: False only for one that samples
    none, as :func:`configure_tracing` installs with nothing to read them. Instrumentation that would only
    build unsampled spans (a client library's, per query) can then stay off."""
    provider = provider or trace.get_tracer_provider()
    return not (isinstance(provider, TracerProvider) and provider.sampler is ALWAYS_OFF)


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


#: W3C traceparent/tracestate only: what an untrusted caller may hand us (never baggage).
_TRACECONTEXT = TraceContextTextMapPropagator()
CLIENT_TRACE_POLICIES = ("link", "continue")


def client_context(metadata: Iterable[tuple[str, str | bytes]] | None, policy: str) -> tuple[Context, list[Link]]:
    """The parent and links of a span for a caller outside the deployment (a tenant at the public port).

    Baggage is never taken, and the sampling decision is ours: a client's
    ``traceparent`` with its sampled flag off cannot switch tracing off.

    - ``link``: a new trace rooted at our span; the client's span is a link.
    - ``continue``: our span joins the client's trace (same trace id, the
      client's span as parent), sampled as our own root spans are.
    """
    carrier = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
    remote = trace.get_current_span(_TRACECONTEXT.extract(carrier)).get_span_context()
    if not remote.is_valid:
        return Context(), []
    if policy == "link":
        return Context(), [Link(remote)]
    ours = SpanContext(remote.trace_id, remote.span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED),
                       trace_state=remote.trace_state)
    return trace.set_span_in_context(NonRecordingSpan(ours), Context()), []


def outgoing_metadata() -> list[tuple[str, str]]:
    """W3C trace context of the current span, as gRPC metadata for a backend call."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def trace_id_hex(span: trace.Span | None = None) -> str:
    """The trace id as 32 hex digits (what Jaeger's search box takes); empty if none."""
    context = (span or trace.get_current_span()).get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""
