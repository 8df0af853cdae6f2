#!/usr/bin/env python3
"""The first request after start-up, with and without the warm-up.

Root cause addressed: a cold tokenizer and engine (the analysis: 296 ms on the
first request). Starts the inference service with AGW_INFERENCE_WARMUP off and
on, alternately, and times the first request a client sends once health says
SERVING, then the following ones.

    python bench/inference_warmup.py [--starts 3] [--json bench/out/warmup.json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from harness import command_line, dev_pki, inference_process, print_table, scratch_dir, write_json

from agent.inference.v1 import inference_pb2 as pb
from agent.inference.v1 import inference_pb2_grpc
from servicekit import ChannelSpec, ClientTls, open_channel, wait_ready

PROMPT = [
    pb.ChatMessage(role=pb.ROLE_SYSTEM, content="You answer questions about Python."),
    pb.ChatMessage(role=pb.ROLE_USER, content="How does the with statement work?"),
]


async def first_requests(port: int, tls_dir: Path, count: int) -> list[float]:
    spec = ChannelSpec(target=f"127.0.0.1:{port}", tls=ClientTls.for_identity(tls_dir, "operator/admin"))
    async with open_channel(spec) as channel:
        await wait_ready(channel, timeout_s=10, target="inference")  # the connection is not what we time
        stub = inference_pb2_grpc.InferenceStub(channel)
        await stub.GetLoad(pb.GetLoadRequest(), timeout=5)  # nor the client's own first RPC
        times = []
        for index in range(count):
            request = pb.GenerateRequest(
                chat=pb.ChatMessages(messages=[*PROMPT, pb.ChatMessage(role=pb.ROLE_USER, content=f"Case {index}.")]),
                sampling=pb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
            )
            started = time.perf_counter()
            first = None
            async for message in stub.Generate(request, timeout=60):
                if first is None and message.token_ids:
                    first = (time.perf_counter() - started) * 1000
            times.append(first)
        return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=3, help="service starts per mode (default 3)")
    parser.add_argument("--requests", type=int, default=11, help="requests timed after each start")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    root = scratch_dir("warmup")
    tls_dir = dev_pki(root)
    runs: dict[str, list[list[float]]] = {"off": [], "on": []}
    for start in range(args.starts):
        for mode in ("off", "on"):
            service = inference_process(
                root, tls_dir, f"inference-{mode}-{start}",
                AGW_INFERENCE_KV_CACHE_GIB="1", AGW_INFERENCE_WARMUP="true" if mode == "on" else "false",
            )
            try:
                port = service.wait_serving()
                runs[mode].append(asyncio.run(first_requests(port, tls_dir, args.requests)))
            finally:
                service.stop()

    rows, stats = [], {}
    for mode, samples in runs.items():
        firsts = [s[0] for s in samples]
        seconds = [s[1] for s in samples]
        steady = [t for s in samples for t in s[2:]]
        stats[mode] = {"first_ms": firsts, "second_ms": seconds, "steady_p50_ms": statistics.median(steady)}
        rows.append({"warm-up": mode, "starts": len(samples), "1st request (median)": statistics.median(firsts),
                     "1st (max)": max(firsts), "2nd (median)": statistics.median(seconds),
                     "steady p50": statistics.median(steady)})
    print_table("time to first token after SERVING, ms (client, over mTLS gRPC)", rows,
                ["warm-up", "starts", "1st request (median)", "1st (max)", "2nd (median)", "steady p50"])
    extra = statistics.median(stats["off"]["first_ms"]) - stats["off"]["steady_p50_ms"]
    extra_on = statistics.median(stats["on"]["first_ms"]) - stats["on"]["steady_p50_ms"]
    print(f"\nfirst-request penalty over steady state: {extra:.1f} ms without warm-up, {extra_on:.1f} ms with it")
    print(f"command: {command_line()}")
    write_json(args.json, {"stats": stats, "penalty_off_ms": extra, "penalty_on_ms": extra_on})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
