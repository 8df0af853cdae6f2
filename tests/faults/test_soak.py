"""The 60-second soak: bench/soak.py's check, in CI, on real processes (vLLM, Qdrant Edge, Postgres, the gateway).

After warm-up no process's RSS grows past 5% or 20 MiB, and once the load
stops every process's descriptors and asyncio tasks, and the gateway's
Postgres connections, are back within ±2 of their idle level before it. The 10-minute run is
``python bench/soak.py``; its figures are in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from agentgw.connection import Connection
from agentgw.supervisor import ServiceProcess
from tests.support.servers import free_port

pytestmark = pytest.mark.faults

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _soak_module():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import soak

    return soak


async def test_a_minute_of_agent_turns_leaks_nothing(tmp_path, pki, inference_service, database_url):
    soak = _soak_module()
    retrieval_metrics = free_port()
    retrieval = ServiceProcess("retrieval.main", tmp_path / "retrieval", pki.root, "AGW_RETRIEVAL_",
                               env={"AGW_HOME": str(tmp_path / "home"),
                                    "AGW_RETRIEVAL_METRICS_PORT": str(retrieval_metrics)})
    gateway = None
    try:
        retrieval_port = await asyncio.to_thread(retrieval.wait_serving, 120)
        gateway = ServiceProcess("gateway.main", tmp_path / "gateway", pki.root, "AGW_GATEWAY_", env={
            "AGW_GATEWAY_WORKERS": "1", "AGW_DATABASE_URL": database_url,
            "AGW_GATEWAY_INFERENCE_TARGET": f"127.0.0.1:{inference_service.port}",
            "AGW_GATEWAY_RETRIEVAL_TARGET": f"127.0.0.1:{retrieval_port}"})
        port = await asyncio.to_thread(gateway.wait_serving, 60)
        connection = Connection(gateway=f"127.0.0.1:{port}", tls_dir=str(pki.root), identity="dev")
        await soak.seed(connection)
        pids = {"gateway": gateway.pid, "inference": inference_service.process.pid, "retrieval": retrieval.pid}
        metrics_ports = {"inference": inference_service.metrics_port, "retrieval": retrieval_metrics}
        samples, settled, verdict, load = await soak.soak(connection, pids, metrics_ports, rate=3.0,
                                                          duration_s=60.0, sample_every_s=10.0)
        assert all(task_count > 0 for task_count in settled.tasks.values()), settled.tasks
        assert settled.gc["inference"]["0"][0] > 0, settled.gc  # the process's collections reach its metrics
        soak.report(samples, settled, verdict, load)
        assert load["turns"] > 100 and load["errors"] == 0, (load["statuses"], load["error_messages"])
        assert verdict.passed, verdict.reasons
    finally:
        for process in (gateway, retrieval):
            if process is not None:
                await asyncio.to_thread(process.stop, 10)
