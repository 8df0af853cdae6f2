#!/usr/bin/env python3
"""First-token time for cold prompts against prompts that share a long prefix.

Root cause addressed: the KV/prefix cache not reused (the analysis: first token
186 ms cold, 47 ms with reuse). Starts the real inference service (vLLM, the
smoke model unless AGW_MODEL is set), then alternates two kinds of prompt of
the same length:
- cold: a unique first block, so no cached block can match;
- shared: one long common prefix, then a unique question.
It reports the client's time to first token (over gRPC with mTLS) and the
engine's own, p50/p95/p99, and the cold/shared ratio.

    python bench/inference_prefix_cache.py [--n 50] [--repeats 40] [--json bench/out/prefix.json]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from pathlib import Path

from harness import command_line, dev_pki, inference_process, print_table, scratch_dir, summary, write_json

from agent.inference.v1 import inference_pb2 as pb
from agent.inference.v1 import inference_pb2_grpc
from servicekit import ChannelSpec, ClientTls, open_channel

PASSAGE = (
    "The try statement specifies exception handlers and cleanup code for a group of statements. "
    "The with statement wraps the execution of a block with methods defined by a context manager. "
)


async def one(stub, prompt: str) -> dict:
    started = time.perf_counter()
    first = None
    result = None
    async for message in stub.Generate(pb.GenerateRequest(
        prompt=prompt, sampling=pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ), timeout=60):
        if first is None and message.token_ids:
            first = (time.perf_counter() - started) * 1000
        if message.HasField("result"):
            result = message.result
    return {
        "client_ttft_ms": first,
        "engine_ttft_ms": result.timings.first_token_ms,
        "prompt_tokens": result.usage.prompt_tokens,
        "cached_tokens": result.usage.cached_prompt_tokens,
    }


def prompt_for(mode: str, base: str) -> str:
    nonce = uuid.uuid4().hex
    # Same length either way; only where the unique part sits differs.
    return f"{nonce} {base} Question?" if mode == "cold" else f"{base} Question {nonce}?"


async def measure(port: int, tls_dir: Path, n: int, warmup: int, base: str) -> dict[str, list[dict]]:
    spec = ChannelSpec(target=f"127.0.0.1:{port}", tls=ClientTls.for_identity(tls_dir, "operator/admin"))
    async with open_channel(spec) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for _ in range(warmup):
            await one(stub, prompt_for("cold", base))
            await one(stub, prompt_for("shared", base))
        samples: dict[str, list[dict]] = {"cold": [], "shared": []}
        for _ in range(n):  # alternate, so drift on a noisy machine hits both alike
            for mode in ("cold", "shared"):
                samples[mode].append(await one(stub, prompt_for(mode, base)))
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50, help="requests per kind (default 50)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=40, help="passage repeats in the prompt (40: ~1,450 tokens)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    root = scratch_dir("prefix")
    tls_dir = dev_pki(root)
    service = inference_process(root, tls_dir, "inference", AGW_INFERENCE_KV_CACHE_GIB="2")
    try:
        port = service.wait_serving()
        samples = asyncio.run(measure(port, tls_dir, args.n, args.warmup, PASSAGE * args.repeats))
    finally:
        service.stop()

    rows, stats = [], {}
    for mode, runs in samples.items():
        client = summary([r["client_ttft_ms"] for r in runs])
        engine = summary([r["engine_ttft_ms"] for r in runs])
        stats[mode] = {"client_ttft_ms": client, "engine_ttft_ms": engine,
                       "prompt_tokens": runs[0]["prompt_tokens"],
                       "cached_tokens_mean": sum(r["cached_tokens"] for r in runs) / len(runs)}
        rows.append({"prompt": mode, "n": client["n"], "prompt tok": runs[0]["prompt_tokens"],
                     "cached tok": stats[mode]["cached_tokens_mean"],
                     "client p50": client["p50"], "client p95": client["p95"], "client p99": client["p99"],
                     "engine p50": engine["p50"], "engine p95": engine["p95"]})
    print_table("time to first token, ms (inference service over mTLS gRPC)", rows,
                ["prompt", "n", "prompt tok", "cached tok", "client p50", "client p95", "client p99", "engine p50", "engine p95"])
    ratio_client = stats["cold"]["client_ttft_ms"]["p50"] / stats["shared"]["client_ttft_ms"]["p50"]
    ratio_engine = stats["cold"]["engine_ttft_ms"]["p50"] / stats["shared"]["engine_ttft_ms"]["p50"]
    print(f"\ncold/shared p50 ratio: client {ratio_client:.1f}x, engine {ratio_engine:.1f}x")
    print(f"command: {command_line()}")
    write_json(args.json, {"stats": stats, "ratio_client_p50": ratio_client, "ratio_engine_p50": ratio_engine})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
