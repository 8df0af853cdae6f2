"""The real inference service (vLLM) refuses a tenant on every method, and serves the gateway and operators."""

from __future__ import annotations

import grpc
import pytest

from agent.inference.v1 import inference_pb2
from gateway.backends import INFERENCE_SERVICE
from tests.support.calls import call_method
from tests.support.grpc_client import health_status, mtls_channel

pytestmark = pytest.mark.e2e


async def test_a_tenant_gets_permission_denied_on_every_inference_method(inference_service, pki):
    async with mtls_channel(inference_service.port, pki.root, identity="tenant/dev") as channel:
        assert await health_status(channel) == "SERVING"  # health answers any verified certificate
        for method in INFERENCE_SERVICE.methods:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call_method(channel, method)
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, (method.name, caught.value)
            assert f"tenant/dev may not call /agent.inference.v1.Inference/{method.name}" in caught.value.details()


@pytest.mark.parametrize("identity", ["service/gateway", "operator/admin"])
async def test_the_gateway_and_operators_are_served(inference_service, pki, identity):
    async with mtls_channel(inference_service.port, pki.root, identity=identity) as channel:
        [info] = await call_method(channel, INFERENCE_SERVICE.methods_by_name["GetModelInfo"],
                                   inference_pb2.GetModelInfoRequest())
        assert info.prefix_caching
