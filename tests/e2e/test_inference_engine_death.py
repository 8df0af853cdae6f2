"""A dead engine: requests get UNAVAILABLE, health turns NOT_SERVING, the process lives.

This needs its own inference process (the shared one must keep its engine),
so it pays one more engine start.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from agent.inference.v1 import inference_pb2 as pb
from agent.inference.v1 import inference_pb2_grpc
from tests.support.grpc_client import health_status, mtls_channel
from tests.support.inference_service import start_inference_service

pytestmark = pytest.mark.e2e


@pytest.fixture
def doomed_service(tmp_path, pki):
    service = start_inference_service(tmp_path, pki.root)
    yield service
    service.process.stop(timeout=10)


async def test_killed_engine_core_gives_unavailable_and_not_serving(doomed_service):
    process = doomed_service.process
    engine_cores = process.children()
    assert engine_cores, "expected vLLM's engine-core child process"
    async with mtls_channel(doomed_service.port, doomed_service.tls_dir) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        assert await health_status(channel) == "SERVING"
        for pid in engine_cores:
            os.kill(pid, signal.SIGKILL)

        deadline = time.monotonic() + 15
        while await health_status(channel) != "NOT_SERVING":
            assert time.monotonic() < deadline, "health never turned NOT_SERVING"
            await asyncio.sleep(0.1)

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Generate(pb.GenerateRequest(prompt="anyone there?"), timeout=10):
                pass
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "restart" in caught.value.details()
        # The process itself did not die on the request.
        assert process.process.poll() is None
        assert await health_status(channel, "agent.inference.v1.Inference") == "NOT_SERVING"
