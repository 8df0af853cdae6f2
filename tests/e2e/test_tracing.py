"""Traces: one trace per turn across the gateway and retrieval, trace ids back to the client.

The gateway and the retrieval service run in this process, exporting into an
in-memory exporter; the inference service is a separate process whose spans
are not collected here.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry import trace

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from retrieval.ingest import sample_corpus
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.retrieval_service import passage_documents, retrieval_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def spans(recorded_spans):
    return recorded_spans


@pytest.fixture(scope="module")
async def stub(tmp_path_factory, pki, inference_service, database_url, spans):
    async with retrieval_server(tmp_path_factory.mktemp("trace-retrieval"), pki.root) as (retrieval, _):
        async with gateway_server(pki.root, inference_service.port, retrieval.port, database_url=database_url) as (gw, _):
            async with gateway_stub(gw.port, pki.root) as stub:
                await stub.IngestDocuments(pb.IngestDocumentsRequest(
                    collection="kb", documents=passage_documents(sample_corpus(max_per_topic=1)[:20])), timeout=60)
                yield stub


def _trace(spans, trace_id: str):
    return [s for s in spans.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id]


async def test_a_turn_is_one_trace_rooted_at_chat(stub, spans):
    session = (await stub.CreateSession(pb.CreateSessionRequest(), timeout=5)).session.id
    events = [e async for e in stub.Chat(pb.ChatRequest(
        session_id=session, message="What does the for statement do?",
        retrieval=pb.RetrievalOptions(collection="kb", top_k=2),
        generation=inference_pb2.SamplingParams(max_tokens=4)), timeout=60)]
    final = events[-1].final
    assert len(final.trace_id) == 32
    found = {s.name: s for s in _trace(spans, final.trace_id)}
    root = found["agent.gateway.v1.AgentGateway/Chat"]
    assert root.parent is None and root.kind == trace.SpanKind.SERVER
    for stage in ("history", "retrieval", "generation", "persist"):
        assert found[stage].parent.span_id == root.context.span_id, stage
    # The retrieval service's own span hangs under the gateway's retrieval stage: the context crossed the hop.
    search = found["agent.retrieval.v1.Retrieval/Search"]
    assert search.parent.span_id == found["retrieval"].context.span_id
    # The generation stage names the replica routing chose, and why (one replica: its first choice).
    assert found["generation"].attributes["agw.inference.route_reason"] == "affinity"
    assert found["generation"].attributes["agw.inference.replica"]
    assert all(s.end_time is not None for s in found.values())


async def test_every_rpc_returns_its_trace_id_in_the_trailers(stub, spans):
    call = stub.CreateSession(pb.CreateSessionRequest(), timeout=5)
    await call
    trailers = dict(await call.trailing_metadata())
    assert len(trailers["x-trace-id"]) == 32
    assert _trace(spans, trailers["x-trace-id"])


async def test_failed_and_cancelled_turns_end_their_spans_with_an_error(stub, spans):
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        async for _ in stub.Chat(pb.ChatRequest(message=" "), timeout=10):
            pass
    failed_id = dict(failed.value.trailing_metadata())["x-trace-id"]
    (failed_span,) = [s for s in _trace(spans, failed_id) if s.name.endswith("/Chat")]
    assert failed_span.status.status_code == trace.StatusCode.ERROR
    assert "INVALID_ARGUMENT" in failed_span.status.description

    call = stub.Chat(pb.ChatRequest(message="Go on and on.", generation=inference_pb2.SamplingParams(
        max_tokens=3000, ignore_eos=True)), timeout=60)
    await call.read()
    call.cancel()
    await asyncio.sleep(0.5)
    cancelled = [s for s in spans.get_finished_spans() if s.name.endswith("/Chat")][-1]
    assert cancelled.status.status_code == trace.StatusCode.ERROR
    generation = [s for s in spans.get_finished_spans() if s.name == "generation"][-1]
    assert generation.context.trace_id == cancelled.context.trace_id and generation.end_time is not None
