#!/usr/bin/env python3
"""What one store operation costs the gateway: the pool's acquire, a query and the release, as configured before
and since 2026-12-05.

Every Chat turn reads its history and stores its messages through the
gateway's asyncpg pool. Until 2026-12-05 each operation also paid for:

- asyncpg's reset query on release (``SELECT pg_advisory_unlock_all(); CLOSE
  ALL; UNLISTEN *; RESET ALL;``), a round trip inside the operation's latency,
  though the gateway leaves no session state to reset;
- the OpenTelemetry asyncpg instrumentation's span per query, also where the
  process records none (no collector, no trace file: the services' default).

This runs the same operation (``Database.run`` of a one-row ``fetchrow``
through the primary key, as a turn's history read does) on two pools against
the same Postgres, in alternating rounds so that the host's noise falls on
both: ``before`` (asyncpg's own connection class, the instrumentation on) and
``gateway`` (``gateway.database.open_database`` as the gateway opens it now).
The tracer provider is the one the services install without a collector. It
reports the latency p50/p99 and this process's CPU per operation (the
gateway's side of it), at one operation at a time and at ``--concurrency``.

    python bench/postgres_pool.py [--database-url URL] [--ops 2000] [--rounds 6] [--concurrency 8]
        [--json bench/out/postgres-pool.json]

Without ``--database-url`` (or ``AGW_TEST_DATABASE_URL``) a private server from
the pgserver wheel is started.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from contextlib import AsyncExitStack
from pathlib import Path

import asyncpg
import uvloop
from harness import command_line, print_table, scratch_dir, summary, write_json
from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor

from gateway.database import Database, open_database
from servicekit.telemetry import configure_tracing

QUERY = "SELECT id, tenant FROM agw_sessions WHERE id = $1 AND tenant = $2"


async def _round(database: Database, session: uuid.UUID, ops: int, concurrency: int) -> tuple[list[float], float]:
    """Latencies (µs) of ``ops`` operations, ``concurrency`` at a time, and this process's CPU µs per operation."""
    latencies: list[float] = []

    async def worker(count: int) -> None:
        for _ in range(count):
            started = time.perf_counter()
            await database.run(lambda c: c.fetchrow(QUERY, session, "bench"))
            latencies.append((time.perf_counter() - started) * 1e6)

    cpu = time.process_time()
    await asyncio.gather(*(worker(ops // concurrency) for _ in range(concurrency)))
    return latencies, (time.process_time() - cpu) * 1e6 / len(latencies)


async def measure(url: str, ops: int, rounds: int, levels: list[int]) -> list[dict]:
    instrumentor = AsyncPGInstrumentor()
    async with AsyncExitStack() as stack:
        # The gateway's pool first (it migrates the schema); the 'before' pool: asyncpg's defaults otherwise equal.
        gateway = await stack.enter_async_context(open_database(
            url, min_size=max(levels), max_size=max(levels), acquire_timeout_s=5, command_timeout_s=5,
            statement_cache_size=100))
        pool = await asyncpg.create_pool(url, min_size=max(levels), max_size=max(levels), command_timeout=5,
                                         statement_cache_size=100)
        stack.push_async_callback(pool.close)
        before = Database(pool, acquire_timeout_s=5, command_timeout_s=5)
        session = uuid.uuid4()
        await gateway.run(lambda c: c.execute("INSERT INTO agw_sessions (id, tenant) VALUES ($1, 'bench')", session))
        variants = {"before": (before, True), "gateway": (gateway, False)}
        rows = []
        for concurrency in levels:
            samples = {name: ([], []) for name in variants}
            for index in range(rounds + 1):  # the first round warms both up and is not counted
                for name, (database, instrumented) in variants.items():
                    if instrumented:
                        instrumentor.instrument()
                    latencies, cpu = await _round(database, session, ops, concurrency)
                    if instrumented:
                        instrumentor.uninstrument()
                    if index:
                        samples[name][0].extend(latencies)
                        samples[name][1].append(cpu)
            for name, (latencies, cpu) in samples.items():
                rows.append({"variant": name, "concurrency": concurrency, "latency_us": summary(latencies),
                             "cpu_us_per_op": statistics.median(cpu), "cpu_us_per_op_rounds": cpu})
        await gateway.run(lambda c: c.execute("DELETE FROM agw_sessions WHERE id = $1", session))
        return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("AGW_TEST_DATABASE_URL"))
    parser.add_argument("--ops", type=int, default=2000, help="operations per variant per round")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds counted (one more warms up)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    configure_tracing("bench")  # as a service without a collector: spans are not recorded
    server = None
    url = args.database_url
    if not url:
        import pgserver

        server = pgserver.get_server(scratch_dir("postgres-pool") / "postgres", cleanup_mode="stop")
        url = server.get_uri()
    try:
        rows = uvloop.run(measure(url, args.ops, args.rounds, args.concurrency))
    finally:
        if server is not None:
            server.cleanup()
    table = []
    for row in rows:
        base = next(r for r in rows if r["variant"] == "before" and r["concurrency"] == row["concurrency"])
        table.append({"conc": row["concurrency"], "pool": row["variant"],
                      "p50 us": row["latency_us"]["p50"], "p99 us": row["latency_us"]["p99"],
                      "cpu us/op": row["cpu_us_per_op"],
                      "p50 vs before": row["latency_us"]["p50"] / base["latency_us"]["p50"],
                      "cpu vs before": row["cpu_us_per_op"] / base["cpu_us_per_op"]})
    print_table("a store operation (acquire, one-row fetch by key, release): asyncpg's reset and the query "
                "instrumentation (before) against the gateway's pool", table,
                ["conc", "pool", "p50 us", "p99 us", "cpu us/op", "p50 vs before", "cpu vs before"])
    print(f"command: {command_line()}")
    write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
