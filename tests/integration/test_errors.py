"""Domain errors reach the client as the right status with actionable details."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2

from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from servicekit import from_rpc_error
from servicekit.errors import retry_delay_s, status_details
from tests.support.grpc_client import mtls_channel
from tests.support.servers import scripted_server

pytestmark = pytest.mark.integration


async def _tokenize_error(pki, text: str) -> grpc.aio.AioRpcError:
    async with scripted_server(pki.root) as server:
        async with mtls_channel(server.port, pki.root) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await inference_pb2_grpc.InferenceStub(channel).Tokenize(
                    inference_pb2.TokenizeRequest(text=text), timeout=5
                )
    return caught.value


async def test_invalid_argument_names_the_field(pki):
    error = await _tokenize_error(pki, "invalid")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "text: scripted invalid input"
    status = status_details(error)
    bad_request = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad_request)
    assert bad_request.field_violations[0].field == "text"


async def test_resource_exhausted_carries_a_retry_hint(pki):
    error = await _tokenize_error(pki, "busy")
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_delay_s(error) == pytest.approx(0.25)
    mapped = from_rpc_error(error, backend="inference")
    assert mapped.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert mapped.retry_after_s == pytest.approx(0.25)
    assert str(mapped) == "inference: scripted overload"


async def test_unexpected_exception_is_internal_without_leaking_internals(pki):
    error = await _tokenize_error(pki, "crash")
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "Tokenize" in error.details() and "RuntimeError" in error.details()
    assert "scripted crash" not in error.details()


async def test_a_method_the_server_lacks_is_unimplemented_not_internal(pki):
    # The scripted servicer with open_generate off raises NotImplementedError, as the
    # generated base class's body does for a method a server lacks. Callers (the
    # gateway's fallback to Generate) must see UNIMPLEMENTED, not a server fault.
    async with scripted_server(pki.root, open_generate=False) as server:
        async with mtls_channel(server.port, pki.root) as channel:
            call = inference_pb2_grpc.InferenceStub(channel).OpenGenerate(timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call.read()
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert caught.value.details().startswith("/agent.inference.v1.Inference/OpenGenerate is not implemented")
    mapped = from_rpc_error(caught.value, backend="inference")
    assert mapped.code == grpc.StatusCode.UNIMPLEMENTED and type(mapped).__name__ == "Unimplemented"
