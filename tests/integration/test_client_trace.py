"""Traces the gateway owns: a client's traceparent cannot switch sampling off, attach to another trace, or pass baggage."""

from __future__ import annotations

import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.retrieval_service import retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.integration

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
#: A client's context with its sampled flag off (-00), and baggage it would like the backends to see.
METADATA = (("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"), ("baggage", "tenant=someone-else,debug=1"))


def _spans(recorded_spans, trace_id: str, name: str):
    return [s for s in recorded_spans.get_finished_spans()
            if format(s.context.trace_id, "032x") == trace_id and s.name == name]


@pytest.mark.parametrize("mode", ["link", "continue"])
async def test_a_client_cannot_switch_sampling_off_nor_pass_baggage(tmp_path, pki, database_url, recorded_spans, mode):
    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _), \
            scripted_app(pki.root) as (inference, app), \
            gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url,
                           client_trace=mode) as (gateway, _):
        async with gateway_stub(gateway.port, pki.root) as stub:
            call = stub.Chat(pb.ChatRequest(message="tokens=2 traced?"), timeout=10, metadata=METADATA)
            events = [event async for event in call]
            returned = dict(await call.trailing_metadata())["x-trace-id"]
    assert events[-1].final.trace_id == returned
    [server_span] = _spans(recorded_spans, returned, "agent.gateway.v1.AgentGateway/Chat")  # sampled and recorded
    assert server_span.context.trace_flags.sampled
    if mode == "link":
        assert returned != CLIENT_TRACE and server_span.parent is None  # the gateway's own trace...
        [link] = server_span.links  # ...that records where the client came from
        assert format(link.context.trace_id, "032x") == CLIENT_TRACE
        assert format(link.context.span_id, "016x") == CLIENT_SPAN
    else:
        assert returned == CLIENT_TRACE and format(server_span.parent.span_id, "016x") == CLIENT_SPAN
    # What reached the inference service: the gateway's trace context, sampled, and no client baggage.
    forwarded = app.servicer.metadata[-1]
    assert "baggage" not in forwarded
    _, trace_id, _, flags = forwarded["traceparent"].split("-")
    assert trace_id == returned and int(flags, 16) & 1  # the sampled bit
