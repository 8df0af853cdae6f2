"""Property-based fuzzing of every public RPC, against the real gateway on real backends.

Hypothesis builds arbitrary requests from each method's descriptor (every
field set or not, whole type ranges, undefined enum values, strings past
every bound) and mutates valid requests' wire bytes. Whatever comes in, the
answer is a status a client can act on: never UNKNOWN or INTERNAL (our bug,
or a leaked one); no process dies; the stack is SERVING afterwards and still
answers a turn.

Profiles: ``ci`` (the default; about two minutes) and ``long``
(``HYPOTHESIS_PROFILE=long``, for a local hour of it).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.gateway.v1 import gateway_pb2 as pb
from agent.retrieval.v1 import retrieval_pb2
from servicekit import ClientTls
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.grpc_client import health_status, mtls_channel
from agent.inference.v1 import inference_pb2
from tests.support.proto_strategies import messages, mutated, one_field_changed
from tests.support.retrieval_service import retrieval_server

pytestmark = pytest.mark.e2e

SERVICE = pb.DESCRIPTOR.services_by_name["AgentGateway"]
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
#: Keep generation short: the fuzzer's budget goes to inputs, not to tokens.
OVERRIDES = {("SamplingParams", "max_tokens"): st.one_of(st.integers(0, 8), st.just(2**31 - 1)),
             ("RetrievalOptions", "top_k"): st.one_of(st.integers(0, 8), st.just(2**31 - 1))}

settings.register_profile("ci", max_examples=150, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
settings.register_profile("long", max_examples=2000, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, pki, inference_service, database_url):
    async with retrieval_server(tmp_path_factory.mktemp("fuzz-retrieval"), pki.root) as (retrieval, _), \
            gateway_server(pki.root, inference_service.port, retrieval.port, database_url=database_url) as (gw, _):
        async with gateway_stub(gw.port, pki.root) as stub:
            await stub.IngestDocuments(pb.IngestDocumentsRequest(collection="docs", documents=[
                retrieval_pb2.Document(id=f"d{i}", text=f"passage {i} about the gateway") for i in range(4)]),
                timeout=120)
        yield gw.port


def _valid_requests(session_id: str) -> dict:
    """One valid request per method: the base that one-field changes start from."""
    short = inference_pb2.SamplingParams(max_tokens=4)
    return {
        "Chat": pb.ChatRequest(message="hello", session_id=session_id, generation=short,
                               retrieval=pb.RetrievalOptions(collection="docs", top_k=2)),
        "Generate": pb.GenerateRequest(request=inference_pb2.GenerateRequest(prompt="hello", sampling=short)),
        "Retrieve": pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(collection="docs", text="gateway", top_k=2)),
        "CreateSession": pb.CreateSessionRequest(metadata={"agent": "fuzz"}),
        "GetSession": pb.GetSessionRequest(session_id=session_id),
        "ListMessages": pb.ListMessagesRequest(session_id=session_id, page_size=5),
        "DeleteSession": pb.DeleteSessionRequest(session_id=session_id),
        "IngestDocuments": pb.IngestDocumentsRequest(collection="fuzz", documents=[
            retrieval_pb2.Document(id="a", text="a passage")]),
        "GetStats": pb.GetStatsRequest(),
    }


def _call(channel: grpc.Channel, method, data: bytes) -> grpc.StatusCode:
    """Send raw request bytes; the status the call ended with (OK when it did)."""
    path = f"/{SERVICE.full_name}/{method.name}"
    try:
        if method.server_streaming:
            for _ in channel.unary_stream(path, request_serializer=None, response_deserializer=None)(data, timeout=4):
                pass
        else:
            channel.unary_unary(path, request_serializer=None, response_deserializer=None)(data, timeout=4)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def _fuzz(port: int, tls_dir, session_id: str) -> Counter:
    """Every method: arbitrary messages, and valid ones with one field changed, either maybe with its wire
    bytes mutated; returns the statuses seen, by method."""
    seen: Counter = Counter()
    valid = _valid_requests(session_id)
    credentials = ClientTls.for_identity(tls_dir, "tenant/dev").credentials()
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        for method in SERVICE.methods:
            strategy = st.one_of(messages(method.input_type, OVERRIDES), one_field_changed(valid[method.name], OVERRIDES))

            @settings(settings.get_profile(PROFILE))
            @given(request=strategy, mutate=st.booleans(), data=st.data())
            def one(request, mutate, data):
                wire = request.SerializeToString()
                if mutate:
                    wire = data.draw(mutated(wire))
                code = _call(channel, method, wire)
                seen[(method.name, code.name)] += 1
                assert code not in FORBIDDEN, f"{method.name} answered {code.name} to {wire[:200]!r}"

            one()
    return seen


async def test_no_public_rpc_answers_unknown_or_internal_to_anything(stack, pki):
    async with gateway_stub(stack, pki.root) as stub:
        session_id = (await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)).session.id
    seen = await asyncio.to_thread(_fuzz, stack, pki.root, session_id)  # this loop keeps serving the gateway
    methods = {method for method, _ in seen}
    assert methods == {m.name for m in SERVICE.methods}
    print("fuzzed statuses:", dict(sorted(seen.items())))
    async with mtls_channel(stack, pki.root, identity="tenant/dev") as channel:
        assert await health_status(channel, SERVICE.full_name) == "SERVING"
    async with gateway_stub(stack, pki.root) as stub:  # and it still runs a turn, end to end
        events = [e async for e in stub.Chat(pb.ChatRequest(message="still there?"), timeout=60)]
        assert events[-1].WhichOneof("event") == "final"
