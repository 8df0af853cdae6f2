"""`agentgw up` as a user runs it: a subprocess on a temporary AGW_HOME, then chat, doctor and Ctrl-C.

Nothing is shared with the other tests: its own embedded Postgres (pgserver),
its own Qdrant Edge folder, smoke model, certificates and inference engine.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from servicekit.procfs import descendants
from tests.support.inference_service import TEST_ENGINE_ENV
from tests.support.servers import free_port

pytestmark = pytest.mark.e2e

SERVICES = ("GATEWAY", "RETRIEVAL", "INFERENCE")


class Up:
    """`agentgw up` in a subprocess, its output read line by line on a thread."""

    def __init__(self, home: Path, *args: str, **env: str) -> None:
        self.home = home
        self.ports = {name: free_port() for name in SERVICES}
        if "--inference-replicas" in args:  # replicas take consecutive ports from the inference service's
            self.ports["INFERENCE"] = _free_pair()
        self.env = {key: value for key, value in os.environ.items()
                    if not key.startswith(("AGW_", "OTEL_"))}  # nothing of the test session leaks in
        self.env.update(TEST_ENGINE_ENV)
        self.env["AGW_HOME"] = str(home)
        for name, port in self.ports.items():
            self.env[f"AGW_{name}_PORT"] = str(port)
            self.env[f"AGW_{name}_METRICS_PORT"] = str(_free_pair() if name == "INFERENCE" else free_port())
        self.env.update(env)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self.process = subprocess.Popen([sys.executable, "-m", "agentgw.cli", "up", *args], env=self.env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)

    def wait_for(self, text: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=1)
                self.output.append(line)
                if text in line:
                    return
            except queue.Empty:
                if self.process.poll() is not None:
                    raise AssertionError(f"agentgw up exited {self.process.returncode}:\n{''.join(self.output)}")
            assert time.monotonic() < deadline, f"no {text!r} after {timeout}s:\n{''.join(self.output)}"

    def cli(self, *args: str, timeout: float = 180, input: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "agentgw.cli", *args], env=self.env, input=input,
                              capture_output=True, text=True, timeout=timeout)

    def healthcheck(self, port: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "agentgw.healthcheck", "--port", str(port)], env=self.env,
                              capture_output=True, text=True, timeout=30)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)
        code = self.process.wait(90)
        while not self.lines.empty():
            self.output.append(self.lines.get())
        return code


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _free_pair() -> int:
    """A free port whose next one is free too."""
    while not _free((port := free_port()) + 1):
        pass
    return port


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_up_answers_passes_the_doctor_and_stops_clean(tmp_path):
    home = tmp_path / "home"
    stack = Up(home)
    try:
        stack.wait_for("Ctrl-C drains and stops everything")
        printed = "".join(stack.output)
        for step in ("dev certificates", "Postgres (embedded", "smoke model", "retrieval service", "inference service",
                     "gateway on port", "sample corpus"):
            assert f"  {step}" in printed and "done in" in printed, step
        connection = json.loads((home / "connection.json").read_text())
        assert connection["gateway"] == f"127.0.0.1:{stack.ports['GATEWAY']}"

        chat = stack.cli("chat", "--json", "--max-tokens", "4", "What does the with statement do?")
        assert chat.returncode == 0, chat.stderr
        events = [json.loads(line) for line in chat.stdout.splitlines()]
        assert "context" in events[0] and events[0]["context"]["documents"]  # the sample corpus answered
        assert any("delta" in e for e in events)
        final = events[-1]["final"]
        assert final["usage"]["completionTokens"] == 4 and len(final["traceId"]) == 32

        # Questions on stdin: one session, so the second turn sees the first.
        conversation = stack.cli("chat", "--json", "--max-tokens", "2", input="First question?\nSecond one?\n")
        assert conversation.returncode == 0, conversation.stderr
        finals = [json.loads(line)["final"] for line in conversation.stdout.splitlines() if '"final"' in line]
        assert len(finals) == 2 and finals[0]["sessionId"] == finals[1]["sessionId"]
        assert finals[1]["usage"]["promptTokens"] > finals[0]["usage"]["promptTokens"]  # history in the prompt

        # A local tool loop: the forced call runs search_docs against the gateway's Retrieve, its result goes back.
        tools = Path(__file__).resolve().parents[2] / "docs" / "examples" / "tools.json"
        loop = stack.cli("chat", "--tools", str(tools), "--tool-choice", "search_docs", "--max-steps", "2",
                         "--max-tokens", "48", "What is a tuple?")
        assert loop.returncode == 0, loop.stderr
        assert "tool call search_docs({\"query\":" in loop.stdout and '  -> [{"id": ' in loop.stdout, loop.stdout

        doctor = stack.cli("doctor")
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert "0 warn, 0 fail" in doctor.stdout
        assert "PASS  one CPU scheduling group" in doctor.stdout  # vLLM's processes included
        for port in stack.ports.values():  # the container health check, against each service
            assert stack.healthcheck(port).returncode == 0

        # The operator's tools present the operator identity, which the backends serve.
        notes = tmp_path / "notes.md"
        notes.write_text("# Gateways\n\nA gateway keeps long-lived channels to its backends.\n")
        retrieval = f"127.0.0.1:{stack.ports['RETRIEVAL']}"
        ingest = stack.cli("ingest", "--target", retrieval, "--collection", "t3-dev-notes", str(notes))
        assert ingest.returncode == 0, ingest.stdout + ingest.stderr
        tune = stack.cli("tune-ef", "--target", retrieval, "--target-recall", "0.9", "--k", "5", "--sample-size", "20",
                         "t3-dev-docs")
        assert tune.returncode in (0, 1), tune.stdout + tune.stderr  # 1: the target recall was not met
        assert "stored ef=" in tune.stdout, tune.stdout + tune.stderr
        # ... and a tenant's certificate gets nothing from a backend.
        as_tenant = stack.cli("ingest", "--target", retrieval, "--identity", "tenant/dev", str(notes))
        assert as_tenant.returncode == 1 and "PERMISSION_DENIED" in as_tenant.stderr, as_tenant.stderr

        processes = set()
        for pid in connection["pids"].values():
            processes |= {pid, *descendants(pid)}
        postmaster = int((home / "postgres" / "postmaster.pid").read_text().split()[0])
        processes |= {postmaster, *descendants(postmaster)}
        assert len(processes) > 4  # the three services, vLLM's engine processes, Postgres
    finally:
        code = stack.stop()
    assert code == 0, "".join(stack.output)
    assert not [pid for pid in processes if _alive(pid)], "processes outlived agentgw up"
    assert all(_free(port) for port in stack.ports.values())
    assert not (home / "connection.json").exists()
    assert not (home / "postgres" / "postmaster.pid").exists()  # no stale lock
    down = stack.healthcheck(stack.ports["GATEWAY"])
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def test_a_second_up_reuses_the_data_and_the_doctor_names_what_is_off(tmp_path):
    home = tmp_path / "home"
    first = Up(home)
    try:
        first.wait_for("Ctrl-C drains and stops everything")
        session = json.loads(first.cli("chat", "--json", "--max-tokens", "2", "Remember me.").stdout.splitlines()[-1])
    finally:
        assert first.stop() == 0

    # Same data, but the two latency features this checks switched off; and two inference replicas.
    second = Up(home, "--inference-replicas", "2", AGW_INFERENCE_ENABLE_PREFIX_CACHING="0",
                AGW_RETRIEVAL_TRIM_PAYLOADS="0")
    try:
        second.wait_for("Ctrl-C drains and stops everything")
        assert "sample corpus" not in "".join(second.output)  # ingested once, kept
        history = second.cli("chat", "--json", "--max-tokens", "2", "--session", session["final"]["sessionId"],
                             "And now?")
        assert history.returncode == 0, history.stderr  # the session survived the restart

        doctor = second.cli("doctor")
        assert doctor.returncode == 2, doctor.stdout
        failed = [line for line in doctor.stdout.splitlines() if line.startswith("FAIL")]
        assert any("prefix caching on" in line for line in failed), doctor.stdout
        assert any("Search payloads trimmed" in line for line in failed), doctor.stdout
        assert "AGW_INFERENCE_ENABLE_PREFIX_CACHING" in doctor.stdout and "AGW_RETRIEVAL_TRIM_PAYLOADS" in doctor.stdout
        # Both replicas serve, and the gateway routes across them.
        assert "  inference-2 service on port" in "".join(second.output)
        for name in ("inference-1", "inference-2"):
            assert any(line.startswith("PASS  replica " + name) and "routable" in line
                       for line in doctor.stdout.splitlines()), doctor.stdout
        assert "affinity: inference-1 " in doctor.stdout and " / inference-2 " in doctor.stdout
    finally:
        assert second.stop() == 0


def test_up_with_the_edge_serves_the_public_port_through_envoy_and_stops_clean(tmp_path):
    from agent.gateway.v1 import gateway_pb2
    from agent.retrieval.v1 import retrieval_pb2
    from servicekit.passthrough import unwrap

    home = tmp_path / "home"
    stack = Up(home, "--edge")
    try:
        stack.wait_for("Ctrl-C drains and stops everything")
        printed = "".join(stack.output)
        assert f"  edge (Envoy) on port {stack.ports['GATEWAY']}, the gateway behind it on" in printed
        connection = json.loads((home / "connection.json").read_text())
        assert connection["gateway"] == f"127.0.0.1:{stack.ports['GATEWAY']}" and "edge" in connection["pids"]

        chat = stack.cli("chat", "--json", "--max-tokens", "4", "What does the with statement do?")  # via the gateway
        assert chat.returncode == 0, chat.stderr
        assert json.loads(chat.stdout.splitlines()[-1])["final"]["usage"]["completionTokens"] == 4

        # Retrieve through the edge goes to the retrieval service itself, scoped to the tenant's "docs".
        import grpc
        from servicekit.tls import ClientTls

        credentials = ClientTls.for_identity(home / "tls", "tenant/dev").credentials()
        with grpc.secure_channel(connection["gateway"], credentials) as channel:
            retrieve = channel.unary_unary("/agent.gateway.v1.AgentGateway/Retrieve",
                                           request_serializer=gateway_pb2.RetrieveRequest.SerializeToString)
            answer = retrieve(gateway_pb2.RetrieveRequest(request=retrieval_pb2.SearchRequest(
                collection="docs", text="the with statement", top_k=2)), timeout=30)
        assert len(retrieval_pb2.SearchResponse.FromString(unwrap(1, answer)).results) == 2
        edge_log = (home / "run" / "edge" / "service.log").read_text()
        assert "error" not in edge_log.lower(), edge_log

        doctor = stack.cli("doctor")
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        processes = {pid for pid in connection["pids"].values()}
    finally:
        code = stack.stop()
    assert code == 0, "".join(stack.output)
    assert not [pid for pid in processes if _alive(pid)], "processes outlived agentgw up"
    assert _free(stack.ports["GATEWAY"])
