"""The retrieval service killed while turns with retrieval run, and started again.

Turns keep answering, marked degraded with the reason ("no context: retrieval
unavailable"), never failing for it; once the service is back on its address
they get their context again, without a gateway restart. The retrieval
service is a real process (Qdrant Edge on disk, so its data survives).
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agentgw.supervisor import ServiceProcess
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.servers import free_port, scripted_app

pytestmark = pytest.mark.faults

TURN = pb.ChatRequest(message="tokens=2 what is a gateway", retrieval=pb.RetrievalOptions(collection="docs", top_k=2))


async def _turns(stub, count: int) -> list[pb.TurnSummary]:
    finals = []
    for _ in range(count):
        events = [e async for e in stub.Chat(TURN, timeout=10)]
        finals.append(events[-1].final)
    return finals


async def test_retrieval_down_degrades_turns_with_the_reason_and_they_recover(tmp_path, pki, database_url):
    port = free_port()

    def start() -> ServiceProcess:
        return ServiceProcess("retrieval.main", tmp_path / "retrieval", pki.root, "AGW_RETRIEVAL_",
                              env={"AGW_HOME": str(tmp_path / "home"), "AGW_RETRIEVAL_PORT": str(port)})

    retrieval = start()
    try:
        await asyncio.to_thread(retrieval.wait_serving, 120)
        async with scripted_app(pki.root) as (inference, _), \
                gateway_server(pki.root, inference.port, port, database_url=database_url) as (gateway, _), \
                gateway_stub(gateway.port, pki.root) as stub:
            from agent.retrieval.v1 import retrieval_pb2

            await stub.IngestDocuments(pb.IngestDocumentsRequest(collection="docs", documents=[
                retrieval_pb2.Document(id=f"d{i}", text=f"a gateway passage {i}") for i in range(5)]), timeout=60)
            assert not any(f.degraded for f in await _turns(stub, 3))

            retrieval.process.send_signal(signal.SIGKILL)
            retrieval.process.wait()
            down = await _turns(stub, 5)
            assert all(f.degraded and f.degraded_reason == "no context: retrieval unavailable" for f in down), \
                [(f.degraded, f.degraded_reason) for f in down]

            retrieval = start()
            await asyncio.to_thread(retrieval.wait_serving, 120)
            started = time.monotonic()
            while (await _turns(stub, 1))[0].degraded:
                assert time.monotonic() - started < 10, "turns stayed degraded after retrieval came back"
                await asyncio.sleep(0.2)
            print(f"retrieval down: 5 of 5 turns degraded with the reason; context again "
                  f"{time.monotonic() - started:.2f} s after the restarted service served")
    finally:
        await asyncio.to_thread(retrieval.stop, 5)
