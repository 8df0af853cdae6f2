"""A client that stops reading a Chat stream for 10 s, while other turns run.

The gateway's memory stays bounded (RSS grows less than 10 MiB: the stream's
pending text is capped and flow control holds the backend), other turns'
first token stays within 1.5x of its p50 before, and the caller's deadline
ends the stalled stream. The gateway is a process of its own, so its RSS is
its own.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.gateway.v1 import gateway_pb2_grpc
from agentgw.supervisor import ServiceProcess
from servicekit import ClientTls
from servicekit.procfs import rss_bytes
from tests.support.gateway_stack import gateway_stub
from tests.support.retrieval_service import retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.faults

STALL_S = 10.0
#: Shorter than the stall: the deadline comes while the reader still reads nothing.
DEADLINE_S = 8.0
#: Timer noise on a shared 2-core machine, added to the 1.5x bound on a few-millisecond p50.
NOISE_MS = 1.0


async def _first_token_ms(stub) -> float:
    started = time.perf_counter()
    call = stub.Chat(pb.ChatRequest(message="tokens=3"), timeout=10)
    first = None
    async for event in call:
        if first is None and event.WhichOneof("event") == "delta":
            first = (time.perf_counter() - started) * 1000
    return first


async def test_a_stalled_reader_costs_others_nothing_and_its_deadline_ends_it(tmp_path, pki, database_url):
    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _), \
            scripted_app(pki.root) as (inference, scripted):
        gateway = ServiceProcess("gateway.main", tmp_path / "gateway", pki.root, "AGW_GATEWAY_", env={
            "AGW_GATEWAY_WORKERS": "1", "AGW_DATABASE_URL": database_url,
            "AGW_GATEWAY_INFERENCE_TARGET": f"127.0.0.1:{inference.port}",
            "AGW_GATEWAY_RETRIEVAL_TARGET": f"127.0.0.1:{retrieval.port}"})
        try:
            port = await asyncio.to_thread(gateway.wait_serving, 60)
            credentials = ClientTls.for_identity(pki.root, "tenant/dev").credentials()
            # The stalled reader's window stays at 64 KiB (no BDP probing), as a slow client's would.
            async with gateway_stub(port, pki.root) as stub, \
                    grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials,
                                            options=[("grpc.http2.bdp_probe", 0)]) as stalled_channel:
                stalled_stub = gateway_pb2_grpc.AgentGatewayStub(stalled_channel)
                # Warm the large-message paths once (their buffers stay in the allocator), then the baseline.
                async for _ in stalled_stub.Chat(pb.ChatRequest(message="tokens=100 delay=0 pad=16384"), timeout=30):
                    pass
                before = []
                for _ in range(20):  # paced as the turns during the stall are: an idle gap slows a first token
                    before.append(await _first_token_ms(stub))
                    await asyncio.sleep(0.2)
                rss_before = rss_bytes(gateway.pid)

                script = "tokens=5000 delay=0 pad=16384"  # 80 MB if nothing held it back
                stalled = stalled_stub.Chat(pb.ChatRequest(message=script), timeout=DEADLINE_S)
                assert (await stalled.read()).WhichOneof("event") == "delta"
                stalled_at = time.monotonic()
                during, grown = [], 0
                while time.monotonic() < stalled_at + STALL_S:
                    during.append(await _first_token_ms(stub))
                    if time.monotonic() < stalled_at + DEADLINE_S - 0.5:  # the stalled stream still open
                        grown = max(grown, rss_bytes(gateway.pid) - rss_before)
                        sent_while_stalled = scripted.servicer.sent[script]
                    await asyncio.sleep(0.2)

                try:
                    while await stalled.read() is not grpc.aio.EOF:
                        pass
                    ended = "OK"
                except grpc.aio.AioRpcError as error:
                    ended = error.code().name
        finally:
            await asyncio.to_thread(gateway.stop, 5)
    p50_before, p50_during = statistics.median(before), statistics.median(during)
    print(f"slow consumer: others' first token p50 {p50_before:.1f} ms before, {p50_during:.1f} ms during "
          f"({len(during)} turns); gateway RSS +{grown / 2**20:.1f} MiB; backend sent {sent_while_stalled} of 5000; "
          f"the stalled stream ended {ended}")
    assert grown < 10 * 2**20, f"the gateway's RSS grew {grown / 2**20:.1f} MiB"
    assert sent_while_stalled < 5000, "the backend was never held back"
    assert p50_during <= 1.5 * p50_before + NOISE_MS, (p50_before, p50_during)
    assert ended == "DEADLINE_EXCEEDED"
