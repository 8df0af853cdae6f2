#!/usr/bin/env python3
"""What gRPC core's opt-in experiments (``GRPC_EXPERIMENTS``) do to a grpc.aio hop's cost per message.

A Chat turn costs the gateway about what a bare grpc.aio hop costs per
message, times the turn's 34 messages (docs/benchmarks.md, "The gateway
under load"): the kernel's side of each write and read, and gRPC's C core,
not our Python. grpcio ships experiments that its own rollout leaves off
(src/core/lib/experiments/rollouts.yaml), some aimed at exactly that:
fewer wake-ups on reads (``tcp_rcv_lowat``), no lock around TLS framing
(``tsi_frame_protector_without_locks``), pollset-free code paths
(``pollset_alternative``). This bench says whether any of them is worth
setting before any service is configured with it.

One backend (bench/grpc_hop_stacks.py's unary echo, and its paced
``Generate`` stand-in: ``--messages`` messages of 40 bytes, ``--gap-ms``
apart, like an engine's decode steps) and one bare grpc.aio proxy on uvloop
per variant, each its own process with ``GRPC_EXPERIMENTS`` set to the
variant (``default`` sets nothing); every hop mTLS. In each round every
proxy is measured back to back, in an order that changes from round to
round (harness.round_order): unary calls at c=1 (latency, proxy CPU per
call), then streams at ``--stream-concurrency`` (proxy CPU per message
forwarded). CPU is every
proxy thread's on-CPU time (``/proc/<pid>/task/*/schedstat``). Each figure
is the median over rounds, with its ratio to the default's.

    python bench/grpc_experiments.py [--variants "default;tcp_rcv_lowat;..."] [--rounds 6] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import grpc
from grpc_hop_stacks import METHOD, PAYLOAD, STREAMED, channel_credentials, start_backend, start_bare_proxy, \
    stream_request
from harness import command_line, dev_pki, print_table, round_order, scratch_dir, summary, write_json

from servicekit.procfs import thread_cpu_s
from tests.support.servers import free_port

#: Off in grpcio's rollout, and about a connection's per-message work (the rest are features or memory).
VARIANTS = ("default", "tcp_rcv_lowat", "tsi_frame_protector_without_locks", "pollset_alternative",
            "tcp_frame_size_tuning", "use_call_event_engine_in_completion_queue", "-event_engine_callback_cq")


def _identity(value: bytes) -> bytes:
    return value


def _proxy_cpu_s(pid: int) -> float:
    return sum(thread_cpu_s(pid).values())


async def _round(port: int, pid: int, tls: Path, args) -> dict[str, float]:
    """One variant's unary calls at c=1 and streams at ``args.stream_concurrency``: latencies, and the
    proxy's CPU per call and per message (the caller turns CPU seconds into those)."""
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", channel_credentials(tls, "tenant/dev")) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        unary = channel.unary_unary(METHOD, request_serializer=_identity, response_deserializer=_identity)
        stream = channel.unary_stream(STREAMED, request_serializer=_identity, response_deserializer=_identity)
        request = stream_request(args.messages, args.gap_ms)

        async def one_stream() -> int:
            return sum([1 async for _ in stream(request, timeout=60)])

        for _ in range(20):  # the connection and its code paths warm
            await unary(PAYLOAD, timeout=10)
            await one_stream()
        latencies: list[float] = []
        before = _proxy_cpu_s(pid)
        for _ in range(args.calls):
            started = time.perf_counter()
            await unary(PAYLOAD, timeout=10)
            latencies.append((time.perf_counter() - started) * 1000)
        unary_cpu = _proxy_cpu_s(pid) - before
        streams = iter(range(args.streams))
        received = 0

        async def worker() -> None:
            nonlocal received
            for _ in streams:
                count = await one_stream()  # not `received += await ...`: that reads the total before awaiting
                received += count
        before = _proxy_cpu_s(pid)
        await asyncio.gather(*(worker() for _ in range(args.stream_concurrency)))
        return {"unary_p50_ms": summary(latencies)["p50"], "us_per_call": unary_cpu / args.calls * 1e6,
                "us_per_message": (_proxy_cpu_s(pid) - before) / received * 1e6}


def _environment(variant: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "GRPC_EXPERIMENTS"}
    return env if variant == "default" else {**env, "GRPC_EXPERIMENTS": variant}


def measure(args, tls: Path) -> list[dict]:
    backend_port = free_port()
    backend = start_backend(backend_port, tls)
    proxies = {}
    try:
        for variant in args.variants:
            port = free_port()
            proxies[variant] = port, start_bare_proxy(port, tls, backend_port, backend_port, _environment(variant))
        figures: dict[str, list[dict]] = {variant: [] for variant in args.variants}
        for round_ in range(args.rounds):
            for variant in round_order(args.variants, round_):
                port, process = proxies[variant]
                figures[variant].append(asyncio.run(_round(port, process.pid, tls, args)))
    finally:
        for process in [backend, *(process for _, process in proxies.values())]:
            process.terminate()
            process.wait()
    medians = {variant: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
               for variant, runs in figures.items()}
    base = medians[args.variants[0]]
    return [{"variant": variant, **m, "per_call_vs_first": m["us_per_call"] / base["us_per_call"],
             "per_message_vs_first": m["us_per_message"] / base["us_per_message"],
             "us_per_message_rounds": [round(r["us_per_message"], 1) for r in figures[variant]]}
            for variant, m in medians.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", type=lambda text: text.split(";"), default=list(VARIANTS),
                        help="GRPC_EXPERIMENTS values, ';' between them; the first is the baseline")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=400, help="unary calls at c=1, per variant and round")
    parser.add_argument("--streams", type=int, default=200, help="streams per variant and round")
    parser.add_argument("--stream-concurrency", type=int, default=8)
    parser.add_argument("--messages", type=int, default=16, help="messages a stream")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="between a stream's messages at the backend")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = measure(args, dev_pki(scratch_dir("grpc-experiments")))
    print_table(f"a bare grpc.aio hop (uvloop, mTLS) per GRPC_EXPERIMENTS variant; medians of {args.rounds} rounds; "
                f"streams at c={args.stream_concurrency}, {args.messages} messages {args.gap_ms:g} ms apart", rows,
                ["variant", "unary_p50_ms", "us_per_call", "per_call_vs_first", "us_per_message",
                 "per_message_vs_first", "us_per_message_rounds"])
    print(f"command: {command_line()}")
    write_json(args.json, {"rows": rows, "variants": args.variants})


if __name__ == "__main__":
    main()
