"""Spans where nothing records them: server spans made without the SDK (the same trace id, flags and state as
the SDK's), and no child spans."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from servicekit.telemetry import UnrecordedServerSpans, UnrecordedTracerProvider, client_context, extract_context

pytestmark = pytest.mark.unit

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
POLICIES = (None, "link", "continue")
TRACEPARENTS = [
    None,
    f"00-{TRACE}-{SPAN}-00", f"00-{TRACE}-{SPAN}-01", f"00-{TRACE}-{SPAN}-02", f"00-{TRACE}-{SPAN}-03",
    f"ff-{TRACE}-{SPAN}-01",  # version ff: invalid
    f"00-{'0' * 32}-{SPAN}-01", f"00-{TRACE}-{'0' * 16}-01",  # zero ids: invalid
    f"00-{TRACE.upper()}-{SPAN}-01",  # upper case: invalid
    f"00-{TRACE}-{SPAN}-01-extra",  # version 00 with more: invalid
    f"01-{TRACE}-{SPAN}-01-extra",  # a later version may add fields
    f" \t00-{TRACE}-{SPAN}-01 ", "garbage", "",
]


def _sdk_span(provider: TracerProvider, metadata, policy):
    """The server span as the interceptor starts it through the SDK (servicekit.interceptors._ServerSpan)."""
    if policy is None:
        parent, links = extract_context(metadata), []
    else:
        parent, links = client_context(metadata, policy)
    return provider.get_tracer("test").start_span("call", context=parent, kind=trace.SpanKind.SERVER, links=links)


def _remote_trace_ids(metadata) -> set[int]:
    """The trace ids the callers' traceparents name, valid or not."""
    ids = set()
    for key, value in metadata:
        parts = value.strip().split("-") if key == "traceparent" else []
        try:
            ids.add(int(parts[1], 16))
        except (IndexError, ValueError):
            pass
    return ids


def _assert_same_as_the_sdk(metadata, policy) -> None:
    provider = TracerProvider(sampler=ALWAYS_OFF)
    fast = UnrecordedServerSpans(provider, policy).start(metadata)
    sdk = _sdk_span(provider, metadata, policy)
    assert not sdk.is_recording()
    if fast is None:  # the SDK's way: only for what only it keeps
        kept = {"tracestate", "baggage"} if policy is None else {"tracestate"} if policy == "continue" else set()
        assert kept & {key for key, _ in metadata}
        return
    ours, theirs = fast.get_span_context(), sdk.get_span_context()
    assert not fast.is_recording() and ours.is_valid and not ours.is_remote
    assert ours.trace_flags == theirs.trace_flags and ours.trace_state == theirs.trace_state
    continued = theirs.trace_id in _remote_trace_ids(metadata)
    if continued:
        assert ours.trace_id == theirs.trace_id
    else:  # both a trace of their own: neither takes the caller's
        assert ours.trace_id not in _remote_trace_ids(metadata)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("traceparent", TRACEPARENTS)
def test_the_span_is_the_one_the_sdk_makes(policy, traceparent):
    metadata = [("user-agent", "grpc-python"), *([("traceparent", traceparent)] if traceparent is not None else [])]
    _assert_same_as_the_sdk(metadata, policy)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("extra", [("tracestate", "vendor=1"), ("baggage", "tenant=someone-else"),
                                   ("x-forwarded-client-cert", "By=spiffe://x;URI=spiffe://y")])
def test_what_only_the_sdk_keeps_sends_the_call_its_way(policy, extra):
    _assert_same_as_the_sdk([("traceparent", f"00-{TRACE}-{SPAN}-01"), extra], policy)


def test_a_trusted_callers_trace_is_continued_and_a_public_clients_only_where_asked():
    provider = TracerProvider(sampler=ALWAYS_OFF)
    metadata = [("traceparent", f"00-{TRACE}-{SPAN}-03")]
    ids = {policy: format(UnrecordedServerSpans(provider, policy).start(metadata).get_span_context().trace_id, "032x")
           for policy in POLICIES}
    assert ids[None] == ids["continue"] == TRACE and ids["link"] != TRACE


_HEX = "0123456789abcdef"


@settings(max_examples=300, deadline=None)
@given(version=st.sampled_from(["00", "01", "fe", "ff", "0g"]),
       trace_id=st.one_of(st.just("0" * 32), st.text(_HEX, min_size=31, max_size=33), st.text(_HEX + "A", min_size=32,
                                                                                              max_size=32)),
       span_id=st.one_of(st.just("0" * 16), st.text(_HEX, min_size=16, max_size=16)),
       flags=st.sampled_from(["00", "01", "02", "03", "ff", "x1"]), rest=st.sampled_from(["", "-", "-more"]),
       policy=st.sampled_from(POLICIES))
def test_any_traceparent_gives_what_the_sdk_gives(version, trace_id, span_id, flags, rest, policy):
    _assert_same_as_the_sdk([("traceparent", f"{version}-{trace_id}-{span_id}-{flags}{rest}")], policy)


def test_a_span_started_under_a_calls_span_is_that_span():
    tracer = UnrecordedTracerProvider(sampler=ALWAYS_OFF).get_tracer("test")
    call = UnrecordedServerSpans(TracerProvider(sampler=ALWAYS_OFF), None).start([])
    token = otel_context.attach(trace.set_span_in_context(call))
    try:
        assert tracer.start_span("qdrant search") is call
        with tracer.start_as_current_span("admission", attributes={"agw.admission.in_flight": 1}) as admission:
            assert admission is call and trace.get_current_span() is call
        assert trace.get_current_span() is call
        with pytest.raises(ValueError):  # an error inside passes through untouched
            with tracer.start_as_current_span("persist"):
                raise ValueError("boom")
        assert trace.get_current_span() is call
    finally:
        otel_context.detach(token)


def test_a_span_under_a_context_not_current_is_made_current_then_restored():
    tracer = UnrecordedTracerProvider(sampler=ALWAYS_OFF).get_tracer("test")
    other = UnrecordedServerSpans(TracerProvider(sampler=ALWAYS_OFF), None).start([])
    with tracer.start_as_current_span("child", context=trace.set_span_in_context(other)) as child:
        assert child is other and trace.get_current_span() is other
    assert trace.get_current_span() is not other


def test_roots_and_spans_under_a_callers_context_are_the_sdks():
    tracer = UnrecordedTracerProvider(sampler=ALWAYS_OFF).get_tracer("test")
    root = tracer.start_span("root")
    assert root.get_span_context().is_valid and not root.is_recording()
    remote = extract_context([("traceparent", f"00-{TRACE}-{SPAN}-01")])
    under_caller = tracer.start_span("call", context=remote).get_span_context()
    assert format(under_caller.trace_id, "032x") == TRACE and format(under_caller.span_id, "016x") != SPAN
    assert not under_caller.is_remote
    recording = TracerProvider().get_tracer("test").start_span("recorded elsewhere")
    assert tracer.start_span("child", context=trace.set_span_in_context(recording)) is not recording
