"""One Chat turn, exported over OTLP/gRPC by three service processes into a real receiver.

The gateway and retrieval services run here as processes of their own; the
session's inference service already exports to the same receiver (see the
``otlp`` fixture). Nothing is collected in-process: what is asserted is what
Jaeger would receive.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from retrieval.ingest import sample_corpus
from agentgw.supervisor import ServiceProcess
from tests.support.gateway_stack import gateway_stub
from tests.support.prometheus import scrape, total
from tests.support.retrieval_service import passage_documents
from tests.support.servers import free_port

pytestmark = pytest.mark.e2e

CHAT_SPAN = "agent.gateway.v1.AgentGateway/Chat"
SERVICES = {"agent-gateway-gateway", "agent-gateway-retrieval", "agent-gateway-inference"}


def _gateway_process(workdir, pki, inference_service, database_url, retrieval_port: int, otel_env: dict):
    return ServiceProcess("gateway.main", workdir, pki.root, "AGW_GATEWAY_", env={
        "AGW_HOME": str(workdir / "home"), "AGW_GATEWAY_WORKERS": "1", "AGW_DATABASE_URL": database_url,
        "AGW_GATEWAY_INFERENCE_TARGET": f"127.0.0.1:{inference_service.port}",
        "AGW_GATEWAY_RETRIEVAL_TARGET": f"127.0.0.1:{retrieval_port}", **otel_env,
    })


@dataclass(frozen=True)
class Endpoint:
    port: int
    metrics_port: int


@pytest.fixture(scope="module")
def retrieval(tmp_path_factory, pki, otlp):
    work = tmp_path_factory.mktemp("otlp-retrieval")
    metrics_port = free_port()
    process = ServiceProcess("retrieval.main", work, pki.root, "AGW_RETRIEVAL_", env={
        "AGW_HOME": str(work / "home"), "AGW_RETRIEVAL_METRICS_PORT": str(metrics_port), **otlp.environment()})
    try:
        yield Endpoint(process.wait_serving(), metrics_port)
    finally:
        process.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, pki, inference_service, database_url, otlp, retrieval):
    metrics_port = free_port()
    process = _gateway_process(tmp_path_factory.mktemp("otlp-gateway"), pki, inference_service, database_url,
                               retrieval.port, {**otlp.environment(), "AGW_GATEWAY_METRICS_PORT": str(metrics_port)})
    try:
        yield Endpoint(process.wait_serving(), metrics_port)
    finally:
        process.stop()


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


async def test_a_turn_is_one_tree_across_three_processes(gateway, pki, otlp):
    async with gateway_stub(gateway.port, pki.root) as stub:
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


async def test_turns_succeed_when_the_collector_is_down(tmp_path, pki, inference_service, database_url, retrieval):
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    gateway = _gateway_process(tmp_path, pki, inference_service, database_url, retrieval.port, {
        "OTEL_EXPORTER_OTLP_ENDPOINT": nobody, "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "100",
    })
    try:
        port = gateway.wait_serving()
        async with gateway_stub(port, pki.root) as stub:
            for _ in range(3):  # spans pile up for a dead collector; turns must not notice
                events = [e async for e in stub.Chat(pb.ChatRequest(
                    message="Say something.",
                    # ignore_eos: the smoke model may sample its end token early, and this test counts tokens.
                    generation=inference_pb2.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)), timeout=30)]
                final = events[-1].final
                assert final.usage.completion_tokens == 3 and len(final.trace_id) == 32
                assert final.timings.total_ms < 5000, final.timings
        stopping = time.monotonic()
        assert gateway.stop(timeout=30) == 0
        # Shutdown flushes spans, but a dead collector must not hold it up past
        # our export timeout (2 s; OpenTelemetry's own 10 s made it ~10-15 s).
        took = time.monotonic() - stopping
        assert took < 6, f"the gateway's shutdown waited {took:.1f} s on the dead collector"
    finally:
        gateway.stop(timeout=5)


async def test_every_service_serves_prometheus_metrics(gateway, retrieval, inference_service, pki):
    async with gateway_stub(gateway.port, pki.root) as stub:
        events = [e async for e in stub.Chat(pb.ChatRequest(
            message="What is a tuple?", retrieval=pb.RetrievalOptions(collection="kb", top_k=1),
            generation=inference_pb2.SamplingParams(max_tokens=3)), timeout=60)]
        assert events[-1].HasField("final")
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in stub.Chat(pb.ChatRequest(message=" "), timeout=10):
                pass

    gw = await scrape(gateway.metrics_port)
    assert total(gw, "agw_chat_first_token_milliseconds_count") >= 1
    assert total(gw, "agw_chat_stage_duration_milliseconds_count", 'stage="retrieval"') >= 1
    assert total(gw, "agw_rpc_errors_total", 'rpc_grpc_status_code="INVALID_ARGUMENT"') >= 1
    assert total(gw, "rpc_server_duration_milliseconds_count", "Chat") >= 2
    assert total(gw, "agw_db_pool_connections", 'state="open"') >= 1
    assert any(k.startswith("agw_channel_in_flight{") for k in gw)
    assert "agw_admission_in_flight" in {k.split("{")[0] for k in gw}

    found = await scrape(retrieval.metrics_port)
    assert total(found, "agw_retrieval_search_duration_milliseconds_count") >= 1

    engine = await scrape(inference_service.metrics_port)
    for state in ("running", "waiting"):
        assert any(k.startswith("agw_engine_requests{") and f'state="{state}"' in k for k in engine), state
    assert any(k.startswith("agw_engine_kv_cache_usage") for k in engine)
    # Every service says how long its event loop waited for a CPU (a counter,
    # so a starved host shows as a rising line, not as a mystery in a trace).
    for samples in (gw, found, engine):
        waits = [v for k, v in samples.items() if k.startswith("agw_process_runqueue_wait_seconds_total{")]
        assert len(waits) == 1 and waits[0] >= 0, samples.keys()
    assert total(engine, "rpc_server_duration_milliseconds_count", "Generate") >= 1
