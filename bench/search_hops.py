#!/usr/bin/env python3
"""A Qdrant Edge search on the event loop against one handed to the store's thread, side by side.

One retrieval service per ``--inline-us`` value (``AGW_RETRIEVAL_INLINE_SEARCH_US``;
0 hands every search to the store's thread), each with the same 200-point
collection (the passthrough benches' one), all running at once. ``Search``
with a vector (no embedding) is called on each in rounds that alternate the
services, at every ``--concurrency`` level, so the host's drift falls on all
alike. Reported per service and level: p50/p95/p99 over all rounds, the median
of the rounds' p50s and its paired difference from the first service,
throughput, and the service's CPU per call (every thread's on-CPU time from
``/proc/<pid>/task/*/schedstat``). The first ``--warmup`` calls of each
service are not counted: they measure each query shape once on the thread.

    python bench/search_hops.py [--inline-us 0 100] [--concurrency 1 64] [--rounds 8] [--calls 400]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from harness import command_line, dev_pki, print_table, retrieval_process, scratch_dir, summary, write_json

from agent.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from edge_unary_paths import process_cpu_s, seed
from gateway_overhead import COLLECTION, DIM
from servicekit import ChannelSpec, ClientTls, open_channel, wait_ready
from servicekit.tenancy import physical_collection


async def _level(stub, request, concurrency: int, calls: int) -> tuple[list[float], float]:
    """``calls`` calls, ``concurrency`` at a time: their latencies (ms) and the wall time (s)."""
    latencies: list[float] = []

    async def caller(count: int) -> None:
        for _ in range(count):
            started = time.perf_counter()
            await stub.Search(request, timeout=30)
            latencies.append((time.perf_counter() - started) * 1000)

    share, extra = divmod(calls, concurrency)
    started = time.perf_counter()
    await asyncio.gather(*(caller(share + (i < extra)) for i in range(concurrency)))
    return latencies, time.perf_counter() - started


async def measure(tls: Path, services: dict[str, tuple[int, int]], levels: list[int], rounds: int, calls: int,
                  warmup: int) -> list[dict]:
    request = retrieval_pb2.SearchRequest(collection=physical_collection("dev", COLLECTION),
                                          vector=retrieval_pb2.Vector(values=[0.05] * DIM), top_k=3)
    channels = {name: open_channel(ChannelSpec(target=f"127.0.0.1:{port}",
                                               tls=ClientTls.for_identity(tls, "operator/admin")))
                for name, (port, _) in services.items()}
    stubs = {}
    for name, channel in channels.items():
        await wait_ready(channel, timeout_s=60, target=name)
        stubs[name] = retrieval_pb2_grpc.RetrievalStub(channel)
        for _ in range(warmup):
            await stubs[name].Search(request, timeout=30)
    rows = []
    for concurrency in levels:
        latencies = {name: [] for name in services}
        round_p50 = {name: [] for name in services}
        wall = dict.fromkeys(services, 0.0)
        cpu = dict.fromkeys(services, 0.0)
        for index in range(rounds):
            order = list(services) if index % 2 == 0 else list(reversed(services))
            for name in order:
                pid = services[name][1]
                used = process_cpu_s(pid)
                values, seconds = await _level(stubs[name], request, concurrency, calls)
                cpu[name] += process_cpu_s(pid) - used
                wall[name] += seconds
                latencies[name] += values
                round_p50[name].append(statistics.median(values))
        first = next(iter(services))
        for name in services:
            stats = summary(latencies[name])
            rows.append({
                "service": name, "c": concurrency, "p50": stats["p50"], "p95": stats["p95"], "p99": stats["p99"],
                "round_p50": round_p50[name],
                "p50 vs first (paired)": statistics.median(a - b for a, b in zip(round_p50[name], round_p50[first])),
                "calls/s": len(latencies[name]) / wall[name],
                "cpu us/call": cpu[name] / len(latencies[name]) * 1e6,
            })
    for channel in channels.values():
        await channel.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inline-us", type=int, nargs="+", default=[0, 100],
                        help="AGW_RETRIEVAL_INLINE_SEARCH_US of each service; the first is the baseline")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=8, help="rounds per level; each calls every service in turn")
    parser.add_argument("--calls", type=int, default=400, help="calls per service, level and round")
    parser.add_argument("--warmup", type=int, default=200, help="calls per service before the rounds")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    root = scratch_dir("search-hops")
    tls = dev_pki(root)
    processes = {f"inline {us} us": retrieval_process(root, tls, f"retrieval-{us}",
                                                      AGW_RETRIEVAL_INLINE_SEARCH_US=str(us))
                 for us in args.inline_us}
    try:
        services = {}
        for name, process in processes.items():
            services[name] = (process.wait_serving(), process.pid)
            asyncio.run(seed(tls, services[name][0]))
        rows = asyncio.run(measure(tls, services, args.concurrency, args.rounds, args.calls, args.warmup))
    finally:
        for process in processes.values():
            process.stop()
    print_table(f"Search with a vector, {args.rounds} rounds of {args.calls} calls per service and level; ms",
                rows, ["service", "c", "p50", "p95", "p99", "p50 vs first (paired)", "calls/s", "cpu us/call"])
    print(f"command: {command_line()}")
    write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
