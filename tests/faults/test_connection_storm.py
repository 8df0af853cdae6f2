"""A connection storm: 300 clients open an mTLS connection to the gateway, make a call, and close, while turns run.

Turns keep succeeding, and once the storm is over the gateway's file
descriptors return to within 5 of their level before it.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.gateway.v1 import gateway_pb2_grpc
from agentgw.supervisor import ServiceProcess
from servicekit import ClientTls
from servicekit.procfs import open_fds
from tests.support.gateway_stack import gateway_stub
from tests.support.retrieval_service import retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.faults

CLIENTS = 300
AT_ONCE = 50


async def _one_client(port: int, credentials) -> str:
    """A new connection (TCP + TLS handshake), one stateless turn, closed.

    Stateless, so no call opens a Postgres connection: the pool growing to
    its max under the storm would hold descriptors that are not leaked.
    """
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        return await _turn(gateway_pb2_grpc.AgentGatewayStub(channel))


async def test_a_connection_storm_leaves_turns_running_and_no_descriptors_behind(tmp_path, pki, database_url):
    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _), \
            scripted_app(pki.root) as (inference, _):
        gateway = ServiceProcess("gateway.main", tmp_path / "gateway", pki.root, "AGW_GATEWAY_", env={
            "AGW_GATEWAY_WORKERS": "1", "AGW_DATABASE_URL": database_url,
            # Admission is not under test: every storm call must be let in.
            "AGW_GATEWAY_MAX_IN_FLIGHT": "256", "AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT": "256",
            "AGW_GATEWAY_INFERENCE_TARGET": f"127.0.0.1:{inference.port}",
            "AGW_GATEWAY_RETRIEVAL_TARGET": f"127.0.0.1:{retrieval.port}"})
        try:
            port = await asyncio.to_thread(gateway.wait_serving, 60)
            async with gateway_stub(port, pki.root) as stub:
                await _turn(stub)
                baseline = open_fds(gateway.pid)
                credentials = ClientTls.for_identity(pki.root, "tenant/dev").credentials()
                storm_done = asyncio.Event()
                turns: list[str] = []

                async def keep_turning():
                    while not storm_done.is_set():
                        turns.append(await _turn(stub))

                turning = asyncio.ensure_future(keep_turning())
                limit = asyncio.Semaphore(AT_ONCE)

                async def client():
                    async with limit:
                        return await _one_client(port, credentials)

                started = time.monotonic()
                outcomes = await asyncio.gather(*(client() for _ in range(CLIENTS)))
                storm_s = time.monotonic() - started
                storm_done.set()
                await turning
                assert outcomes.count("OK") == CLIENTS, {o: outcomes.count(o) for o in set(outcomes)}
                assert turns and all(t == "OK" for t in turns), turns
                deadline = time.monotonic() + 10
                while (after := open_fds(gateway.pid)) > baseline + 5 and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert after <= baseline + 5, f"descriptors: {baseline} before the storm, {after} after"
                print(f"connection storm: {CLIENTS} connections in {storm_s:.1f} s, {len(turns)} turns meanwhile, "
                      f"all OK; gateway descriptors {baseline} before, {after} after")
        finally:
            await asyncio.to_thread(gateway.stop, 5)


async def _turn(stub) -> str:
    try:
        events = [e async for e in stub.Chat(pb.ChatRequest(message="tokens=3"), timeout=20)]
        return "OK" if events[-1].HasField("final") else "NO FINAL"
    except grpc.aio.AioRpcError as error:
        return error.code().name
