"""One Chat turn, exported over OTLP/gRPC by three service processes into a real receiver.

The gateway and retrieval services run here as processes of their own; the
session's inference service already exports to the same receiver (see the
``otlp`` fixture). Nothing is collected in-process: what is asserted is what
Jaeger would receive.
"""

from __future__ import annotations

import socket
import time

import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from retrieval.ingest import sample_corpus
from servicekit.supervisor import ServiceProcess
from tests.support.gateway_stack import gateway_stub
from tests.support.retrieval_service import passage_documents

pytestmark = pytest.mark.e2e

CHAT_SPAN = "agent.gateway.v1.AgentGateway/Chat"
SERVICES = {"agent-gateway-gateway", "agent-gateway-retrieval", "agent-gateway-inference"}


def _gateway_process(workdir, pki, inference_service, database_url, retrieval_port: int, otel_env: dict):
    return ServiceProcess("gateway.main", workdir, pki.root, "AGW_GATEWAY_", env={
        "AGW_HOME": str(workdir / "home"), "AGW_GATEWAY_WORKERS": "1", "AGW_DATABASE_URL": database_url,
        "AGW_GATEWAY_INFERENCE_TARGET": f"127.0.0.1:{inference_service.port}",
        "AGW_GATEWAY_RETRIEVAL_TARGET": f"127.0.0.1:{retrieval_port}", **otel_env,
    })


@pytest.fixture(scope="module")
def retrieval_port(tmp_path_factory, pki, otlp):
    work = tmp_path_factory.mktemp("otlp-retrieval")
    retrieval = ServiceProcess("retrieval.main", work, pki.root, "AGW_RETRIEVAL_",
                               env={"AGW_HOME": str(work / "home"), **otlp.environment()})
    try:
        yield retrieval.wait_serving()
    finally:
        retrieval.stop()


@pytest.fixture(scope="module")
def gateway_port(tmp_path_factory, pki, inference_service, database_url, otlp, retrieval_port):
    gateway = _gateway_process(tmp_path_factory.mktemp("otlp-gateway"), pki, inference_service, database_url,
                               retrieval_port, otlp.environment())
    try:
        yield gateway.wait_serving()
    finally:
        gateway.stop()


def _ancestors(span, by_id):
    chain = []
    while span.parent_span_id:
        span = by_id[span.parent_span_id]
        chain.append(span.name)
    return chain


def _complete(spans) -> bool:
    names = {s.name for s in spans}
    return ({s.service for s in spans} >= SERVICES and CHAT_SPAN in names and "qdrant search" in names
            and any(s.name.startswith("chat ") for s in spans) and "persist" in names)


async def test_a_turn_is_one_tree_across_three_processes(gateway_port, pki, otlp):
    async with gateway_stub(gateway_port, pki.root) as stub:
        await stub.IngestDocuments(pb.IngestDocumentsRequest(
            collection="kb", documents=passage_documents(sample_corpus(max_per_topic=1)[:12])), timeout=60)
        session = (await stub.CreateSession(pb.CreateSessionRequest(), timeout=5)).session.id
        events = [e async for e in stub.Chat(pb.ChatRequest(
            session_id=session, message="What does the for statement do?",
            retrieval=pb.RetrievalOptions(collection="kb", top_k=2),
            generation=inference_pb2.SamplingParams(max_tokens=5, temperature=0.0)), timeout=60)]
    final = events[-1].final
    context = next(e.context for e in events if e.HasField("context"))

    spans = otlp.wait_for(final.trace_id, _complete)
    by_id = {s.span_id: s for s in spans}

    # One tree: every parent was exported too, and the only root is the Chat call.
    assert all(not s.parent_span_id or s.parent_span_id in by_id for s in spans)
    assert [s.name for s in spans if not s.parent_span_id] == [CHAT_SPAN]
    assert all(s.end_ns >= s.start_ns > 0 for s in spans)
    assert {s.service for s in spans} == SERVICES

    named = {}
    for span in spans:
        named.setdefault(span.name, span)
    for stage in ("admission", "history", "retrieval", "generation", "persist"):
        assert _ancestors(named[stage], by_id)[-1] == CHAT_SPAN, stage

    # Retrieval's spans sit under the gateway's retrieval stage, in the retrieval process.
    search = named["qdrant search"]
    assert search.service == "agent-gateway-retrieval"
    assert "agent.retrieval.v1.Retrieval/Search" in _ancestors(search, by_id)
    assert "retrieval" in _ancestors(search, by_id)
    assert search.attributes["db.collection.name"].endswith("-kb")
    assert search.attributes["agw.search.returned"] == len(context.documents) == 2
    assert search.attributes["agw.search.top_k"] == 2
    assert search.attributes["agw.search.hnsw_ef"] > 0 and search.attributes["agw.search.exact"] is False
    assert search.attributes["agw.search.payload_bytes"] > 0
    assert _ancestors(named["embed query"], by_id)[0] == "agent.retrieval.v1.Retrieval/Search"

    # Inference's GenAI span under the gateway's generation stage, with the turn's real token counts.
    (generate,) = [s for s in spans if s.name.startswith("chat ")]
    assert generate.service == "agent-gateway-inference"
    assert "generation" in _ancestors(generate, by_id)
    attributes = generate.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.max_tokens"] == 5
    assert attributes["gen_ai.request.temperature"] == 0.0
    assert attributes["gen_ai.request.model"] == generate.name.removeprefix("chat ")
    assert attributes["gen_ai.usage.input_tokens"] == final.usage.prompt_tokens > 0
    assert attributes["gen_ai.usage.output_tokens"] == final.usage.completion_tokens == 5
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == final.usage.cached_prompt_tokens
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert "gen_ai.first_token" in generate.events
    # Content is off unless AGW_TRACE_CONTENT=1.
    assert not any(key.startswith("gen_ai.input") or key.startswith("gen_ai.output") for key in attributes)

    # Postgres: the pool wait and the queries (asyncpg instrumentation) under history and persist.
    acquires = [s for s in spans if s.name == "postgres pool acquire"]
    assert {_ancestors(s, by_id)[0] for s in acquires} >= {"history", "persist"}
    queries = [s for s in spans if s.attributes.get("db.system") == "postgresql"]
    assert queries and all("persist" in _ancestors(q, by_id) or "history" in _ancestors(q, by_id) for q in queries)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_turns_succeed_when_the_collector_is_down(tmp_path, pki, inference_service, database_url, retrieval_port):
    nobody = f"http://127.0.0.1:{_free_port()}"  # nothing listens here
    gateway = _gateway_process(tmp_path, pki, inference_service, database_url, retrieval_port, {
        "OTEL_EXPORTER_OTLP_ENDPOINT": nobody, "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "100",
    })
    try:
        port = gateway.wait_serving()
        async with gateway_stub(port, pki.root) as stub:
            for _ in range(3):  # spans pile up for a dead collector; turns must not notice
                events = [e async for e in stub.Chat(pb.ChatRequest(
                    message="Say something.", generation=inference_pb2.SamplingParams(max_tokens=3)), timeout=30)]
                final = events[-1].final
                assert final.usage.completion_tokens == 3 and len(final.trace_id) == 32
                assert final.timings.total_ms < 5000, final.timings
        stopping = time.monotonic()
        assert gateway.stop(timeout=30) == 0
        # Shutdown flushes spans, but a dead collector must not hold it up past the export timeout.
        assert time.monotonic() - stopping < 15, "the gateway's shutdown waited on the dead collector"
    finally:
        gateway.stop(timeout=5)
