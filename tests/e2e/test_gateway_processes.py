"""The gateway with backends as real processes: a restarted backend, workers on one port, dev mode."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.gateway.v1 import gateway_pb2_grpc
from agent.retrieval.v1 import retrieval_pb2
from agentgw.supervisor import ServiceProcess
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.retrieval_service import retrieval_server
from tests.support.servers import free_port

pytestmark = pytest.mark.e2e


def _ingest(documents=3) -> pb.IngestDocumentsRequest:
    return pb.IngestDocumentsRequest(collection="kb", documents=[
        retrieval_pb2.Document(id=f"d{i}", vector=retrieval_pb2.Vector(values=[float(i + 1)] * 384))
        for i in range(documents)
    ])


CHEAP = pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(
    collection="kb", vector=retrieval_pb2.Vector(values=[1.0] * 384), top_k=1))


async def test_backend_restarted_mid_run(tmp_path, pki, inference_service, database_url):
    port = free_port()

    def start_retrieval() -> ServiceProcess:
        # The same fixed port both times, so the gateway's target stays valid.
        return ServiceProcess("retrieval.main", tmp_path / "retrieval", pki.root, "AGW_RETRIEVAL_",
                              env={"AGW_HOME": str(tmp_path / "home"), "AGW_RETRIEVAL_PORT": str(port)})

    backend = start_retrieval()
    try:
        backend.wait_serving()
        async with gateway_server(pki.root, inference_service.port, port, database_url=database_url) as (running, _):
            async with gateway_stub(running.port, pki.root) as stub:
                await stub.IngestDocuments(_ingest(), timeout=30)
                assert (await stub.Retrieve(CHEAP, timeout=5)).response.results

                backend.process.kill()  # no drain: the backend vanishes
                backend.process.wait()
                outage = []
                for _ in range(5):
                    started = time.monotonic()
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await stub.Retrieve(CHEAP, timeout=5)
                    outage.append(time.monotonic() - started)
                    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
                    # The service is named, its address is not (the log has it, under the error id).
                    assert caught.value.details().startswith("the retrieval service is not serving")
                    assert "error id" in caught.value.details() and "127.0.0.1" not in caught.value.details()
                assert max(outage) < 1.0, f"outage calls took {outage}"

                backend = start_retrieval()
                backend.wait_serving()
                deadline = time.monotonic() + 10
                while True:  # the pool redials within its reconnect backoff (about a second)
                    try:
                        response = await stub.Retrieve(CHEAP, timeout=5)
                        break
                    except grpc.aio.AioRpcError as error:
                        assert error.code() == grpc.StatusCode.UNAVAILABLE
                        assert time.monotonic() < deadline, "gateway never used the restarted backend"
                        await asyncio.sleep(0.1)
                assert response.response.results  # the data survived: Qdrant Edge on disk
    finally:
        backend.stop()


async def test_workers_share_one_port(tmp_path, pki, inference_service, database_url):
    port = free_port()
    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _):
        env = {
            **os.environ, "AGW_TLS_DIR": str(pki.root), "AGW_GATEWAY_PORT": str(port),
            "AGW_GATEWAY_INFERENCE_TARGET": f"127.0.0.1:{inference_service.port}",
            "AGW_GATEWAY_RETRIEVAL_TARGET": f"127.0.0.1:{retrieval.port}", "AGW_DATABASE_URL": database_url,
        }
        process = subprocess.Popen([sys.executable, "-m", "agentgw.cli", "serve", "gateway", "--workers", "2"],
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0)
        try:
            pids: set[int] = set()
            deadline = time.monotonic() + 60
            while len(pids) < 2:
                assert time.monotonic() < deadline, f"saw workers {pids}"
                try:  # a fresh connection each time: the kernel spreads connections over the workers
                    async with gateway_stub(port, pki.root, identity="operator/admin") as stub:
                        pids.add((await stub.GetStats(pb.GetStatsRequest(), timeout=2)).worker_pid)
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.2)
            assert process.pid not in pids  # the parent supervises; the workers serve
            process.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(process.wait, 30) == 0
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


async def test_insecure_dev_mode_serves_plaintext_as_tenant_dev(tmp_path, pki, inference_service, caplog, database_url):
    async with retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _):
        async with gateway_server(pki.root, inference_service.port, retrieval.port, insecure_dev=True, database_url=database_url) as (running, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                stub = gateway_pb2_grpc.AgentGatewayStub(channel)
                await stub.IngestDocuments(_ingest(), timeout=30)
                assert (await stub.Retrieve(CHEAP, timeout=5)).response.results
            # Plaintext only: a TLS client cannot talk to it.
            async with gateway_stub(running.port, pki.root) as tls_stub:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await tls_stub.CreateSession(pb.CreateSessionRequest(), timeout=2)
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "AGW_INSECURE_DEV=1: the gateway serves PLAINTEXT" in caplog.text
