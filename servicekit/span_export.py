"""The OTLP span exporter our services use: OpenTelemetry's, with spans encoded straight into protobuf's wire format.

The SDK's exporter builds a protobuf object for every span, attribute and
value in Python, then serialises the tree: 16-21 ms of CPU for a batch of 512
spans on the 2-core VMs this project is measured on, 30-40 µs a span. It
runs on the batch processor's thread, holding the GIL, so every thread of the
process that wants the GIL meanwhile (the event loop, gRPC's poller) waits out
the interpreter's switch interval, 5 ms, each time: a call served while its
process exported took up to 19-34 ms instead of 1-3 (docs/benchmarks.md, "What
an export does to the calls it overlaps").

:func:`encode_request` writes the same bytes directly: a span's fields in
field order, each key-value pair of a common value (a short string, a bool,
an int) encoded once and reused from a bounded cache. The request is parsed back
into the SDK's message (C code, a fraction of a millisecond) so that the SDK's
exporter sends it unchanged, with its settings, retries and ``OTEL_*``
variables. A value the fast path does not take (a mapping, an int beyond 64
bits, a string no UTF-8 can hold) sends the batch through the SDK's own
encoder instead, which decides what becomes of it.
"""

from __future__ import annotations

import logging
import struct
from collections import defaultdict
from collections.abc import Sequence

# A batch's resource and scopes are encoded by the SDK's own functions (private; the version is pinned).
from opentelemetry.exporter.otlp.proto.common._internal import _encode_instrumentation_scope, _encode_resource
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext

from servicekit.wire import varint

log = logging.getLogger(__name__)

_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack
_DOUBLE = struct.Struct("<d").pack
_INT64 = range(-(2**63), 2**63)
#: OTLP's SpanFlags: the flags say whether the parent (or a link's span) is remote, and that they say so.
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200
#: Key-value pairs kept encoded: the gRPC method, the tenant, the status code recur on every call. Full, the
#: cache starts again, so pairs that never recur (a call's token count) cannot keep out those that do.
_CACHE_ENTRIES = 4096
#: Longer strings are not kept: a prompt (``AGW_TRACE_CONTENT``) is unique, and 4,096 of them would be megabytes.
_CACHED_STRING_CHARS = 128


class _NotOnTheFastPath(Exception):
    """A value :func:`encode_request` leaves to the SDK's encoder."""


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    return tag + varint(len(payload)) + payload


def _any_value(value) -> bytes:
    """An ``AnyValue``'s fields. Its value is a oneof, so a zero, an empty string or False is still written."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _field(b"\x0a", value.encode())
    if isinstance(value, int):
        if value not in _INT64:
            raise _NotOnTheFastPath(f"int {value} beyond 64 bits")
        return b"\x18" + varint(value & 0xFFFF_FFFF_FFFF_FFFF)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if isinstance(value, (tuple, list)):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _any_value(item)) for item in value))
    raise _NotOnTheFastPath(f"a value of type {type(value).__name__}")


class _Encoder:
    """Encodes spans into ``ExportTraceServiceRequest`` bytes, keeping the encodings of recurring attributes."""

    def __init__(self) -> None:
        #: (the field's tag, key, the value's type, value): the whole field, tag included. True and 1 are equal
        #: keys to a dict, hence the type.
        self._pairs: dict[tuple, bytes] = {}

    def _attributes(self, tag: bytes, attributes) -> list[bytes]:
        """Each attribute as a ``KeyValue`` field with ``tag``."""
        if not attributes:
            return []
        fields = []
        for key, value in attributes.items():
            kind = value.__class__
            cacheable = kind is bool or kind is int or (kind is str and len(value) <= _CACHED_STRING_CHARS)
            if cacheable:
                encoded = self._pairs.get((tag, key, kind, value))
                if encoded is not None:
                    fields.append(encoded)
                    continue
            encoded = _field(tag, (_field(b"\x0a", key.encode()) if key else b"") + _field(b"\x12", _any_value(value)))
            if cacheable:
                if len(self._pairs) >= _CACHE_ENTRIES:
                    self._pairs.clear()
                self._pairs[(tag, key, kind, value)] = encoded
            fields.append(encoded)
        return fields

    def span(self, span: ReadableSpan) -> bytes:
        """One ``Span`` message, as the SDK's encoder would serialise it.

        Its fields in number order, each behind its tag (the number << 3 | the wire type): trace_id 1,
        span_id 2, trace_state 3, parent_span_id 4, name 5, kind 6, start and end 7 and 8 (fixed64),
        attributes 9, and the dropped attributes' count 10, events 11 (12), links 13 (14), status 15,
        flags 16 (fixed32, a two-byte tag). A zero, an empty string or an absent part is left out, as
        protobuf does.
        """
        context, parent = span.context, span.parent
        parts = [b"\x0a\x10", context.trace_id.to_bytes(16, "big"), b"\x12\x08", context.span_id.to_bytes(8, "big")]
        if context.trace_state:
            parts.append(_field(b"\x1a", ",".join(f"{k}={v}" for k, v in context.trace_state.items()).encode()))
        if parent is not None:
            parts += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
        if span.name:
            parts.append(_field(b"\x2a", span.name.encode()))
        parts += (b"\x30", varint(span.kind.value + 1))
        if span.start_time:
            parts += (b"\x39", _FIXED64(span.start_time))
        if span.end_time:
            parts += (b"\x41", _FIXED64(span.end_time))
        parts += self._attributes(b"\x4a", span.attributes)
        if span.dropped_attributes:
            parts += (b"\x50", varint(span.dropped_attributes))
        for event in span.events:
            event_parts = [b"\x09", _FIXED64(event.timestamp)] if event.timestamp else []
            if event.name:
                event_parts.append(_field(b"\x12", event.name.encode()))
            event_parts += self._attributes(b"\x1a", event.attributes)
            if event.dropped_attributes:
                event_parts += (b"\x20", varint(event.dropped_attributes))
            parts.append(_field(b"\x5a", b"".join(event_parts)))
        if span.dropped_events:
            parts += (b"\x60", varint(span.dropped_events))
        for link in span.links:
            link_parts = [b"\x0a\x10", link.context.trace_id.to_bytes(16, "big"),
                          b"\x12\x08", link.context.span_id.to_bytes(8, "big")]
            link_parts += self._attributes(b"\x22", link.attributes)
            if link.dropped_attributes:
                link_parts += (b"\x28", varint(link.dropped_attributes))
            link_parts += (b"\x35", _FIXED32(_flags(link.context)))
            parts.append(_field(b"\x6a", b"".join(link_parts)))
        if span.dropped_links:
            parts += (b"\x70", varint(span.dropped_links))
        status = span.status
        parts.append(_field(b"\x7a", (_field(b"\x12", status.description.encode()) if status.description else b"")
                            + (b"\x18" + varint(status.status_code.value) if status.status_code.value else b"")))
        parts += (b"\x85\x01", _FIXED32(_flags(parent)))
        return b"".join(parts)

    def request(self, spans: Sequence[ReadableSpan]) -> bytes:
        """The ``ExportTraceServiceRequest``: spans grouped by resource, then by instrumentation scope, each group
        in the order it first appears, as the SDK groups them."""
        groups: dict = defaultdict(lambda: defaultdict(list))
        # A Resource hashes by dumping its attributes to JSON: look each object up once (the spans of a process
        # share one), by identity, which the batch's spans keep alive.
        by_identity: dict[tuple[int, int], list[bytes]] = {}
        for span in spans:
            identity = (id(span.resource), id(span.instrumentation_scope))
            group = by_identity.get(identity)
            if group is None:
                group = by_identity[identity] = groups[span.resource][span.instrumentation_scope or None]
            group.append(_field(b"\x12", self.span(span)))
        resource_spans = []
        for resource, scopes in groups.items():
            parts = [_field(b"\x0a", _encode_resource(resource).SerializeToString())]
            for scope, encoded_spans in scopes.items():
                encoded_scope = _encode_instrumentation_scope(scope).SerializeToString()
                scope_parts = [_field(b"\x0a", encoded_scope), *encoded_spans]
                if scope is not None and scope.schema_url:
                    scope_parts.append(_field(b"\x1a", scope.schema_url.encode()))
                parts.append(_field(b"\x12", b"".join(scope_parts)))
            if resource.schema_url:
                parts.append(_field(b"\x1a", resource.schema_url.encode()))
            resource_spans.append(_field(b"\x0a", b"".join(parts)))
        return b"".join(resource_spans)


def _flags(context: SpanContext | None) -> int:
    return _HAS_IS_REMOTE | (_IS_REMOTE if context is not None and context.is_remote else 0)


def encode_request(spans: Sequence[ReadableSpan], encoder: _Encoder | None = None) -> bytes | None:
    """``spans`` as a serialised ``ExportTraceServiceRequest``, the bytes the SDK's encoder would produce; None
    where a value is one the fast path leaves to the SDK."""
    try:
        return (encoder or _Encoder()).request(spans)
    except _NotOnTheFastPath:
        return None
    except Exception:  # noqa: BLE001 - e.g. a string no UTF-8 can hold: the SDK's encoder decides (it skips
        # such an attribute and logs it), so a batch never fails here where it would not have failed there
        log.debug("a span batch left to the SDK's encoder", exc_info=True)
        return None


class WireOtlpSpanExporter(OTLPSpanExporter):
    """``OTLPSpanExporter`` (same settings, same ``OTEL_*`` variables), encoding with :func:`encode_request`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._encoder = _Encoder()

    # The SDK's exporter encodes through this method, on every try (opentelemetry-exporter-otlp-proto-grpc,
    # pinned in pyproject.toml; tests/unit/test_span_export.py fails if it stops calling it).
    def _translate_data(self, data: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
        encoded = encode_request(data, self._encoder)
        if encoded is None:
            return super()._translate_data(data)
        return ExportTraceServiceRequest.FromString(encoded)
