"""Spans encoded straight into OTLP's wire format: the bytes the SDK's encoder produces, for any span the SDK
makes, and the request a real collector takes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags, \
    TraceState, set_span_in_context

from servicekit.span_export import _CACHE_ENTRIES, WireOtlpSpanExporter, _Encoder, encode_request
from tests.support.otlp_receiver import otlp_receiver

pytestmark = pytest.mark.unit

_text = st.text(max_size=12)
_int64 = st.integers(-(2**63), 2**63 - 1)
_scalar = st.one_of(_text, st.booleans(), _int64, st.floats(allow_nan=False), st.binary(max_size=8))
# The SDK keeps a sequence only when its items share one type (None allowed among them).
_sequence = st.one_of(*(st.lists(st.one_of(s, st.none()), max_size=4) for s in
                        (_text, st.booleans(), _int64, st.floats(allow_nan=False))))
_attributes = st.dictionaries(_text, st.one_of(_scalar, _sequence), max_size=5)
_ids = st.tuples(st.integers(1, 2**128 - 1), st.integers(1, 2**64 - 1))
_context = st.builds(lambda ids, remote, state: SpanContext(ids[0], ids[1], remote, TraceFlags(1), TraceState(state)),
                     _ids, st.booleans(), st.lists(st.tuples(st.sampled_from(["a", "vendor@x", "b1"]),
                                                             st.sampled_from(["1", "v-2"])), max_size=2, unique_by=lambda p: p[0]))
_span = st.fixed_dictionaries({
    "name": _text, "kind": st.sampled_from(list(SpanKind)), "attributes": _attributes,
    "parent": st.one_of(st.none(), _context),
    "events": st.lists(st.tuples(_text, _attributes, st.integers(0, 2**63)), max_size=3),
    "links": st.lists(st.tuples(_context, _attributes), max_size=2),
    "status": st.tuples(st.sampled_from(list(StatusCode)), st.one_of(st.none(), _text)),
    "scope": st.sampled_from([("grpc", None, ""), ("gateway.chat", "0.1.0", "https://opentelemetry.io/schemas/1.21.0"),
                              ("", None, "")]),
    "resource": st.sampled_from([0, 1]),
    "times": st.tuples(st.integers(0, 2**63), st.integers(0, 2**63)),
})


def _finished(specs: list[dict]) -> list:
    """The SDK's own spans, made as instrumentation makes them, from ``specs``."""
    kept = InMemorySpanExporter()
    providers = []
    for resource in (Resource.create({"service.name": "agent-gateway-gateway"}),
                     Resource({"host.name": "h", "pid": 7, "ok": True}, schema_url="https://x/1.2")):
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(SimpleSpanProcessor(kept))
        providers.append(provider)
    for spec in specs:
        name, version, schema = spec["scope"]
        tracer = providers[spec["resource"]].get_tracer(name, version, schema_url=schema or None)
        context = set_span_in_context(NonRecordingSpan(spec["parent"])) if spec["parent"] else None
        span = tracer.start_span(spec["name"], context, kind=spec["kind"], attributes=spec["attributes"],
                                 links=[Link(c, a) for c, a in spec["links"]], start_time=spec["times"][0])
        for event_name, attributes, timestamp in spec["events"]:
            span.add_event(event_name, attributes, timestamp)
        span.set_status(Status(*spec["status"]))
        span.end(end_time=spec["times"][1])
    return list(kept.get_finished_spans())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_span, min_size=1, max_size=6))
def test_the_bytes_are_the_sdks_for_any_span(specs):
    spans = _finished(specs)
    assert encode_request(spans) == encode_spans(spans).SerializeToString()


def test_a_value_off_the_fast_path_goes_through_the_sdks_encoder():
    # An int beyond 64 bits: the SDK logs it and leaves the attribute out; a mapping becomes a key-value list.
    spans = _finished([{"name": "big", "kind": SpanKind.SERVER, "attributes": {"n": 2**70, "ok": "yes"}, "parent": None,
                        "events": [], "links": [], "status": (StatusCode.UNSET, None), "scope": ("grpc", None, ""),
                        "resource": 0, "times": (1, 2)}])
    assert encode_request(spans) is None
    exporter = WireOtlpSpanExporter(endpoint="http://127.0.0.1:9", insecure=True)
    assert exporter._translate_data(spans) == encode_spans(spans)


def test_a_string_no_utf8_can_hold_is_left_to_the_sdk_which_drops_its_attribute():
    spans = _finished([{"name": "call", "kind": SpanKind.SERVER, "attributes": {"bad": "x\ud800", "ok": "y"},
                        "parent": None, "events": [], "links": [], "status": (StatusCode.UNSET, None),
                        "scope": ("grpc", None, ""), "resource": 0, "times": (1, 2)}])
    assert encode_request(spans) is None
    request = WireOtlpSpanExporter(endpoint="http://127.0.0.1:9", insecure=True)._translate_data(spans)
    assert request == encode_spans(spans)
    assert [a.key for a in request.resource_spans[0].scope_spans[0].spans[0].attributes] == ["ok"]


def test_recurring_attributes_come_from_the_cache_unchanged():
    specs = [{"name": f"call {i}", "kind": SpanKind.SERVER, "parent": None, "events": [], "links": [],
              "attributes": {"rpc.method": "Retrieve", "tenant": "dev", "ok": i % 2 == 0, "code": i % 3, "one": 1,
                             "true": True},
              "status": (StatusCode.OK, None), "scope": ("grpc", None, ""), "resource": 0, "times": (i + 1, i + 2)}
             for i in range(40)]
    spans = _finished(specs)
    exporter = WireOtlpSpanExporter(endpoint="http://127.0.0.1:9", insecure=True)
    for _ in range(2):  # the second time every pair is cached (True and 1 are different pairs)
        assert exporter._translate_data(spans).SerializeToString() == encode_spans(spans).SerializeToString()


def test_the_cache_stays_bounded_and_keeps_no_long_string():
    # Pairs that never recur (a count per call) fill the cache: it starts again rather than grow, and a long
    # string (a prompt, with AGW_TRACE_CONTENT) is encoded each time, never kept.
    specs = [{"name": "call", "kind": SpanKind.SERVER, "parent": None, "events": [], "links": [],
              "attributes": {**{f"count{k}": i * 10 + k for k in range(10)}, "prompt": "x" * 200 + str(i)},
              "status": (StatusCode.UNSET, None), "scope": ("grpc", None, ""), "resource": 0, "times": (1, 2)}
             for i in range(500)]
    spans = _finished(specs)
    encoder = _Encoder()
    assert encode_request(spans, encoder) == encode_spans(spans).SerializeToString()
    assert len(encoder._pairs) == (500 * 10) % _CACHE_ENTRIES  # 5,000 distinct pairs: full once, started again
    assert not any(key[1] == "prompt" for key in encoder._pairs)


def test_a_real_collector_takes_every_span_through_the_sdks_export_path():
    specs = [{"name": f"span {i}", "kind": SpanKind.CLIENT, "parent": None, "events": [("admitted", {"i": i}, 5)],
              "links": [], "attributes": {"i": i, "tenant": "dev"}, "status": (StatusCode.ERROR, "boom"),
              "scope": ("grpc", None, ""), "resource": i % 2, "times": (10, 20)} for i in range(50)]
    spans = _finished(specs)
    with otlp_receiver() as receiver:
        exporter = WireOtlpSpanExporter(endpoint=receiver.endpoint, insecure=True)
        translated = []
        translate = exporter._translate_data
        exporter._translate_data = lambda data: translated.append(len(data)) or translate(data)
        try:
            assert exporter.export(spans) == SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        received = receiver.spans()
    assert translated == [len(spans)]  # the SDK's export still encodes through _translate_data
    assert sorted(s.name for s in received) == sorted(f"span {i}" for i in range(50))
    assert {s.service for s in received} == {"agent-gateway-gateway", ""}
    assert all(s.status_code == 2 and s.events == ("admitted",) and s.attributes["tenant"] == "dev" for s in received)
