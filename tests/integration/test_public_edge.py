"""The public edge, hardened: a bound on every input, clear statuses, nothing internal leaked.

The gateway runs in-process with small limits (so over-limit requests stay
small) in front of the real retrieval service and the scripted inference
service, on the real Postgres.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc
import pytest
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from agent.retrieval.v1 import retrieval_pb2
from gateway.settings import GatewaySettings
from servicekit.settings import SettingsError, load_settings
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.grpc_client import mtls_channel
from tests.support.retrieval_service import retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.integration

LIMITS = dict(
    max_message_chars=50, max_system_prompt_chars=40, max_key_chars=16, max_chat_messages=2, max_token_ids=4,
    max_stop_strings=2, max_stop_chars=8, max_filter_conditions=2, max_payload_fields=2, max_vector_dims=8,
    max_ingest_documents=2, max_document_chars=60, max_document_payload_bytes=64, max_metadata_entries=2,
    max_metadata_bytes=64, max_receive_bytes=64 * 1024, max_hnsw_ef=64,
)


class SearchRecorder(grpc.aio.ServerInterceptor):
    """The Search requests the retrieval service received (what the gateway forwarded)."""

    def __init__(self) -> None:
        self.searches: list[retrieval_pb2.SearchRequest] = []

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.endswith("/Search"):
            return handler
        behavior = handler.unary_unary

        async def recording(request, context):
            self.searches.append(request)
            return await behavior(request, context)

        return handler._replace(unary_unary=recording)


@pytest.fixture(scope="module")
async def edge(tmp_path_factory, pki, database_url):
    recorder = SearchRecorder()
    # These tests assert what a turn does with retrieval's answer (a NOT_FOUND fails it), not how fast the
    # answer comes: past the default budget (0.5 s) a turn degrades instead, and on a loaded CI host a NOT_FOUND
    # once took longer than that. The timeout's own rule is tested apart, with a budget of 1 ms.
    async with retrieval_server(tmp_path_factory.mktemp("edge-retrieval"), pki.root, interceptors=[recorder]) \
            as (retrieval, _), scripted_app(pki.root) as (inference, scripted), \
            gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url,
                           retrieval_budget_s=5.0, **LIMITS) as (gateway, app):
        async with gateway_stub(gateway.port, pki.root) as stub:
            await stub.IngestDocuments(pb.IngestDocumentsRequest(collection="docs", documents=[
                _document(id="for", text="The for statement iterates over a sequence."),
                _document(id="with", text="The with statement manages a context.")]), timeout=60)
            yield stub, gateway, app, scripted.servicer, recorder


def _filter(n: int) -> retrieval_pb2.Filter:
    return retrieval_pb2.Filter(must=[retrieval_pb2.FieldCondition(key="topic", keyword="x") for _ in range(n)])


def _payload(size: int) -> struct_pb2.Struct:
    payload = struct_pb2.Struct()
    payload.update({"blob": "x" * size})
    return payload


def _generate(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(request=inference_pb2.GenerateRequest(**fields))


def _document(**fields) -> retrieval_pb2.Document:
    return retrieval_pb2.Document(**{"id": "d", "text": "a short text", **fields})


SESSION = "00000000-0000-4000-8000-000000000000"
#: (method, request, field the status names, the setting it names): one row per bounded field of every public RPC.
#: The limits are small (LIMITS) except the session id's, which is fixed: a UUID.
OVER_LIMIT = [
    ("Chat", pb.ChatRequest(message="m" * 51), "message", "AGW_GATEWAY_MAX_MESSAGE_CHARS"),
    ("Chat", pb.ChatRequest(message="hi", system_prompt="s" * 41), "system_prompt",
     "AGW_GATEWAY_MAX_SYSTEM_PROMPT_CHARS"),
    ("Chat", pb.ChatRequest(message="hi", session_id="s" * 65), "session_id", "a session id is the UUID"),
    ("Chat", pb.ChatRequest(message="hi", session_id=SESSION, idempotency_key="k" * 17), "idempotency_key",
     "AGW_GATEWAY_MAX_KEY_CHARS"),
    ("Chat", pb.ChatRequest(message="hi", retrieval=pb.RetrievalOptions(collection="c" * 17)),
     "retrieval.collection", "AGW_GATEWAY_MAX_KEY_CHARS"),
    ("Chat", pb.ChatRequest(message="hi", retrieval=pb.RetrievalOptions(collection="docs", filter=_filter(3))),
     "retrieval.filter", "AGW_GATEWAY_MAX_FILTER_CONDITIONS"),
    ("Chat", pb.ChatRequest(message="hi", retrieval=pb.RetrievalOptions(collection="docs", filter=retrieval_pb2.Filter(
        must_not=[retrieval_pb2.FieldCondition(key="k" * 17, keyword="x")]))),
     "retrieval.filter.must_not[0].key", "AGW_GATEWAY_MAX_KEY_CHARS"),
    ("Chat", pb.ChatRequest(message="hi", retrieval=pb.RetrievalOptions(collection="docs", filter=retrieval_pb2.Filter(
        must=[retrieval_pb2.FieldCondition(key="topic", keyword="v" * 17)]))),
     "retrieval.filter.must[0].keyword", "AGW_GATEWAY_MAX_KEY_CHARS"),
    ("Chat", pb.ChatRequest(message="hi", retrieval=pb.RetrievalOptions(collection="docs", payload_fields=["a"] * 3)),
     "retrieval.payload_fields", "AGW_GATEWAY_MAX_PAYLOAD_FIELDS"),
    ("Chat", pb.ChatRequest(message="hi", retrieval=pb.RetrievalOptions(collection="docs", payload_fields=["f" * 17])),
     "retrieval.payload_fields[0]", "AGW_GATEWAY_MAX_KEY_CHARS"),
    ("Chat", pb.ChatRequest(message="hi", retrieval=pb.RetrievalOptions(collection="docs",
                                                                     payload_fields=["text", "f" * 17])),
     "retrieval.payload_fields[1]", "AGW_GATEWAY_MAX_KEY_CHARS"),
    ("Chat", pb.ChatRequest(message="hi", generation=inference_pb2.SamplingParams(stop=["a", "b", "c"])),
     "generation.stop", "AGW_GATEWAY_MAX_STOP_STRINGS"),
    ("Chat", pb.ChatRequest(message="hi", generation=inference_pb2.SamplingParams(stop=["s" * 9])),
     "generation.stop[0]", "AGW_GATEWAY_MAX_STOP_CHARS"),
    ("Generate", _generate(prompt="p" * 51), "request.prompt", "AGW_GATEWAY_MAX_MESSAGE_CHARS"),
    ("Generate", _generate(chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(content="x")] * 3)),
     "request.chat.messages", "AGW_GATEWAY_MAX_CHAT_MESSAGES"),
    ("Generate", _generate(chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(content="c" * 51)])),
     "request.chat.messages[0].content", "AGW_GATEWAY_MAX_MESSAGE_CHARS"),
    ("Generate", _generate(token_ids=inference_pb2.TokenIds(ids=[1] * 5)), "request.token_ids.ids",
     "AGW_GATEWAY_MAX_TOKEN_IDS"),
    ("Generate", _generate(prompt="hi", request_id="r" * 17), "request.request_id", "AGW_GATEWAY_MAX_KEY_CHARS"),
    ("Generate", _generate(prompt="hi", cache_salt="c" * 17), "request.cache_salt", "AGW_GATEWAY_MAX_KEY_CHARS"),
    ("Generate", _generate(prompt="hi", sampling=inference_pb2.SamplingParams(stop=["a", "b", "c"])),
     "request.sampling.stop", "AGW_GATEWAY_MAX_STOP_STRINGS"),
    ("Generate", _generate(prompt="hi", sampling=inference_pb2.SamplingParams(stop=["s" * 9])),
     "request.sampling.stop[0]", "AGW_GATEWAY_MAX_STOP_CHARS"),
    ("Retrieve", pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(collection="docs", text="t" * 51)),
     "request.text", "AGW_GATEWAY_MAX_MESSAGE_CHARS"),
    ("Retrieve", pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(collection="c" * 17, text="t")),
     "request.collection", "AGW_GATEWAY_MAX_KEY_CHARS"),
    ("Retrieve", pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(
        collection="docs", vector=retrieval_pb2.Vector(values=[0.1] * 9))), "request.vector.values",
     "AGW_GATEWAY_MAX_VECTOR_DIMS"),
    ("Retrieve", pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(collection="docs", text="t", filter=_filter(3))),
     "request.filter", "AGW_GATEWAY_MAX_FILTER_CONDITIONS"),
    ("Retrieve", pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(collection="docs", text="t",
                                                                        payload_fields=["a"] * 3)),
     "request.payload_fields", "AGW_GATEWAY_MAX_PAYLOAD_FIELDS"),
    ("Retrieve", pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(collection="docs", text="t",
                                                                        payload_fields=["a", "f" * 17])),
     "request.payload_fields[1]", "AGW_GATEWAY_MAX_KEY_CHARS"),
    ("IngestDocuments", pb.IngestDocumentsRequest(collection="docs", documents=[_document()] * 3), "documents",
     "AGW_GATEWAY_MAX_INGEST_DOCUMENTS"),
    ("IngestDocuments", pb.IngestDocumentsRequest(collection="docs", documents=[_document(text="t" * 61)]),
     "documents[0].text", "AGW_GATEWAY_MAX_DOCUMENT_CHARS"),
    ("IngestDocuments", pb.IngestDocumentsRequest(collection="docs", documents=[_document(id="i" * 17)]),
     "documents[0].id", "AGW_GATEWAY_MAX_KEY_CHARS"),
    ("IngestDocuments", pb.IngestDocumentsRequest(collection="docs", documents=[_document(payload=_payload(80))]),
     "documents[0].payload", "AGW_GATEWAY_MAX_DOCUMENT_PAYLOAD_BYTES"),
    ("IngestDocuments", pb.IngestDocumentsRequest(collection="docs", documents=[
        _document(vector=retrieval_pb2.Vector(values=[0.1] * 9))]), "documents[0].vector.values",
     "AGW_GATEWAY_MAX_VECTOR_DIMS"),
    ("IngestDocuments", pb.IngestDocumentsRequest(collection="c" * 17, documents=[_document()]), "collection",
     "AGW_GATEWAY_MAX_KEY_CHARS"),
    ("IngestDocuments", pb.IngestDocumentsRequest(collection="docs", documents=[_document()],
                                                  default_payload_fields=["a"] * 3), "default_payload_fields",
     "AGW_GATEWAY_MAX_PAYLOAD_FIELDS"),
    ("CreateSession", pb.CreateSessionRequest(metadata={"a": "1", "b": "2", "c": "3"}), "metadata",
     "AGW_GATEWAY_MAX_METADATA_ENTRIES"),
    ("CreateSession", pb.CreateSessionRequest(metadata={"a": "v" * 70}), "metadata", "AGW_GATEWAY_MAX_METADATA_BYTES"),
    ("CreateSession", pb.CreateSessionRequest(metadata={"k" * 17: "v"}), "metadata['kkkkkkkkkkkkkkkkk']",
     "AGW_GATEWAY_MAX_KEY_CHARS"),
    ("GetSession", pb.GetSessionRequest(session_id="s" * 65), "session_id", "a session id is the UUID"),
    ("DeleteSession", pb.DeleteSessionRequest(session_id="s" * 65), "session_id", "a session id is the UUID"),
    ("ListMessages", pb.ListMessagesRequest(session_id="s" * 65), "session_id", "a session id is the UUID"),
    ("ListMessages", pb.ListMessagesRequest(session_id=SESSION, page_token="t" * 17), "page_token",
     "AGW_GATEWAY_MAX_KEY_CHARS"),
]


async def _call(stub, method: str, request):
    call = getattr(stub, method)(request, timeout=10)
    if method in ("Chat", "Generate"):
        return [message async for message in call]
    return await call


async def _healthy_turn(stub) -> None:
    events = [e async for e in stub.Chat(pb.ChatRequest(message="tokens=2 still there?"), timeout=10)]
    assert events[-1].HasField("final")


async def _serving(port: int, pki) -> bool:
    async with mtls_channel(port, pki.root, identity="tenant/dev") as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return response.status == health_pb2.HealthCheckResponse.SERVING


async def test_every_bounded_field_is_refused_naming_itself_and_its_setting(edge, pki):
    stub, gateway, _, scripted, _ = edge
    before = scripted.generations
    for method, request, field, setting in OVER_LIMIT:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _call(stub, method, request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, field, caught.value)
        details = caught.value.details()
        assert details.startswith(f"{field}: is "), (method, field, details)
        assert "the limit is" in details and setting in details, (method, field, details)
    assert scripted.generations == before  # nothing reached the engine
    assert await _serving(gateway.port, pki)
    await _healthy_turn(stub)


@pytest.mark.parametrize(("method", "request_", "field"), [
    ("CreateSession", pb.CreateSessionRequest(metadata={"a": "x\x00y"}), "metadata['a']"),
    ("Chat", pb.ChatRequest(message="tokens=2 \x00"), "message"),
    ("Chat", pb.ChatRequest(message="tokens=2", idempotency_key="k\x00"), "idempotency_key"),
    ("Chat", pb.ChatRequest(tool_results=[pb.ToolResult(tool_call_id="c1", content="\x00")]),
     "tool_results[0].content"),
], ids=["metadata", "message", "idempotency_key", "tool_result"])
async def test_a_nul_character_in_text_that_is_stored_is_refused_naming_the_field(edge, method, request_, field):
    """Found by the fuzzer (tests/e2e/test_fuzz_public_api.py): Postgres text cannot hold U+0000."""
    stub = edge[0]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _call(stub, method, request_)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}: contains a NUL character"), caught.value.details()


async def test_undecodable_bytes_and_invalid_utf8_get_invalid_argument(edge, pki):
    stub, gateway, _, _, _ = edge
    raw = {"unary_unary": "/agent.gateway.v1.AgentGateway/CreateSession",
           "unary_stream": "/agent.gateway.v1.AgentGateway/Chat"}
    async with mtls_channel(gateway.port, pki.root, identity="tenant/dev") as channel:
        create = channel.unary_unary(raw["unary_unary"], request_serializer=bytes, response_deserializer=bytes)
        chat = channel.unary_stream(raw["unary_stream"], request_serializer=bytes, response_deserializer=bytes)
        cases = [
            (create, b"\xff\xff\xff\xff"),      # not a protobuf message at all
            (chat, b"\x12\x02\xff\xfe"),          # ChatRequest.message (field 2) holding invalid UTF-8
            (chat, b"\x12\x10only-six"),            # a length past the end of the message
        ]
        for method, payload in cases:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                result = method(payload, timeout=5)
                if hasattr(result, "__aiter__"):
                    [m async for m in result]
                else:
                    await result
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (payload, caught.value)
            assert caught.value.details().startswith("request: cannot be decoded"), caught.value.details()
        # Past the public port's receive limit: refused before decoding, by gRPC itself.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await create(b"\x0a" + b"x" * (70 * 1024), timeout=5)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await _serving(gateway.port, pki)
    await _healthy_turn(stub)


async def test_a_collection_the_tenant_lacks_fails_the_turn_before_any_token(edge, pki):
    # (The session id, 36 characters, passes although LIMITS' max_key_chars is 16: session ids have their own bound.)
    stub, gateway, _, scripted, _ = edge
    session = (await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)).session.id
    before = scripted.generations
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _call(stub, "Chat", pb.ChatRequest(session_id=session, message="tokens=2 hi",
                                                 retrieval=pb.RetrievalOptions(collection="nothere")))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details() == "retrieval.collection: the tenant has no collection 'nothere'; ingest into it first"
    assert scripted.generations == before  # no token generated
    assert not (await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=10)).messages
    async with gateway_stub(gateway.port, pki.root, identity="operator/admin") as operator:
        for _ in range(20):  # the early inference call is closed as the turn ends
            stats = await operator.GetStats(pb.GetStatsRequest(), timeout=5)
            pool = next(b for b in stats.backends if b.name == "inference")
            if not any(c.in_flight for c in pool.channels):
                break
            await asyncio.sleep(0.05)
        assert not any(c.in_flight for c in pool.channels)


async def test_a_backend_failure_reaches_the_client_without_addresses_but_with_an_error_id(edge, caplog):
    stub, gateway, app, _, _ = edge
    caplog.set_level(logging.WARNING, logger="servicekit.interceptors")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _call(stub, "Generate", _generate(prompt="crash"))
    details = caught.value.details()
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    error_id = dict(caught.value.trailing_metadata())["x-error-id"]
    assert details == f"the inference service failed this call (INTERNAL); retry shortly (error id {error_id})"
    target = app.settings.inference_target
    assert target.split(":")[0] not in details and target.split(":")[1] not in details
    # The operators' side: the address and the backend's text, under the same id.
    logged = [r.getMessage() for r in caplog.records if error_id in r.getMessage()]
    assert logged and target in logged[0] and "scripted crash" not in details


async def test_only_an_outage_or_a_timeout_degrades_and_the_reason_says_what_was_missing(tmp_path, pki, database_url):
    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _), \
            scripted_app(pki.root) as (inference, _), \
            gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url,
                           retrieval_budget_s=0.001) as (gateway, _):
        async with gateway_stub(gateway.port, pki.root) as stub:
            await stub.IngestDocuments(pb.IngestDocumentsRequest(collection="docs", documents=[_document()]),
                                       timeout=60)
            events = await _call(stub, "Chat", pb.ChatRequest(message="tokens=2 hi",
                                                              retrieval=pb.RetrievalOptions(collection="docs")))
    final = events[-1].final
    assert final.degraded and final.degraded_reason == "no context: retrieval timed out"


async def test_a_tenants_search_stays_on_the_index(edge):
    stub, _, _, _, recorder = edge
    await stub.Retrieve(pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(
        collection="docs", text="statement", top_k=1, exact=True, hnsw_ef=100_000)), timeout=30)
    forwarded = recorder.searches[-1]
    assert not forwarded.exact and forwarded.hnsw_ef == LIMITS["max_hnsw_ef"]
    await stub.Retrieve(pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(
        collection="docs", text="statement", top_k=1, hnsw_ef=32)), timeout=30)
    assert recorder.searches[-1].hnsw_ef == 32  # within the cap: as asked


async def test_a_tenant_past_its_session_and_collection_limits_is_refused(tmp_path, database_url):
    from tests.support.pki import make_test_pki

    tenant = f"t{uuid.uuid4().hex[:12]}"  # its own tenant: the shared database holds other tests' sessions
    pki = make_test_pki(tmp_path / "tls", tenants=(tenant, "other"))
    async with retrieval_server(tmp_path / "retrieval", pki.root, max_collections_per_tenant=1) as (retrieval, _), \
            scripted_app(pki.root) as (inference, _), \
            gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url,
                           max_sessions_per_tenant=2) as (gateway, _):
        async with gateway_stub(gateway.port, pki.root, identity=f"tenant/{tenant}") as stub:
            for _ in range(2):
                await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "AGW_GATEWAY_MAX_SESSIONS_PER_TENANT" in caught.value.details()
            await stub.IngestDocuments(pb.IngestDocumentsRequest(collection="one", documents=[_document()]), timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.IngestDocuments(pb.IngestDocumentsRequest(collection="two", documents=[_document()]),
                                           timeout=60)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "AGW_RETRIEVAL_MAX_COLLECTIONS_PER_TENANT" in caught.value.details()
        async with gateway_stub(gateway.port, pki.root, identity="tenant/other") as other:  # others unaffected
            await other.IngestDocuments(pb.IngestDocumentsRequest(collection="two", documents=[_document()]),
                                        timeout=60)


async def test_one_connection_holds_at_most_its_bound_of_streams(tmp_path, pki, database_url):
    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _), \
            scripted_app(pki.root) as (inference, scripted), \
            gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url,
                           max_concurrent_streams=2, max_in_flight=50, max_in_flight_per_tenant=50) as (gateway, app):
        async with gateway_stub(gateway.port, pki.root) as stub:  # one channel: one connection
            seen = []

            async def watch():
                while True:
                    seen.append(app.admission.in_flight)
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            slow = pb.ChatRequest(message="tokens=4 delay=0.1 hold", generation=inference_pb2.SamplingParams(max_tokens=4))
            results = await asyncio.gather(*(_call(stub, "Chat", slow) for _ in range(6)), return_exceptions=True)
            watcher.cancel()
    done = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert max(seen) == 2, max(seen)  # the server never held more than the bound for one connection
    # The others waited in the client's queue. One opened while the server still counted a stream the client saw
    # end is refused (REFUSED_STREAM, UNAVAILABLE): how many depends on timing (0-2 of 6 in quiet runs, with or
    # without generic-handler registration alike; 3 in one loaded CI run), but a refused call never ran.
    assert done and all(events[-1].HasField("final") for events in done)
    assert all(isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE for e in refused)
    assert scripted.servicer.generations == len(done), (scripted.servicer.generations, len(done), refused)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.7", "::"])
def test_insecure_dev_is_refused_beyond_loopback(host):
    with pytest.raises(SettingsError, match="AGW_INSECURE_DEV serves plaintext"):
        load_settings(GatewaySettings, insecure_dev=True, host=host)
    assert load_settings(GatewaySettings, insecure_dev=True, host="127.0.0.1").insecure_dev


async def test_the_public_port_holds_its_client_connections_to_its_bound(tmp_path, pki, database_url):
    """AGW_GATEWAY_MAX_CONNECTIONS: past it gRPC closes a new connection as it arrives, so a flood of connections
    (each a descriptor and buffers, before any call) costs the gateway bounded memory. Closed ones free their
    places."""
    from tests.support.raw_tls import connect, is_open, served_serial

    files = pki.identity("tenant/dev")
    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _), \
            scripted_app(pki.root) as (inference, _), \
            gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url,
                           max_connections=2) as (gateway, _):
        held = [await asyncio.to_thread(connect, gateway.port, files) for _ in range(2)]
        assert [await asyncio.to_thread(is_open, sock) for sock in held] == [True, True]
        assert not await asyncio.to_thread(lambda: is_open(connect(gateway.port, files))), "a third was held"
        for sock in held:
            sock.close()
        for _ in range(100):  # the places free up as gRPC sees the closes
            if await asyncio.to_thread(served_serial, gateway.port, files) is not None:
                break
            await asyncio.sleep(0.05)
        async with gateway_stub(gateway.port, pki.root) as stub:  # and calls go through again
            await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)
        # GetStats reports the bound, and the doctor reads it with the other public limits.
        async with gateway_stub(gateway.port, pki.root, identity="operator/admin") as operator:
            limits = (await operator.GetStats(pb.GetStatsRequest(), timeout=10)).limits
    assert limits.max_connections == 2
    from agentgw.checks import Status
    from agentgw.doctor import public_limits_check

    check = public_limits_check(limits)
    assert check.status is Status.PASS and check.measured.startswith("2 connections, "), check
    unbounded = pb.PublicLimits()
    unbounded.CopyFrom(limits)
    unbounded.max_connections = 0  # a gateway from before the bound
    check = public_limits_check(unbounded)
    assert check.status is Status.WARN and "AGW_GATEWAY_MAX_CONNECTIONS" in check.fix, check


async def test_a_client_that_never_finishes_its_handshake_is_closed(tmp_path, pki, database_url):
    """AGW_GATEWAY_HANDSHAKE_TIMEOUT_S: a connection that sends nothing is dropped then, not after gRPC's 120 s,
    so silent clients cannot hold the connection bound's places."""
    import socket
    import time

    def silent_connection_lifetime(port: int) -> float:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            started = time.monotonic()
            try:
                sock.recv(1)  # nothing comes: the server closes (EOF) or resets
            except ConnectionError:
                pass
            return time.monotonic() - started

    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _), \
            scripted_app(pki.root) as (inference, _), \
            gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url,
                           handshake_timeout_s=1.0) as (gateway, _):
        lifetime = await asyncio.to_thread(silent_connection_lifetime, gateway.port)
    assert 0.5 < lifetime < 5, lifetime  # a socket timeout (10 s) would mean the server kept it
