#!/usr/bin/env python3
"""gRPC alone after idleness: unary round trips on loopback, in one process, after 0-5 s asleep.

The reproducer for bench/idle_gap.py's finding, without our services, models
or TLS: a grpc.aio server and client (health Check, plaintext) in one
process. Each sample is 20 round trips; it reports p50 wall time and this
process's CPU time per sample, after each gap, and the same for a plain
Python loop of similar size as the control (does the machine alone slow down
after a pause?).

With ``--tick-ms N`` the gRPC rows are measured twice: as above, and with a
keep-warm tick (one health Check every N ms) through each gap, to ask whether
a pause costs what it does because the path goes cold, and what keeping it
warm costs (the tick's CPU per second of idleness is reported).

    python bench/grpc_idle.py [--loop uvloop|asyncio] [--samples 7] [--tick-ms 100] [--json bench/out/grpc_idle.json]
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


async def _pause(gap: float, tick_s: float | None, stub) -> None:
    """Sleep ``gap`` seconds; with a tick, one health Check every ``tick_s`` of it."""
    if not tick_s:
        await asyncio.sleep(gap)
        return
    end = time.perf_counter() + gap
    while (left := end - time.perf_counter()) > 0:
        await asyncio.sleep(min(tick_s, left))
        if end - time.perf_counter() > 0:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)


async def _idle_cpu_ms_per_s(tick_s: float | None, stub, seconds: float = 3.0) -> float:
    """This process's CPU per second of idleness, with or without the tick."""
    cpu = time.process_time()
    await _pause(seconds, tick_s, stub)
    return (time.process_time() - cpu) * 1000 / seconds


async def _grpc_rows(samples: int, tick_s: float | None = None) -> dict[float, list[tuple[float, float]]]:
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
                    await _pause(gap, tick_s, stub)
                    rows[gap].append(await sample())
            rows["idle CPU ms/s"] = await _idle_cpu_ms_per_s(tick_s, stub)
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
    parser.add_argument("--tick-ms", type=float, help="also measure with a keep-warm health Check every N ms")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    run = asyncio.run
    if args.loop == "uvloop":
        import uvloop

        run = uvloop.run
    cases = [(f"20 gRPC round trips ({args.loop})", run(_grpc_rows(args.samples)))]
    if args.tick_ms:
        cases.append((f"the same, a Check every {args.tick_ms:g} ms while idle",
                      run(_grpc_rows(args.samples, args.tick_ms / 1000))))
    cases.append(("plain Python loop", _control_rows(args.samples)))

    table, stats = [], {}
    for name, rows in cases:
        idle_cpu = rows.pop("idle CPU ms/s", None)
        base = statistics.median(wall for wall, _ in rows[GAPS[0]])
        for gap, samples in rows.items():
            wall = statistics.median(w for w, _ in samples)
            cpu = statistics.median(c for _, c in samples)
            stats.setdefault(name, {})[str(gap)] = {"wall_p50_ms": wall, "cpu_p50_ms": cpu}
            table.append({"work": name, "idle s": gap, "wall p50 ms": wall, "x no gap": wall / base, "CPU p50 ms": cpu,
                          "idle CPU ms/s": idle_cpu if gap == GAPS[0] else None})
        stats[name]["idle_cpu_ms_per_s"] = idle_cpu
    print_table("the same work after idleness", table,
                ["work", "idle s", "wall p50 ms", "x no gap", "CPU p50 ms", "idle CPU ms/s"])
    print(f"command: {command_line()}")
    write_json(args.json, {"stats": stats})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
