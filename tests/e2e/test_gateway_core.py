"""The gateway's transport core in front of the real retrieval and inference services."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest
from opentelemetry import trace

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from agent.retrieval.v1 import retrieval_pb2
from retrieval.ingest import sample_corpus
from servicekit import wait_ready
from servicekit.tenancy import physical_collection
from servicekit.errors import retry_delay_s
from servicekit.passthrough import raw_multicallable, unwrap
from tests.support.gateway_stack import PeerRecorder, established_peers, gateway_server, gateway_stub
from tests.support.generate_streams import assert_same_deltas
from tests.support.grpc_client import mtls_channel
from tests.support.retrieval_service import passage_documents, retrieval_server

pytestmark = pytest.mark.e2e

M = 2  # channels per backend (the default)


@pytest.fixture(scope="module")
async def retrieval(tmp_path_factory, pki):
    recorder = PeerRecorder()
    async with retrieval_server(tmp_path_factory.mktemp("gw-retrieval"), pki.root, interceptors=[recorder]) as (running, _):
        yield running.port, recorder


@pytest.fixture(scope="module")
async def gateway(retrieval, inference_service, pki, database_url):
    # One tenant drives 64 calls at once here (the transport tests): its share may be the whole process.
    async with gateway_server(pki.root, inference_service.port, retrieval[0], database_url=database_url,
                              max_in_flight_per_tenant=64) as (running, app):
        yield running, app


@pytest.fixture(scope="module")
async def stub(gateway, pki):
    async with gateway_stub(gateway[0].port, pki.root) as stub:
        yield stub


@pytest.fixture(scope="module")
async def operator(gateway, pki):
    """The gateway as an operator sees it (GetStats serves operators only)."""
    async with gateway_stub(gateway[0].port, pki.root, identity="operator/admin") as stub:
        yield stub


@pytest.fixture(scope="module")
async def docs(stub):
    """The dev tenant's collection 'docs', ingested through the gateway."""
    passages = sample_corpus(max_per_topic=2)[:60]
    response = await stub.IngestDocuments(pb.IngestDocumentsRequest(
        collection="docs", documents=passage_documents(passages), default_payload_fields=["topic"]), timeout=120)
    assert response.ingested == 60 and response.created_collection
    return passages


def _retrieve(text="the for statement", top_k=3, collection="docs") -> pb.RetrieveRequest:
    return pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(collection=collection, text=text, top_k=top_k))


def _generate(max_tokens: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request=inference_pb2.GenerateRequest(
        prompt="Tell me about gateways.",
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)))


@pytest.fixture
async def engine(inference_service, pki):
    """A load probe on the inference service, connected before the test acts.

    Connecting afterwards would time a TLS handshake with an engine that is
    still busy (one failed in CI with "Handshake read failed"), not the engine.
    """
    async with mtls_channel(inference_service.port, pki.root, identity="service/gateway") as channel:
        await wait_ready(channel, timeout_s=10, target="inference")
        yield inference_pb2_grpc.InferenceStub(channel)


async def _wait_engine_idle(engine, within_s: float) -> float:
    started = time.monotonic()
    while True:
        load = await engine.GetLoad(inference_pb2.GetLoadRequest(), timeout=2)
        if load.running_requests == 0 and load.waiting_requests == 0:
            return time.monotonic() - started
        assert time.monotonic() - started < within_s, f"engine still busy: {load}"
        await asyncio.sleep(0.02)


async def test_retrieve_passes_through_scoped_to_the_tenant(stub, docs):
    response = (await stub.Retrieve(_retrieve("iterate over a sequence with a for loop"), timeout=10)).response
    assert response.results and set(response.results[0].payload.keys()) == {"topic"}


async def test_thousands_of_calls_use_exactly_m_connections(stub, operator, docs, retrieval, gateway):
    _, recorder = retrieval
    # A vector query: the backend's work is one cheap search, so the calls are
    # about the transport, not the embedder.
    cheap = pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(
        collection="docs", vector=retrieval_pb2.Vector(values=[0.05] * 384), top_k=1))
    for _ in range(1000):
        await stub.Retrieve(cheap, timeout=10)
    limit = asyncio.Semaphore(64)

    async def one():
        async with limit:
            await stub.Retrieve(cheap, timeout=30)

    await asyncio.gather(*(one() for _ in range(1000)))
    assert len(recorder.peers) == M, f"backend saw {len(recorder.peers)} client connections: {recorder.peers}"
    stats = await operator.GetStats(pb.GetStatsRequest(), timeout=5)
    pool = next(b for b in stats.backends if b.name == "retrieval")
    assert [c.connections_ready for c in pool.channels] == [1] * M  # one TLS handshake per channel, ever
    assert sum(c.calls for c in pool.channels) >= 2000
    assert min(c.calls for c in pool.channels) > 0  # both channels carry load


async def test_generate_passes_through_on_m_connections(stub, operator, inference_service):
    messages = [m async for m in stub.Generate(_generate(8), timeout=30)]
    result = messages[-1].response.result
    assert result.usage.completion_tokens == 8
    assert "".join(m.response.text for m in messages) != ""
    # The inference service is shared with other tests, whose probe channels
    # may still be open or closing: what matters is that these calls opened
    # no connection of their own, and that the gateway's channels connected once.
    before = established_peers(inference_service.port)
    for _ in range(50):
        async for _ in stub.Generate(_generate(1), timeout=30):
            pass
    opened = established_peers(inference_service.port) - before
    assert not opened, f"50 calls opened {len(opened)} new connections to the inference service"
    stats = await operator.GetStats(pb.GetStatsRequest(), timeout=5)
    pool = next(b for b in stats.backends if b.name == "inference")
    assert [c.connections_ready for c in pool.channels] == [1] * M  # one TLS handshake per channel, ever
    assert sum(c.calls for c in pool.channels) >= 51


async def test_tenants_never_reuse_each_others_cached_prefixes(gateway, stub, pki):
    prompt = f"Run {uuid.uuid4()}. " + "A gateway keeps long-lived channels to its backends. " * 30

    async def cached(client, salt: str = "") -> int:
        messages = [m async for m in client.Generate(pb.GenerateRequest(request=inference_pb2.GenerateRequest(
            prompt=prompt, cache_salt=salt, sampling=inference_pb2.SamplingParams(max_tokens=1))), timeout=30)]
        return messages[-1].response.result.usage.cached_prompt_tokens

    async with gateway_stub(gateway[0].port, pki.root, identity="tenant/other") as other:
        assert await cached(stub) < 32  # new to the cache
        assert await cached(other) < 32  # the same prompt, another tenant: computed again
        assert await cached(other, "t3-dev") < 32  # naming dev's partition names its own sub-partition
        assert await cached(stub) >= 256  # the same tenant: served from its partition
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await cached(stub, "s" * 129)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("request.cache_salt: is 129 characters; the limit is 128")


async def test_client_cancel_frees_the_engine_within_a_second(stub, engine):
    call = stub.Generate(_generate(3000), timeout=60)
    await call.read()
    await call.read()
    call.cancel()
    assert await _wait_engine_idle(engine, within_s=1.0) < 1.0


@pytest.mark.flaky(reruns=2)  # STALL: see tests/e2e/test_inference.py
async def test_deadline_reaches_the_backend(stub, engine):
    # Best of three: scheduling noise on a shared 2-core machine can only add
    # time, so one run inside the bound shows the deadline is honoured.
    elapsed = []
    for _ in range(3):
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Generate(_generate(3000), timeout=0.3):
                pass
        elapsed.append(time.monotonic() - started)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await _wait_engine_idle(engine, within_s=1.0)
    assert min(elapsed) < 0.35, f"took {[round(e * 1000) for e in elapsed]} ms"


@pytest.mark.flaky(reruns=2)  # STALL: see tests/e2e/test_inference.py
async def test_admission_refuses_past_its_bound_at_once(retrieval, inference_service, pki, database_url, recorded_spans):
    async with gateway_server(pki.root, inference_service.port, retrieval[0], max_in_flight=4,
                              max_in_flight_per_tenant=0, database_url=database_url) as (running, _):
        async with gateway_stub(running.port, pki.root) as small:
            await small.CreateSession(pb.CreateSessionRequest(), timeout=5)  # connect first: time admission, not TLS

            async def stream():
                started = time.monotonic()
                try:
                    count = 0
                    async for _ in small.Generate(_generate(300), timeout=60):
                        count += 1
                    return "done", time.monotonic() - started, None
                except grpc.aio.AioRpcError as error:
                    return error.code(), time.monotonic() - started, error

            results = await asyncio.gather(*(stream() for _ in range(10)))
    refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    done = [r for r in results if r[0] == "done"]
    assert (len(refused), len(done)) == (6, 4), [(r[0], round(r[1], 2)) for r in results]
    # Refused at once: each refusal was decided without waiting for a slot.
    # Measured on the gateway's server span (a one-hop call records admission
    # there: its attributes, and the refusal as an event), not at the client:
    # with ten calls on one connection, a refusal's status was seen to leave
    # the server only when the admitted streams' writes were done (noted on
    # issue 6), which is delivery, not the admission decision.
    def admission_seconds(trace_id: str) -> float:
        (span,) = [s for s in recorded_spans.get_finished_spans()
                   if format(s.context.trace_id, "032x") == trace_id and s.kind == trace.SpanKind.SERVER]
        assert span.status.status_code == trace.StatusCode.ERROR
        assert span.attributes["agw.admission.max_in_flight"] == 4
        assert not [s for s in recorded_spans.get_finished_spans()
                    if format(s.context.trace_id, "032x") == trace_id and s.name == "admission"]
        (refused_event,) = [e for e in span.events if e.name == "agw.admission.refused"]
        assert "AGW_GATEWAY_MAX_IN_FLIGHT=4" in refused_event.attributes["agw.admission.reason"]
        return (refused_event.timestamp - span.start_time) / 1e9

    refusals = [admission_seconds(dict(error.trailing_metadata())["x-trace-id"]) for _, _, error in refused]
    assert max(refusals) < 0.05, refusals
    assert retry_delay_s(refused[0][2]) == pytest.approx(0.05)
    assert "AGW_GATEWAY_MAX_IN_FLIGHT=4" in refused[0][2].details()


async def test_client_without_certificate_is_refused(gateway, pki):
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.cert.read_bytes())
    async with grpc.aio.secure_channel(f"127.0.0.1:{gateway[0].port}", credentials) as channel:
        stub = pb_stub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.CreateSession(pb.CreateSessionRequest(), timeout=3)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def pb_stub(channel):
    from agent.gateway.v1 import gateway_pb2_grpc

    return gateway_pb2_grpc.AgentGatewayStub(channel)


async def test_a_tenant_cannot_read_another_tenants_collection(gateway, docs, pki):
    async with gateway_stub(gateway[0].port, pki.root, identity="tenant/other") as other:
        for name in ("docs", "t3-dev-docs"):  # its own namespace, even given the physical name
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await other.Retrieve(_retrieve(collection=name), timeout=10)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert f"collection {name!r} does not exist" == caught.value.details()


async def test_bad_collection_name_is_invalid_argument(stub):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Retrieve(_retrieve(collection="../x"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_backend_down_at_start_fails_naming_it(inference_service, pki, database_url):
    from servicekit.channels import ChannelNotReady

    with pytest.raises(ChannelNotReady, match=r"retrieval backend at 127.0.0.1:1 not ready"):
        async with gateway_server(pki.root, inference_service.port, 1, connect_timeout_s=0.5, database_url=database_url):
            pass


async def test_session_rpcs_are_tenant_scoped(gateway, stub, pki):
    created = (await stub.CreateSession(pb.CreateSessionRequest(metadata={"k": "'); DROP TABLE agw_sessions; --"}),
                                        timeout=5)).session
    assert created.id and created.message_count == 0
    fetched = (await stub.GetSession(pb.GetSessionRequest(session_id=created.id), timeout=5)).session
    assert dict(fetched.metadata) == {"k": "'); DROP TABLE agw_sessions; --"}
    assert (await stub.ListMessages(pb.ListMessagesRequest(session_id=created.id), timeout=5)).messages == []
    async with gateway_stub(gateway[0].port, pki.root, identity="tenant/other") as other:
        for call, request in ((other.GetSession, pb.GetSessionRequest(session_id=created.id)),
                              (other.ListMessages, pb.ListMessagesRequest(session_id=created.id)),
                              (other.DeleteSession, pb.DeleteSessionRequest(session_id=created.id))):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(request, timeout=5)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert caught.value.details() == f"session {created.id} does not exist"
    await stub.DeleteSession(pb.DeleteSessionRequest(session_id=created.id), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await stub.GetSession(pb.GetSessionRequest(session_id=created.id), timeout=5)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


async def test_malformed_session_id_is_invalid_argument(stub):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetSession(pb.GetSessionRequest(session_id="42; --"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("session_id: '42; --' is not a session id")



async def _raw_stream(channel, method, request) -> list[bytes]:
    """A call's messages as they came off the wire, unparsed."""
    call = raw_multicallable(channel, method)(request, timeout=60)
    if not method.server_streaming:
        return [await call]
    return [message async for message in call]


async def test_passthrough_forwards_the_backends_bytes_unchanged(gateway, retrieval, inference_service, pki, docs):
    """Generate and Retrieve, direct and through the gateway: the backend's serialised messages, byte for byte,
    behind the wrapper's one field header. Only what the engine measures per run (its timings and request id)
    can differ, and only in the final message."""
    generate = inference_pb2.GenerateRequest(
        prompt=f"Bytes for bytes {uuid.uuid4().hex}.",
        sampling=inference_pb2.SamplingParams(max_tokens=24, temperature=0, seed=7, ignore_eos=True))
    gateway_service = pb.DESCRIPTOR.services_by_name["AgentGateway"]
    inference_method = inference_pb2.DESCRIPTOR.services_by_name["Inference"].methods_by_name["Generate"]
    async with mtls_channel(inference_service.port, pki.root) as direct, \
            mtls_channel(gateway[0].port, pki.root, identity="tenant/dev") as through:
        straight = await _raw_stream(direct, inference_method, generate)
        wrapped = await _raw_stream(through, gateway_service.methods_by_name["Generate"],
                                    pb.GenerateRequest(request=generate))
        forwarded = [unwrap(1, message) for message in wrapped]
        assert_same_deltas(straight, forwarded)
        last_direct, last_forwarded = (inference_pb2.GenerateResponse.FromString(m) for m in (straight[-1], forwarded[-1]))
        for last in (last_direct, last_forwarded):
            last.result.ClearField("timings")
            last.result.ClearField("request_id")
        assert last_forwarded == last_direct

        search = retrieval_pb2.SearchRequest(collection="docs", text="the for statement", top_k=3, payload_fields=["topic"])
        scoped = retrieval_pb2.SearchRequest()
        scoped.CopyFrom(search)
        scoped.collection = physical_collection("dev", "docs")
        async with mtls_channel(retrieval[0], pki.root) as direct_retrieval:
            [straight_search] = await _raw_stream(
                direct_retrieval, retrieval_pb2.DESCRIPTOR.services_by_name["Retrieval"].methods_by_name["Search"], scoped)
        [wrapped_search] = await _raw_stream(through, gateway_service.methods_by_name["Retrieve"],
                                             pb.RetrieveRequest(request=search))
        assert unwrap(1, wrapped_search) == straight_search
        assert retrieval_pb2.SearchResponse.FromString(straight_search).results
