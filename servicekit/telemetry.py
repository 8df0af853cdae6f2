"""OpenTelemetry tracing: the provider each process sets up, and W3C context on every hop.

With ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, spans go to that collector (Jaeger
on 4317 in compose) through a batch processor and the standard ``OTEL_*``
variables, encoded by :mod:`servicekit.span_export`; the same with ``AGW_TRACE_FILE``, to a file. Without either nothing
would read a span, so none is recorded: every call still gets a trace id (the
server span is made without the SDK then: :class:`UnrecordedServerSpans`),
returned to clients and passed to backends, marked unsampled; a span started
under it is that span (:class:`UnrecordedTracerProvider`).
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
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
    recording = exporting or bool(trace_file)
    provider = (TracerProvider if recording else UnrecordedTracerProvider)(
        resource=resource, sampler=None if recording else ALWAYS_OFF)
    if exporting:
        from servicekit.span_export import WireOtlpSpanExporter

        provider.add_span_processor(BatchSpanProcessor(WireOtlpSpanExporter(timeout=_export_timeout_s())))
        log.info("tracing: exporting spans over OTLP to %s", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    elif not trace_file:
        log.info("tracing: no OTEL_EXPORTER_OTLP_ENDPOINT nor AGW_TRACE_FILE, spans are not recorded "
                 "(trace ids still are returned)")
    if trace_file:
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(trace_file)))
        log.info("tracing: appending spans to %s (read them with: agentgw trace TRACE_ID)", trace_file)
    trace.set_tracer_provider(provider)
    return provider


class _ChildlessTracer(trace.Tracer):
    """A tracer of a process that records no span: a span started under one of this process's own spans is
    that span.

    The SDK would start a new non-recording span there: the parent's trace id,
    state and flags under a new span id, about 4 µs, and 8 µs as the current
    span (the ``qdrant search`` of every search, the inference service's spans
    of every generation, the Chat turn's stages). Nothing reads that span id.
    Roots, and spans under a caller's (remote) context, are the SDK's.
    """

    def __init__(self, sdk_tracer: trace.Tracer) -> None:
        self._sdk = sdk_tracer

    def start_span(self, name: str, context: Context | None = None, *args, **kwargs) -> trace.Span:
        parent = trace.get_current_span(context)
        span_context = parent.get_span_context()
        if span_context.is_valid and not span_context.is_remote and not parent.is_recording():
            return parent
        return self._sdk.start_span(name, context, *args, **kwargs)

    def start_as_current_span(self, name: str, context: Context | None = None, *args, end_on_exit: bool = True,
                              **kwargs) -> AbstractContextManager[trace.Span]:
        span = self.start_span(name, context, *args, **kwargs)
        if context is None and span is trace.get_current_span():  # already current: nothing to attach or end
            return nullcontext(span)
        return trace.use_span(span, end_on_exit=end_on_exit)


class UnrecordedTracerProvider(TracerProvider):
    """The provider :func:`configure_tracing` installs where nothing reads spans: it samples none, and its
    tracers make no child spans (:class:`_ChildlessTracer`)."""

    def get_tracer(self, *args, **kwargs) -> trace.Tracer:
        return _ChildlessTracer(super().get_tracer(*args, **kwargs))


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


#: W3C traceparent, as OpenTelemetry's propagator reads it: version, trace id, span id, flags, and what a later
#: version may add.
_TRACEPARENT = re.compile(r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?[ \t]*$")
#: What the default propagators (W3C trace context and baggage) read: the only ones the fast path knows.
_DEFAULT_FIELDS = frozenset({"traceparent", "tracestate", "baggage"})


def _remote_span_context(traceparent: str) -> SpanContext | None:
    """The caller's span context in ``traceparent``, or None where OpenTelemetry's propagator would find none."""
    match = _TRACEPARENT.match(traceparent)
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if trace_id == "0" * 32 or span_id == "0" * 16 or version == "ff" or (version == "00" and rest):
        return None
    return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16)))


class UnrecordedServerSpans:
    """Server spans in a process that records none: the span the SDK would make, made without it.

    With nothing to read spans (:func:`configure_tracing` samples none), the
    SDK still starts each call's server span: the caller's context extracted
    through the propagators, the sampler asked, links built, ids drawn; about
    19 µs of every call's CPU on the loop (bench/edge_costs.py), for a span
    that records nothing. What the call needs of it is its trace id (returned
    to the caller, passed to backends, unsampled). :meth:`start` makes the same
    non-recording span directly: the caller's trace id where the policy keeps
    it (else a new one from the provider's id generator), a new span id, and
    the flags the SDK would set. Where the caller sent what only the SDK's way
    keeps (tracestate or baggage from a caller it trusts, tracestate where a
    client's trace is continued), it returns None and the SDK's way is taken.
    """

    def __init__(self, provider: TracerProvider, policy: str | None) -> None:
        """``policy``: None for callers that are our own services, else ``link`` or ``continue``
        (:func:`client_context`)."""
        self.ids = provider.id_generator
        self.policy = policy
        #: Headers whose presence sends a call the SDK's way.
        self.kept = {None: ("tracestate", "baggage"), "continue": ("tracestate",)}.get(policy, ())

    def start(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> NonRecordingSpan | None:
        traceparent = None
        for key, value in metadata or ():
            if key == "traceparent" and isinstance(value, str):
                traceparent = value  # the last one, as the SDK's carrier (a dict) keeps it
            elif key in self.kept:
                return None
        remote = _remote_span_context(traceparent) if traceparent and self.policy != "link" else None
        if remote is None:  # a trace of our own
            trace_id = self.ids.generate_trace_id()
            random_id = self.ids.is_trace_id_random()
        else:  # a caller's trace; a public client's flags are not taken (client_context)
            trace_id = remote.trace_id
            random_id = self.policy is None and remote.trace_flags.random_trace_id
        flags = TraceFlags(TraceFlags.RANDOM_TRACE_ID if random_id else TraceFlags.DEFAULT)
        return NonRecordingSpan(SpanContext(trace_id, self.ids.generate_span_id(), is_remote=False,
                                            trace_flags=flags))


def unrecorded_server_spans(policy: str | None) -> UnrecordedServerSpans | None:
    """Server spans made without the SDK (:class:`UnrecordedServerSpans`), for this process's provider; None
    where spans may be recorded or the propagators are not the default ones (the SDK's way then)."""
    provider = trace.get_tracer_provider()
    if spans_recorded(provider) or not isinstance(provider, TracerProvider):
        return None
    if set(propagate.get_global_textmap().fields) != _DEFAULT_FIELDS:
        return None
    return UnrecordedServerSpans(provider, policy)


def outgoing_metadata() -> list[tuple[str, str]]:
    """W3C trace context of the current span, as gRPC metadata for a backend call."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def trace_id_hex(span: trace.Span | None = None) -> str:
    """The trace id as 32 hex digits (what Jaeger's search box takes); empty if none."""
    context = (span or trace.get_current_span()).get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""
