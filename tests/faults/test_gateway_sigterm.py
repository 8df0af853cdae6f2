"""SIGTERM to the gateway under load: turns in flight finish, new ones get UNAVAILABLE at once, and the process
exits within AGW_GRACE_S."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agentgw.supervisor import ServiceProcess
from tests.support.gateway_stack import gateway_stub
from tests.support.retrieval_service import retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.faults

GRACE_S = 8.0


async def _finish(call) -> str:
    try:
        last = None
        while (message := await call.read()) is not grpc.aio.EOF:
            last = message
        return "OK" if last is not None and last.HasField("final") else "NO FINAL"
    except grpc.aio.AioRpcError as error:
        return error.code().name


async def test_sigterm_under_load_finishes_turns_in_flight_and_refuses_new_ones(tmp_path, pki, database_url):
    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _), \
            scripted_app(pki.root) as (inference, _):
        gateway = ServiceProcess("gateway.main", tmp_path / "gateway", pki.root, "AGW_GATEWAY_", env={
            "AGW_GATEWAY_WORKERS": "1", "AGW_DATABASE_URL": database_url, "AGW_GRACE_S": str(GRACE_S),
            "AGW_GATEWAY_INFERENCE_TARGET": f"127.0.0.1:{inference.port}",
            "AGW_GATEWAY_RETRIEVAL_TARGET": f"127.0.0.1:{retrieval.port}"})
        try:
            port = await asyncio.to_thread(gateway.wait_serving, 60)
            async with gateway_stub(port, pki.root) as stub:
                sessions = [(await stub.CreateSession(pb.CreateSessionRequest(), timeout=5)).session.id
                            for _ in range(5)]
                calls = [stub.Chat(pb.ChatRequest(session_id=s, message="tokens=40 delay=0.05"), timeout=30)
                         for s in sessions]
                for call in calls:
                    assert (await call.read()).WhichOneof("event") == "delta"
                gateway.process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                await asyncio.sleep(0.2)  # the drain has begun
                refused_started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in stub.Chat(pb.ChatRequest(message="tokens=2"), timeout=10):
                        pass
                refused_after = time.monotonic() - refused_started
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
                assert refused_after < 0.5, f"a new turn waited {refused_after:.2f} s to be refused"
                assert await asyncio.gather(*(_finish(call) for call in calls)) == ["OK"] * 5
            code = await asyncio.to_thread(gateway.process.wait, GRACE_S + 2)
            exited_after = time.monotonic() - signalled
            assert code == 0 and exited_after <= GRACE_S, (code, exited_after)
            print(f"gateway SIGTERM: 5 in-flight turns finished, a new turn refused in {refused_after * 1000:.0f} ms, "
                  f"exit {code} after {exited_after:.2f} s (grace {GRACE_S:g} s)")
        finally:
            await asyncio.to_thread(gateway.stop, 5)
