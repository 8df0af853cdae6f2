"""The rules of a failed replica, with scripted replicas (faults on demand): a call that fails UNAVAILABLE
before its first message is retried once on the next-ranked replica (an OpenGenerate retry resends its
prefix); after the first message there is no retry, the stream ends UNAVAILABLE and nothing is stored.
A Generate carrying the client's ``x-agw-affinity`` key is routed as that session's turns are.

The same paths with real vLLM replicas (routing, spill, a killed replica): tests/e2e/test_replicas.py.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from gateway.routing import prefix_key, rank, session_key
from servicekit.tenancy import cache_salt_for
from retrieval.ingest import sample_corpus
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.retrieval_service import passage_documents, retrieval_server
from tests.support.servers import scripted_app

TENANT = "dev"


async def _stack(stack: AsyncExitStack, tmp_path, pki, database_url, *replica_options):
    """Scripted replicas (one per options dict), retrieval, a gateway routing across them, and a tenant stub."""
    replicas = [await stack.enter_async_context(scripted_app(pki.root, **options)) for options in replica_options]
    retrieval, _ = await stack.enter_async_context(retrieval_server(tmp_path / "retrieval", pki.root))
    gateway, app = await stack.enter_async_context(gateway_server(
        pki.root, [running.port for running, _ in replicas], retrieval.port, database_url=database_url))
    stub = await stack.enter_async_context(gateway_stub(gateway.port, pki.root))
    return [app_.servicer for _, app_ in replicas], [f"127.0.0.1:{running.port}" for running, _ in replicas], stub, app


async def _session_ranked_first_on(stub, addresses: list[str], index: int) -> str:
    """A new session whose routing key ranks replica ``index`` first."""
    salt = cache_salt_for("tenant", TENANT)
    for _ in range(64):
        session = (await stub.CreateSession(pb.CreateSessionRequest(), timeout=5)).session.id
        if rank(session_key(salt, session), addresses)[0] == index:
            return session
    raise AssertionError("no session ranked the replica first in 64 tries")


def _routed(app, address: str) -> pb.ReplicaStats:
    replica = app.servicer.backends.inference.replicas[address]
    from gateway.service import _replica_stats

    return _replica_stats(replica)


async def test_a_turn_refused_before_its_first_token_is_retried_once_on_the_next_replica_with_its_prefix(
        tmp_path, pki, database_url):
    async with AsyncExitStack() as stack:
        (failing, serving), addresses, stub, app = await _stack(
            stack, tmp_path, pki, database_url, {"fail_generate": True}, {})
        session = await _session_ranked_first_on(stub, addresses, 0)
        await stub.IngestDocuments(pb.IngestDocumentsRequest(
            collection="docs", documents=passage_documents(sample_corpus(max_per_topic=1)[:4])), timeout=60)
        search = pb.RetrievalOptions(collection="docs", top_k=1)  # a turn that searches opens its call early
        # A first turn (it too is retried), so the second has history: its early call sends a prefix.
        for message in ("tokens=2", "tokens=3"):
            events = [e async for e in stub.Chat(pb.ChatRequest(session_id=session, message=message,
                                                                retrieval=search), timeout=10)]
            assert events[-1].HasField("final"), events
        assert failing.calls.get("OpenGenerate") == 2 and failing.generations == 2  # tried first, each time
        assert serving.calls.get("OpenGenerate") == 2 and serving.generations == 2
        # The retry opened a new early call and sent the prefix again: system prompt and the first turn.
        resent = serving.prefixes[-1]
        assert resent is not None and resent == failing.prefixes[-1]  # the same prefix, sent again
        assert serving.prefill_salts[-1] == failing.prefill_salts[-1]  # asking for a prefill, or not, alike
        assert [m.role for m in resent.messages] == [inference_pb2.ROLE_SYSTEM, inference_pb2.ROLE_USER,
                                                     inference_pb2.ROLE_ASSISTANT]
        assert resent.messages[1].content == "tokens=2"
        assert _routed(app, addresses[0]).routed_affinity == 2
        assert _routed(app, addresses[1]).routed_retry == 2
        # A turn without a search is one Generate call, retried the same way.
        events = [e async for e in stub.Chat(pb.ChatRequest(session_id=session, message="tokens=1"), timeout=10)]
        assert events[-1].HasField("final"), events
        assert (failing.generations, serving.generations) == (3, 3)
        assert (failing.calls.get("OpenGenerate"), serving.calls.get("OpenGenerate")) == (2, 2)
        stored = await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=5)
        assert [m.role for m in stored.messages].count(inference_pb2.ROLE_ASSISTANT) == 3


async def test_generate_refused_before_its_first_message_is_retried_on_the_next_replica(tmp_path, pki,
                                                                                        database_url):
    async with AsyncExitStack() as stack:
        (failing, serving), addresses, stub, app = await _stack(
            stack, tmp_path, pki, database_url, {"fail_generate": True}, {})
        salt = cache_salt_for("tenant", TENANT)
        prompt = next(p for p in (f"tokens=3 n={i}" for i in range(64))
                      if rank(prefix_key(salt, [p], 2048), addresses)[0] == 0)
        responses = [r async for r in stub.Generate(pb.GenerateRequest(
            request=inference_pb2.GenerateRequest(prompt=prompt)), timeout=10)]
        assert [r.response.text for r in responses[:-1]] == ["t0 ", "t1 ", "t2 "]
        assert (failing.generations, serving.generations) == (1, 1)
        assert _routed(app, addresses[1]).routed_retry == 1


async def test_a_second_failure_is_not_retried_again(tmp_path, pki, database_url):
    async with AsyncExitStack() as stack:
        (first, second), _addresses, stub, _app = await _stack(
            stack, tmp_path, pki, database_url, {"fail_generate": True}, {"fail_generate": True})
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [e async for e in stub.Chat(pb.ChatRequest(message="tokens=2"), timeout=10)]
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the inference service failed this call (UNAVAILABLE); retry shortly" in caught.value.details()
        assert first.generations + second.generations == 2  # the call and one retry, no more


async def test_after_the_first_token_there_is_no_retry_and_nothing_is_stored(tmp_path, pki, database_url):
    async with AsyncExitStack() as stack:
        (one, two), _addresses, stub, _app = await _stack(stack, tmp_path, pki, database_url, {}, {})
        session = (await stub.CreateSession(pb.CreateSessionRequest(), timeout=5)).session.id
        events = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for event in stub.Chat(pb.ChatRequest(session_id=session, message="tokens=4 drop=2"), timeout=10):
                events.append(event)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the inference service failed this call (UNAVAILABLE); retry shortly" in caught.value.details()
        assert [e.delta.text for e in events if e.HasField("delta")]  # tokens reached the client first
        assert one.generations + two.generations == 1  # not sent again
        stored = await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=5)
        assert list(stored.messages) == []  # stored whole or not at all


async def test_a_generate_with_an_affinity_key_goes_where_that_sessions_turns_go(tmp_path, pki, database_url):
    """x-agw-affinity (servicekit.public_api.AFFINITY_HEADER) names a session: the Generate is routed by that
    session's key, not by its prompt, so it meets the session's cached prefix; an oversized key is refused."""
    async with AsyncExitStack() as stack:
        replicas, addresses, stub, app = await _stack(stack, tmp_path, pki, database_url, {}, {})
        salt = cache_salt_for("tenant", TENANT)
        session = await _session_ranked_first_on(stub, addresses, 1)
        prompt = next(p for p in (f"tokens=2 n={i}" for i in range(64))
                      if rank(prefix_key(salt, [p], 2048), addresses)[0] == 0)  # alone, it would go to replica 0
        request = pb.GenerateRequest(request=inference_pb2.GenerateRequest(prompt=prompt))
        [_ async for _ in stub.Generate(request, metadata=(("x-agw-affinity", session),), timeout=10)]
        events = [e async for e in stub.Chat(pb.ChatRequest(session_id=session, message="tokens=2"), timeout=10)]
        assert events[-1].HasField("final")
        [_ async for _ in stub.Generate(request, timeout=10)]  # no key: the prompt's replica
        assert [r.generations for r in replicas] == [1, 2]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [_ async for _ in stub.Generate(request, metadata=(("x-agw-affinity", "s" * 129),), timeout=10)]
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == ("x-agw-affinity header: is 129 characters; the limit is 128 "
                                          "(AGW_GATEWAY_MAX_KEY_CHARS)")
