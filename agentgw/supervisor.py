"""Run a service as a child process: start it, learn its port, watch its health, stop it.

Used by tests and benchmarks to run services as real processes, and by
``agentgw up`` to run the stack. Blocking on purpose: the callers drive
processes, not RPC traffic.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicekit.procfs import children
from servicekit.identity import DEFAULT_OPERATOR
from servicekit.tls import ClientTls

class ServiceStartError(RuntimeError):
    """A service exited or did not become ready in time; the message ends with its log."""


class ServiceProcess:
    """``python -m MODULE`` with a port file, a log file and mTLS from ``tls_dir``.

    The child gets its own process group, so :meth:`stop` also ends whatever
    it started (vLLM's engine core and workers). It stays in its parent's
    session, and so in its parent's scheduler autogroup: on Linux with
    ``kernel.sched_autogroup_enabled=1`` each session is one CPU-scheduling
    group, and a service in its own session (``setsid``) next to vLLM's
    spinning CPU workers in theirs was left runnable but unscheduled for
    seconds at a time (docs/architecture.md, "CPU scheduling").
    """

    def __init__(self, module: str, workdir: Path, tls_dir: Path, env_prefix: str, *,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port_file = workdir / "port"
        self.port_file.unlink(missing_ok=True)
        self.log = workdir / "service.log"
        self.tls_dir = tls_dir
        environment = {
            **os.environ,
            "AGW_TLS_DIR": str(tls_dir),
            f"{env_prefix}PORT": "0",
            f"{env_prefix}PORT_FILE": str(self.port_file),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", module], cwd=cwd, env=environment,
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, process_group=0,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_port(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.port_file.exists() and (text := self.port_file.read_text().strip()):
                return int(text)
            if self.process.poll() is not None:
                raise ServiceStartError(f"service exited with {self.process.returncode}:\n{self.log_text()[-4000:]}")
            time.sleep(0.05)
        raise ServiceStartError(f"service wrote no port in {timeout}s:\n{self.log_text()[-4000:]}")

    def secure_channel(self, identity: str = f"operator/{DEFAULT_OPERATOR}") -> grpc.Channel:
        """A blocking channel, for fixtures that run outside the event loop (as an operator by default)."""
        credentials = ClientTls.for_identity(self.tls_dir, identity).credentials()
        return grpc.secure_channel(f"127.0.0.1:{self.wait_port()}", credentials)

    def wait_serving(self, timeout: float = 240) -> int:
        """Block until health reports SERVING; return the port."""
        port = self.wait_port(timeout)
        deadline = time.monotonic() + timeout
        with self.secure_channel() as channel:
            while time.monotonic() < deadline:
                try:
                    if self.health(channel) == "SERVING":
                        return port
                except grpc.RpcError:
                    pass
                if self.process.poll() is not None:
                    raise ServiceStartError(f"service exited with {self.process.returncode}:\n{self.log_text()[-4000:]}")
                time.sleep(0.1)
        raise ServiceStartError(f"service not SERVING after {timeout}s:\n{self.log_text()[-4000:]}")

    def health(self, channel: grpc.Channel, service: str = "") -> str:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def children(self) -> list[int]:
        """Direct child processes (vLLM's engine core, for one), of any thread."""
        return children(self.pid)

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM, then SIGKILL the whole process group if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)  # engine workers included
        except ProcessLookupError:
            pass
        self.process.wait()
        return self.process.returncode
