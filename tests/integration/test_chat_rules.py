"""The Chat turn's rules, without an engine: the scripted inference service records the prompts the gateway lays out.

Fast (seconds): the early call with the history sent ahead in turns that
search, one Generate call in turns that do not, the history window
moving in steps, persist-before-final, the fallback to Generate for an
inference service without OpenGenerate, and a history past its budget failing
the turn. Degrading and idempotency are in
test_public_edge.py and test_idempotency.py; the same paths on real vLLM in
tests/e2e/test_chat.py.
"""

from __future__ import annotations

import logging

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from retrieval.ingest import sample_corpus
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.retrieval_service import passage_documents, retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.integration


#: A search in each turn: the stage the early inference call opens behind.
SEARCH = pb.RetrievalOptions(collection="docs", top_k=1)


async def _turn(stub, **fields) -> list[pb.ChatResponse]:
    return [event async for event in stub.Chat(pb.ChatRequest(**fields), timeout=20)]


async def _ingest_docs(stub) -> None:
    await stub.IngestDocuments(pb.IngestDocumentsRequest(
        collection="docs", documents=passage_documents(sample_corpus(max_per_topic=1)[:4])), timeout=60)


@pytest.fixture(scope="module")
async def rules(tmp_path_factory, pki, database_url):
    async with retrieval_server(tmp_path_factory.mktemp("rules-retrieval"), pki.root) as (retrieval, _), \
            scripted_app(pki.root) as (inference, scripted), \
            gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url,
                           history_messages=4, history_window_step=4, prefill_min_tokens=20) as (gateway, _):
        async with gateway_stub(gateway.port, pki.root) as stub, \
                gateway_stub(gateway.port, pki.root) as reader:
            await _ingest_docs(stub)
            yield stub, reader, scripted.servicer


async def test_the_early_call_carries_the_history_ahead_of_the_request(rules):
    stub, _, scripted = rules
    session = (await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)).session.id
    await _turn(stub, session_id=session, message="tokens=1 first", retrieval=SEARCH)
    opened = scripted.calls.get("OpenGenerate", 0)
    await _turn(stub, session_id=session, message="tokens=1 second", system_prompt="Be brief.", retrieval=SEARCH)
    assert scripted.calls["OpenGenerate"] == opened + 1  # the turn's call was OpenGenerate, not Generate
    prefix, request = scripted.prefixes[-1], scripted.requests[-1]
    assert [(m.role, m.content) for m in prefix.messages] == [
        (inference_pb2.ROLE_SYSTEM, "Be brief."), (inference_pb2.ROLE_USER, "tokens=1 first"),
        (inference_pb2.ROLE_ASSISTANT, "t0 ")]
    assert list(request.chat.messages)[:3] == list(prefix.messages)  # the request starts with what came ahead
    assert request.chat.messages[-1].content.endswith("\n\nQuestion: tokens=1 second")  # after the passage
    # The first turn's question and answer are a few tokens: below prefill_min_tokens, no prefill is asked.
    assert scripted.prefill_salts[-1] is None


async def test_the_early_call_asks_for_a_prefill_when_enough_of_the_history_is_new_to_the_cache(rules):
    stub, _, scripted = rules
    session = (await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)).session.id
    await _turn(stub, session_id=session, message="tokens=1 " + "a long tool output " * 5,  # about 25 tokens
                retrieval=SEARCH)
    await _turn(stub, session_id=session, message="tokens=1 next", retrieval=SEARCH)
    # Prefilled under the request's own salt (the tenant's), or the engine's cache would keep it apart.
    assert scripted.prefill_salts[-1] == scripted.requests[-1].cache_salt != ""


async def test_a_turn_without_a_search_is_one_generate_call_with_the_whole_prompt(rules):
    # Only a search hides the early call; behind the history read alone it costs more than it saves.
    stub, _, scripted = rules
    session = (await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)).session.id
    await _turn(stub, session_id=session, message="tokens=1 first")
    opened, generated = scripted.calls.get("OpenGenerate", 0), scripted.generations
    events = await _turn(stub, session_id=session, message="tokens=1 second")
    assert (scripted.calls.get("OpenGenerate", 0), scripted.generations) == (opened, generated + 1)
    assert [m.content for m in scripted.requests[-1].chat.messages][1:] == ["tokens=1 first", "t0 ", "tokens=1 second"]
    assert "".join(e.delta.text for e in events if e.HasField("delta")) == "t0 "


async def test_the_history_window_moves_in_steps(rules):
    stub, _, scripted = rules
    session = (await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)).session.id
    carried = []
    for turn in range(6):
        await _turn(stub, session_id=session, message=f"tokens=1 q{turn}")
        history = list(scripted.requests[-1].chat.messages)[1:-1]  # between the system prompt and the question
        carried.append([m.content for m in history if m.role == inference_pb2.ROLE_USER])
    # history_messages=4, step=4: the window starts on ordinals 0, 0, 4, 4, 8 (user messages q0, q0, q2, q2, q4),
    # so the prompt's start stays put for two turns at a time and the engine's prefix cache keeps matching.
    assert carried == [[], ["tokens=1 q0"], ["tokens=1 q0", "tokens=1 q1"], ["tokens=1 q2"],
                       ["tokens=1 q2", "tokens=1 q3"], ["tokens=1 q4"]]


async def test_the_final_event_comes_after_the_turn_is_stored(rules):
    stub, reader, _ = rules
    session = (await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)).session.id
    async for event in stub.Chat(pb.ChatRequest(session_id=session, message="tokens=2 stored?"), timeout=20):
        if event.HasField("final"):
            # Read on another connection the moment the final event arrives: both messages are there already.
            stored = (await reader.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=10)).messages
            assert [(m.role, m.content) for m in stored] == [
                (inference_pb2.ROLE_USER, "tokens=2 stored?"), (inference_pb2.ROLE_ASSISTANT, "t0 t1 ")]
            assert stored[0].trace_id == event.final.trace_id


async def test_turns_fall_back_to_generate_where_the_inference_service_lacks_open_generate(tmp_path, pki,
                                                                                          database_url):
    async with scripted_app(pki.root, open_generate=False) as (inference, scripted), \
            retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _), \
            gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url) as (gateway, app):
        async with gateway_stub(gateway.port, pki.root) as stub:
            await _ingest_docs(stub)
            for _ in range(2):
                events = await _turn(stub, message="Hello?", retrieval=SEARCH)
                assert "".join(e.delta.text for e in events if e.HasField("delta")) == "t0 t1 t2 "
                assert not events[-1].final.degraded
        assert not app.servicer.backends.inference_opens_early  # it stopped trying after the first refusal
        assert scripted.servicer.generations == 2 and "OpenGenerate" not in scripted.servicer.calls


async def test_a_history_past_its_budget_fails_the_turn_before_any_token_and_the_log_names_the_budget(
        tmp_path, pki, database_url, caplog):
    # A budget no Postgres round trip meets: the turn must not run without its session's past.
    caplog.set_level(logging.WARNING, logger="servicekit.interceptors")
    async with scripted_app(pki.root) as (inference, scripted), \
            retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _), \
            gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url,
                           history_budget_s=1e-6) as (gateway, _):
        async with gateway_stub(gateway.port, pki.root) as stub:
            session = (await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)).session.id
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _turn(stub, session_id=session, message="Hello?")
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert caught.value.details().startswith("session history unavailable; the turn was not run, retry shortly")
    assert scripted.servicer.generations == 0
    error_id = dict(caught.value.trailing_metadata())["x-error-id"]
    logged = [r.getMessage() for r in caplog.records if error_id in r.getMessage()]
    assert logged and "history: no answer from Postgres within AGW_GATEWAY_HISTORY_BUDGET_S=1e-06" in logged[0]
