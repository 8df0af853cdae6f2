"""Graceful drain and readiness, on a real server process."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from tests.support.grpc_client import health_status, mtls_channel
from tests.support.scripted_process import ScriptedProcess

pytestmark = pytest.mark.integration

@pytest.fixture
def server_process(tmp_path, pki):
    started = []

    def start(**env: str) -> ScriptedProcess:
        process = ScriptedProcess(tmp_path / f"server{len(started)}", pki.root, **env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop(timeout=1)


async def _wait_serving(channel, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if await health_status(channel, timeout=1) == "SERVING":
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("never SERVING")


async def test_sigterm_lets_in_flight_stream_finish_and_refuses_new_calls(server_process, pki):
    server = server_process()
    port = await server.port()
    async with mtls_channel(port, pki.root) as channel:
        await _wait_serving(channel)
        stub = inference_pb2_grpc.InferenceStub(channel)
        stream = stub.Generate(inference_pb2.GenerateRequest(prompt="tokens=10 delay=0.15"), timeout=20)
        first = await stream.read()
        assert first.text == "t0 "

        server.signal(signal.SIGTERM)
        await asyncio.sleep(0.3)  # let the signal land
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Tokenize(inference_pb2.TokenizeRequest(text="late"), timeout=3)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        rest = []
        while (message := await stream.read()) is not grpc.aio.EOF:
            rest.append(message)
        texts = [first.text] + [m.text for m in rest if m.text]
        assert texts == [f"t{i} " for i in range(10)]
        assert rest[-1].result.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert await stream.code() == grpc.StatusCode.OK

    assert await server.wait() == 0
    assert server.closed_file.read_text() == "closed\n", "backends were not closed after the drain"
    assert not server.port_file.exists()


async def test_second_signal_exits_at_once(server_process, pki):
    server = server_process()
    port = await server.port()
    async with mtls_channel(port, pki.root) as channel:
        await _wait_serving(channel)
        stream = inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.GenerateRequest(prompt="tokens=100 delay=0.5"), timeout=60
        )
        assert (await stream.read()).text == "t0 "
        server.signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        started = time.monotonic()
        server.signal(signal.SIGINT)
        code = await server.wait(timeout=5)
        assert time.monotonic() - started < 2
        assert code == 128 + signal.SIGINT
        assert not server.closed_file.exists(), "a second signal must not wait for the drain"


async def test_health_not_serving_and_calls_unavailable_during_warmup(server_process, pki):
    server = server_process(AGW_SCRIPTED_WARMUP_S="3")
    port = await server.port()
    async with mtls_channel(port, pki.root) as channel:
        assert await health_status(channel) == "NOT_SERVING"
        assert await health_status(channel, "agent.inference.v1.Inference") == "NOT_SERVING"
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as early:
            await stub.Tokenize(inference_pb2.TokenizeRequest(text="early"), timeout=3)
        assert early.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "warming up" in early.value.details()
        await _wait_serving(channel)
        response = await stub.Tokenize(inference_pb2.TokenizeRequest(text="ok"), timeout=3)
        assert list(response.token_ids) == [ord("o"), ord("k")]
    server.signal(signal.SIGTERM)
    assert await server.wait() == 0


async def test_signal_during_warmup_cancels_start_up(server_process, pki):
    server = server_process(AGW_SCRIPTED_WARMUP_S="30")
    await server.port()
    started = time.monotonic()
    server.signal(signal.SIGTERM)
    code = await server.wait(timeout=10)
    assert time.monotonic() - started < 5
    assert code == 128 + signal.SIGTERM
