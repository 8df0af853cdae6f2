"""Fair share at admission: a tenant past its bound is refused with retry info while others are still admitted."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from servicekit.errors import retry_delay_s
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.retrieval_service import retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.integration


async def test_a_flooding_tenant_is_refused_and_another_is_admitted(tmp_path, pki, database_url):
    slow = pb.ChatRequest(message="tokens=6 delay=0.2 flood", generation=inference_pb2.SamplingParams(max_tokens=6))
    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _), \
            scripted_app(pki.root) as (inference, _), \
            gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url,
                           max_in_flight=8, max_in_flight_per_tenant=2, tenant_weights="other=1.5") as (gateway, _):
        # Connected first: once in CI the first connection's handshake failed ("Handshake read failed (Endpoint
        # closing)") and two flooding calls ended UNAVAILABLE before reaching admission, which this test judges.
        async with gateway_stub(gateway.port, pki.root, ready_within_s=15) as dev, \
                gateway_stub(gateway.port, pki.root, identity="tenant/other", ready_within_s=15) as other:

            async def turn(stub):
                try:
                    return [e async for e in stub.Chat(slow, timeout=20)][-1].final, None
                except grpc.aio.AioRpcError as exc:
                    return None, exc

            flood = [asyncio.create_task(turn(dev)) for _ in range(4)]
            await asyncio.sleep(0.3)  # dev's admitted turns are generating
            others = await asyncio.gather(turn(other), turn(other))  # weight 1.5: two slots
            results = await asyncio.gather(*flood)
    refused = [error for _, error in results if error is not None]
    assert len(refused) == 2 and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
    assert "tenant dev has 2 calls in flight" in refused[0].details()
    assert retry_delay_s(refused[0]) == pytest.approx(0.05)
    assert all(final is not None and error is None for final, error in others)
