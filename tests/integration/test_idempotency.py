"""One answer per idempotency key: claims in Postgres, waiters replay, a mismatch is refused, a dead claim expires.

The gateway runs in-process against the scripted inference service (its
Generate counts the generations; a message ``tokens=N delay=S`` makes it slow)
and the real retrieval service, with the real Postgres. The same rules on real
vLLM: tests/e2e/test_chat.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from gateway.convert import turn_fingerprint as fingerprint
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.retrieval_service import retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, pki, database_url):
    async with retrieval_server(tmp_path_factory.mktemp("idem-retrieval"), pki.root) as (retrieval, _), \
            scripted_app(pki.root) as (_inference, scripted), \
            gateway_server(pki.root, _inference.port, retrieval.port, database_url=database_url) as (gateway, app):
        async with gateway_stub(gateway.port, pki.root) as stub:
            yield stub, scripted.servicer, app


async def _session(stub) -> str:
    return (await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)).session.id


def _turn(session: str, key: str, message: str = "tokens=4 delay=0.15 the question", **fields) -> pb.ChatRequest:
    return pb.ChatRequest(session_id=session, idempotency_key=key, message=message,
                          generation=inference_pb2.SamplingParams(max_tokens=8), **fields)


async def _run(stub, request, timeout: float = 20) -> tuple[str, pb.TurnSummary | None, grpc.StatusCode | None]:
    text, final = [], None
    try:
        async for event in stub.Chat(request, timeout=timeout):
            if event.HasField("delta"):
                text.append(event.delta.text)
            elif event.HasField("final"):
                final = event.final
    except grpc.aio.AioRpcError as exc:
        return "".join(text), None, exc.code()
    return "".join(text), final, None


async def _messages(stub, session: str) -> list[pb.Message]:
    return list((await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=10)).messages)


async def test_eight_concurrent_turns_with_one_key_generate_once(stack):
    stub, scripted, _ = stack
    session = await _session(stub)
    before = scripted.generations
    results = await asyncio.gather(*(_run(stub, _turn(session, "k-8")) for _ in range(8)))
    assert scripted.generations - before == 1
    messages = await _messages(stub, session)
    assert [m.role for m in messages] == [inference_pb2.ROLE_USER, inference_pb2.ROLE_ASSISTANT]
    stored = messages[1].content
    answered = [(text, final) for text, final, code in results if code is None]
    aborted = [code for _, _, code in results if code is not None]
    assert set(aborted) <= {grpc.StatusCode.ABORTED}
    assert answered and all(text == stored for text, _ in answered)  # every client saw the stored answer
    assert sum(not final.replayed for _, final in answered) == 1  # the one that generated it
    # The same request again, later: replayed, nothing generated or stored twice.
    text, final, code = await _run(stub, _turn(session, "k-8"))
    assert code is None and final.replayed and text == stored
    assert scripted.generations - before == 1 and len(await _messages(stub, session)) == 2


async def test_the_same_key_with_another_request_is_refused(stack):
    stub, _, _ = stack
    session = await _session(stub)
    _, final, code = await _run(stub, _turn(session, "k-pay", "tokens=2 first"))
    assert code is None and not final.replayed
    for changed in (_turn(session, "k-pay", "tokens=2 second"),
                    _turn(session, "k-pay", "tokens=2 first", system_prompt="Be terse."),
                    pb.ChatRequest(session_id=session, idempotency_key="k-pay", message="tokens=2 first",
                                   generation=inference_pb2.SamplingParams(max_tokens=9))):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Chat(changed, timeout=10):
                pass
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "idempotency_key 'k-pay' was used for a different request" in caught.value.details()
    assert len(await _messages(stub, session)) == 2


async def test_a_dead_holder_blocks_the_key_only_until_its_lease_ends(stack, database_url):
    import asyncpg

    stub, scripted, _ = stack
    session = await _session(stub)
    retry = _turn(session, "k-dead", "tokens=2 retry")
    connection = await asyncpg.connect(database_url)
    try:  # what a gateway killed mid-turn leaves behind: a claim nobody will store or release
        await connection.execute(
            "INSERT INTO agw_turn_claims VALUES ($1, 'k-dead', $2, $3, clock_timestamp() + interval '1.5 seconds')",
            uuid.UUID(session), fingerprint(retry), uuid.uuid4())
    finally:
        await connection.close()
    # A caller that cannot wait past the lease is told to retry.
    _, _, code = await _run(stub, retry, timeout=0.8)
    assert code == grpc.StatusCode.ABORTED
    # One that can waits out the lease, takes the key over and generates afresh.
    before, started = scripted.generations, time.monotonic()
    text, final, code = await _run(stub, retry, timeout=10)
    assert code is None and not final.replayed and text
    assert scripted.generations - before == 1
    assert time.monotonic() - started < 5
    assert [m.content for m in await _messages(stub, session)] == ["tokens=2 retry", text]


async def test_a_cancelled_holder_releases_its_key_at_once(stack):
    stub, scripted, _ = stack
    session = await _session(stub)
    call = stub.Chat(_turn(session, "k-cancel", "tokens=50 delay=0.2 long"), timeout=30)
    async for event in call:
        if event.HasField("delta"):
            break  # generating: the key is claimed
    call.cancel()
    await asyncio.sleep(0.3)  # the release runs in the background of the cancelled turn
    before, started = scripted.generations, time.monotonic()
    text, final, code = await _run(stub, _turn(session, "k-cancel", "tokens=50 delay=0.2 long"), timeout=30)
    assert code is None and not final.replayed
    assert scripted.generations - before == 1
    # Had the claim stayed, the retry would have waited for the lease (the cancelled call's whole deadline).
    assert time.monotonic() - started < 15
    assert [m.role for m in await _messages(stub, session)] == [inference_pb2.ROLE_USER, inference_pb2.ROLE_ASSISTANT]  # the cancelled turn stored nothing
