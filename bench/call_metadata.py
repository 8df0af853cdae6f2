#!/usr/bin/env python3
"""What one metadata entry costs a grpc.aio caller: CPU per unary call with and without a W3C traceparent.

Why it matters: the gateway attaches its trace context to every backend call,
also where it records no span (nothing exports them), and then the context
only tells the backend not to record either. The gateway's share of a unary
call is a few hundred microseconds over a bare grpc.aio hop
(`bench/gateway_overhead.py --bare`). `bench/grpc_hop_stacks.py`'s
`aio_metadata` hop put the metadata within that bench's noise (tens of µs of
a whole proxy's CPU); this isolates the caller's side to a few µs.

A server (the health service, answering at once) runs in a child process on
loopback; this process is the caller, on uvloop as the gateway is, and reads
its own CPU time (``time.process_time``) over each round of calls. The two
variants alternate round by round, so the host's noise falls on both.

    python bench/call_metadata.py [--calls 4000] [--concurrency 16] [--rounds 9] [--json bench/out/call-metadata.json]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
from pathlib import Path

import grpc
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import command_line, print_table, write_json

TRACEPARENT = (("traceparent", "00-0123456789abcdef0123456789abcdef-0123456789abcdef-00"),)
VARIANTS = {"no metadata": None, "one traceparent entry": TRACEPARENT}


class _Serving(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _serve(ports: multiprocessing.Queue) -> None:
    async def run() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(_Serving(), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    uvloop.run(run())


async def _rounds(port: int, calls: int, concurrency: int, rounds: int) -> dict[str, list[float]]:
    """CPU microseconds per call of this process, per round, for each variant."""
    request = health_pb2.HealthCheckRequest()
    per_worker = calls // concurrency
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        async def run(metadata) -> float:
            async def worker() -> None:
                for _ in range(per_worker):
                    await stub.Check(request, timeout=5, metadata=metadata)

            started = time.process_time()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return (time.process_time() - started) * 1e6 / (per_worker * concurrency)

        for metadata in VARIANTS.values():  # warm the channel and both paths
            await run(metadata)
        results: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for index in range(rounds):
            order = list(VARIANTS.items()) if index % 2 == 0 else list(reversed(VARIANTS.items()))
            for name, metadata in order:
                results[name].append(await run(metadata))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000, help="calls per round and variant")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ports: multiprocessing.Queue = multiprocessing.Queue()
    server = multiprocessing.Process(target=_serve, args=(ports,), daemon=True)
    server.start()
    try:
        results = uvloop.run(_rounds(ports.get(timeout=30), args.calls, args.concurrency, args.rounds))
    finally:
        server.terminate()
    base = statistics.median(results["no metadata"])
    rows = [{"variant": name, "caller cpu us/call p50": statistics.median(values), "min": min(values),
             "max": max(values), "added us/call": statistics.median(values) - base} for name, values in results.items()]
    print_table(f"grpc.aio caller on uvloop, loopback, c={args.concurrency}, {args.rounds} alternating rounds of "
                f"{args.calls} calls", rows, ["variant", "caller cpu us/call p50", "min", "max", "added us/call"])
    print(f"command: {command_line()}")
    write_json(args.json, {"rounds": results, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
