"""The inference service killed (SIGKILL) while turns stream, and started again.

What the client sees: every turn in flight ends with UNAVAILABLE within a
second of the kill; what Postgres holds: nothing of those turns (a turn is
stored whole or not at all); and after the service comes back on its address,
turns succeed again without restarting the gateway. The inference service is
the scripted one, in a process of its own (the fault is the process's death,
not the engine's; the engine dying inside a live service is
tests/e2e/test_inference_engine_death.py).
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.retrieval_service import retrieval_server
from tests.support.scripted_process import ScriptedProcess
from tests.support.servers import free_port

pytestmark = pytest.mark.faults

IN_FLIGHT = 6


async def _stream_until_it_ends(call) -> tuple[str, float]:
    """Read a started turn to its end: ("OK" | the status name, when it ended)."""
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
        return "OK", time.monotonic()
    except grpc.aio.AioRpcError as error:
        return error.code().name, time.monotonic()


async def _first_ok_turn(stub, within_s: float) -> float:
    started = time.monotonic()
    while True:
        try:
            events = [e async for e in stub.Chat(pb.ChatRequest(message="tokens=2"), timeout=5)]
            if events[-1].HasField("final"):
                return time.monotonic() - started
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert time.monotonic() - started < within_s, "the gateway never used the restarted inference service"
        await asyncio.sleep(0.1)


async def test_inference_killed_under_load_fails_turns_fast_stores_nothing_and_recovers(tmp_path, pki,
                                                                                        database_url):
    port = free_port()  # the same address both times, as a restarted pod behind a stable name

    def start(name: str) -> ScriptedProcess:
        return ScriptedProcess(tmp_path / name, pki.root, AGW_SCRIPTED_PORT=str(port))

    inference = start("first")
    try:
        await asyncio.to_thread(inference.wait_serving, 30)
        async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _), \
                gateway_server(pki.root, port, retrieval.port, database_url=database_url) as (gateway, _), \
                gateway_stub(gateway.port, pki.root) as stub:
            sessions = [(await stub.CreateSession(pb.CreateSessionRequest(), timeout=5)).session.id
                        for _ in range(IN_FLIGHT)]
            calls = [stub.Chat(pb.ChatRequest(session_id=s, message="tokens=400 delay=0.02"), timeout=30)
                     for s in sessions]
            for call in calls:  # every turn is streaming when the fault comes
                assert (await call.read()).WhichOneof("event") == "delta"
            inference.process.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            ended = await asyncio.gather(*(_stream_until_it_ends(call) for call in calls))

            assert [code for code, _ in ended] == ["UNAVAILABLE"] * IN_FLIGHT
            slowest = max(at for _, at in ended) - killed_at
            assert slowest < 1.0, f"the last in-flight turn ended {slowest:.2f} s after the kill"
            for session in sessions:  # nothing stored half-way
                listed = await stub.ListMessages(pb.ListMessagesRequest(session_id=session), timeout=5)
                assert list(listed.messages) == []

            inference = start("second")
            await asyncio.to_thread(inference.wait_serving, 30)
            recovered_s = await _first_ok_turn(stub, within_s=10)
            print(f"inference killed: in-flight turns ended within {slowest:.3f} s; after the restart served, the "
                  f"first turn succeeded within {recovered_s:.3f} s")
            events = [e async for e in stub.Chat(pb.ChatRequest(session_id=sessions[0], message="tokens=3"),
                                                 timeout=10)]
            assert events[-1].HasField("final")
            stored = await stub.ListMessages(pb.ListMessagesRequest(session_id=sessions[0]), timeout=5)
            assert len(stored.messages) == 2  # the retried turn, once: the user's message and the answer
    finally:
        inference.stop(timeout=1)
