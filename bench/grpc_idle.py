#!/usr/bin/env python3
"""gRPC alone after idleness: unary round trips on loopback, in one process, after 0-5 s asleep.

The reproducer for bench/idle_gap.py's finding, without our services, models
or TLS: a grpc.aio server and client (health Check, plaintext) in one
process. Each sample is 20 round trips; it reports p50 wall time and this
process's CPU time per sample, after each gap, and the same for a plain
Python loop of similar size as the control (does the machine alone slow down
after a pause?).

    python bench/grpc_idle.py [--loop uvloop|asyncio] [--samples 7] [--json bench/out/grpc_idle.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from harness import command_line, print_table, write_json

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

GAPS = (0.0, 0.2, 1.0, 2.0, 5.0)
CONTROL_DATA = {f"k{i}": list(range(20)) for i in range(200)}


def _timed(work) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    work()
    return (time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000


async def _grpc_rows(samples: int) -> dict[float, list[tuple[float, float]]]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def sample() -> tuple[float, float]:
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(20):
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                return (time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000

            for _ in range(50):
                await sample()
            rows = {}
            for gap in GAPS:
                rows[gap] = []
                for _ in range(samples):
                    await asyncio.sleep(gap)
                    rows[gap].append(await sample())
            return rows
    finally:
        await server.stop(None)


def _control_rows(samples: int) -> dict[float, list[tuple[float, float]]]:
    def work():
        for _ in range(30):
            json.loads(json.dumps(CONTROL_DATA))

    for _ in range(20):
        _timed(work)
    rows = {}
    for gap in GAPS:
        rows[gap] = []
        for _ in range(samples):
            time.sleep(gap)
            rows[gap].append(_timed(work))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--samples", type=int, default=7, help="samples per gap")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.loop == "uvloop":
        import uvloop

        grpc_rows = uvloop.run(_grpc_rows(args.samples))
    else:
        grpc_rows = asyncio.run(_grpc_rows(args.samples))
    control_rows = _control_rows(args.samples)

    table, stats = [], {}
    for name, rows in ((f"20 gRPC round trips ({args.loop})", grpc_rows), ("plain Python loop", control_rows)):
        base = statistics.median(wall for wall, _ in rows[GAPS[0]])
        for gap, samples in rows.items():
            wall = statistics.median(w for w, _ in samples)
            cpu = statistics.median(c for _, c in samples)
            stats.setdefault(name, {})[str(gap)] = {"wall_p50_ms": wall, "cpu_p50_ms": cpu}
            table.append({"work": name, "idle s": gap, "wall p50 ms": wall, "x no gap": wall / base, "CPU p50 ms": cpu})
    print_table("the same work after idleness", table, ["work", "idle s", "wall p50 ms", "x no gap", "CPU p50 ms"])
    print(f"command: {command_line()}")
    write_json(args.json, {"stats": stats})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
