"""SMG as a streaming peer: vLLM's own gRPC server, called direct and through the Shepherd Model Gateway.

`bench/gateway_overhead.py --smg` runs this block after its own, with our
inference service stopped, so the two engines never spin at the same time (on
this machine two engines taking turns stalled about 1 s per request).

- The engine is vLLM's gRPC server (`python -m vllm.entrypoints.launchers.grpc_server`,
  the `smg-grpc-servicer` package), started with the engine arguments our
  inference service plans on this machine (`inference.engine_plan`), so both
  engines are the same but for the service around them.
- SMG (`smg launch`, the `smg` wheel) routes to it over gRPC and serves the
  OpenAI HTTP API; its streams are server-sent events of text, detokenized in
  SMG. Its front is TLS (the dev PKI's server certificate; SMG verifies no
  client certificate) and its hop to vLLM is plaintext: vLLM's gRPC server
  binds an insecure port only. Our path is mTLS on both hops.
- Direct: the same request as `GenerateRequest(text=..., stream=True)` on
  vLLM's gRPC API (token ids back, no text).

So SMG's "added" latency includes what its HTTP front costs against gRPC:
that is the price of its API, which an agent platform would pay.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import harness  # noqa: F401 - puts the repository on sys.path when run from bench/

from servicekit.procfs import descendants
from tests.support.servers import free_port

PROMPT = "Benchmark the hop."


def check_installed() -> None:
    """Exit with the install command when SMG or vLLM's gRPC servicer is missing (they are not in `dev`)."""
    import importlib.util

    missing = [name for name in ("smg", "smg_grpc_servicer", "smg_grpc_proto") if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"--smg needs {', '.join(missing)}: pip install -e '.[cpu,dev,peers]'")


def engine_flags(home: Path, kv_cache_gib: float, stream_interval: int | None) -> tuple[str, list[str]]:
    """The model folder and vLLM CLI flags for the engine our inference service plans here."""
    from inference.engine import detect_platform, resolve_model
    from inference.engine_plan import ModelShape, plan_engine
    from inference.settings import InferenceSettings

    settings = InferenceSettings(home=home, kv_cache_gib=kv_cache_gib, stream_interval=stream_interval or 1)
    model = resolve_model(settings)
    plan = plan_engine(settings, detect_platform(), model, ModelShape.from_folder(Path(model), settings.dtype))
    flags = []
    for key, value in plan.engine_args.items():
        option = "--" + key.replace("_", "-")
        if isinstance(value, dict) or value is None:  # structured outputs: not on this path
            continue
        if isinstance(value, bool):
            flags.append(option if value else "--no-" + option[2:])
        else:
            flags += [option, str(value)]
    return model, flags


def start_vllm_grpc(root: Path, flags: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.launchers.grpc_server", "--host", "127.0.0.1",
               "--port", str(port), "--disable-log-stats", *flags]
    process = subprocess.Popen(command, stdout=(root / "vllm-grpc.log").open("wb"), stderr=subprocess.STDOUT)
    return process, port


def start_smg(root: Path, model: str, worker_port: int, tls: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", f"grpc://127.0.0.1:{worker_port}", "--model-path", model,
               "--tls-cert-path", str(tls / "service/gateway/cert.pem"),
               "--tls-key-path", str(tls / "service/gateway/key.pem"), "--log-level", "warn"]
    process = subprocess.Popen(command, stdout=(root / "smg.log").open("wb"), stderr=subprocess.STDOUT)
    return process, port


def _client_ssl(tls: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(tls / "ca.pem"))
    context.check_hostname = False  # the dev server certificate names localhost; we dial 127.0.0.1
    return context


def wait_smg(port: int, model: str, tls: Path, process: subprocess.Popen, timeout_s: float = 600) -> None:
    """Until SMG lists the model (its worker registered) and completes one request."""
    deadline = time.monotonic() + timeout_s
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1}).encode()
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"smg exited with {process.returncode}")
        try:
            request = urllib.request.Request(f"https://127.0.0.1:{port}/v1/completions", body,
                                             {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=10, context=_client_ssl(tls)) as response:
                if response.status == 200:
                    return
        except OSError:  # not listening yet, or 503 while its worker registers
            pass
        time.sleep(1)
    raise TimeoutError(f"smg not ready in {timeout_s:.0f} s")


async def wait_vllm(port: int, process: subprocess.Popen, timeout_s: float = 900) -> None:
    """Until vLLM's gRPC server answers its own health check (after model load and warm-up)."""
    import grpc
    from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM's gRPC server exited with {process.returncode}")
            try:
                reply = await stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=5)
                if reply.healthy:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(1)
    raise TimeoutError(f"vLLM's gRPC server not ready in {timeout_s:.0f} s")


def smg_paths(vllm_port: int, smg_port: int, model: str, tls: Path, max_tokens: int, connections: int):
    """``{path: [call, ...]}``: each call streams one completion and returns the messages it received.

    Returns the paths and an async closer for their connections.
    """
    import aiohttp
    import grpc
    from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

    sampling = vllm_engine_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{vllm_port}") for _ in range(connections)]
    # HTTP/1.1: a connection per stream in flight, as SMG's OpenAI clients use it.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=_client_ssl(tls)))
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    url = f"https://127.0.0.1:{smg_port}/v1/completions"
    counter = iter(range(1 << 62))

    def direct(channel):
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        async def call() -> int:
            request = vllm_engine_pb2.GenerateRequest(request_id=f"bench-{next(counter)}", text=PROMPT,
                                                      sampling_params=sampling, stream=True)
            count = 0
            async for _ in stub.Generate(request, timeout=60):
                count += 1
            return count
        return call

    async def through_smg() -> int:
        count = 0
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=60)) as response:
            response.raise_for_status()
            async for line in response.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    count += 1
        return count

    async def close() -> None:
        await session.close()
        for channel in channels:
            await channel.close()

    return {"direct": [direct(ch) for ch in channels], "smg": [through_smg] * connections}, close


def smg_block(root: Path, tls: Path, *, kv_cache_gib: float, stream_interval: int | None, connections: int,
              max_tokens: int, measure) -> list[dict]:
    """Start vLLM's gRPC server and SMG, and ``measure(paths, meter_groups)`` them; stop both after."""
    home = root / "home"
    model, flags = engine_flags(home, kv_cache_gib, stream_interval)
    vllm, vllm_port = start_vllm_grpc(root, flags)
    smg = None
    try:
        asyncio.run(wait_vllm(vllm_port, vllm))
        smg, smg_port = start_smg(root, model, vllm_port, tls)
        wait_smg(smg_port, model, tls, smg)
        groups = {
            "smg": lambda: [smg.pid, *descendants(smg.pid)],
            "inference": lambda: [vllm.pid],
            "engine": lambda: sorted(descendants(vllm.pid)),
        }

        async def run() -> list[dict]:
            paths, close = smg_paths(vllm_port, smg_port, model, tls, max_tokens, connections)
            try:
                return await measure(paths, groups)
            finally:
                await close()
        return asyncio.run(run())
    finally:
        engine = descendants(vllm.pid)  # vLLM's EngineCore: stopped with its server, killed if it stays
        for process in (smg, vllm):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
        for pid in engine:
            subprocess.run(["kill", "-9", str(pid)], check=False, capture_output=True)
