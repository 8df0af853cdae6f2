#!/usr/bin/env python3
"""A soak: `agentgw load` at a moderate rate for minutes, while each process's resources are sampled.

Starts the stack (inference on the smoke model, retrieval on Qdrant Edge, a
private Postgres, one gateway worker), ingests a small collection, then runs
open-loop agent turns (`agentgw load`'s synthetic traffic) and every
`--sample-every` seconds reads, for the gateway, inference and retrieval
processes, RSS, open file descriptors and threads (/proc), each one's asyncio
tasks (the gateway's from GetStats, the backends' from their Prometheus
endpoints), and the gateway's Postgres pool's open connections and backend
channels. After the warm-up (the first fifth of the run), RSS
must not grow by more than 5% or 20 MiB, whichever is larger, and once the
load stops, every process's descriptors and tasks and the gateway's
connections must be back within ±2 of their idle level before the load.
Prints the samples and the verdict; exits 1 if it fails.

    python bench/soak.py [--duration 600] [--rate 4] [--sample-every 10] [--json bench/out/soak.json]

`soak()` is also what tests/faults/test_soak.py runs for 60 seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from argparse import Namespace
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness import (backend_processes, command_line, dev_pki, gateway_process, print_table, scrape, scratch_dir,
                     write_json)

from agent.gateway.v1 import gateway_pb2 as pb
from agent.gateway.v1 import gateway_pb2_grpc
from agent.retrieval.v1 import retrieval_pb2
from agentgw.connection import Connection
from agentgw.load import run as run_load
from agentgw.load.report import summarize
from agentgw.load.workload import synthetic
from servicekit.procfs import open_fds, rss_bytes, thread_count
from tests.support.servers import free_port

RSS_GROWTH_SHARE = 0.05
RSS_GROWTH_FLOOR = 20 * 2**20
SETTLE_SLACK = 2


@dataclass
class Sample:
    at_s: float
    rss_mib: dict[str, float]
    fds: dict[str, int]
    threads: dict[str, int]
    tasks: dict[str, int]
    db_connections: int
    channels_ready: int
    gc: dict[str, dict[str, list[float]]] = field(default_factory=dict)


def asyncio_tasks(samples: dict[str, float]) -> int:
    """``agw_process_asyncio_tasks`` from a scrape; -1 if absent."""
    found = [value for name, value in samples.items() if name.startswith("agw_process_asyncio_tasks")]
    return int(found[0]) if found else -1


#: Where each figure of ``gc_pauses`` comes from (servicekit.gc_pauses), and its scale to ms.
_GC_SAMPLES = (("agw_process_gc_collections_total", 1.0), ("agw_process_gc_pause_seconds_total", 1000.0),
               ("agw_process_gc_longest_pause_seconds", 1000.0))


def gc_pauses(samples: dict[str, float]) -> dict[str, list[float]]:
    """Per generation: [collections, total pause ms, longest pause ms since start] (agw.process.gc_*)."""
    totals: dict[str, list[float]] = {}
    for name, value in samples.items():
        for index, (metric, scale) in enumerate(_GC_SAMPLES):
            if name.split("{")[0] == metric:
                generation = name.split('generation="', 1)[1].split('"', 1)[0]
                totals.setdefault(generation, [0.0, 0.0, 0.0])[index] += value * scale
    return totals


@dataclass
class Verdict:
    passed: bool
    reasons: list[str] = field(default_factory=list)


async def _sample(pids: dict[str, int], metrics_ports: dict[str, int], operator, started: float) -> Sample:
    stats = await operator.GetStats(pb.GetStatsRequest(), timeout=10)
    scraped = {name: await asyncio.to_thread(scrape, port) for name, port in metrics_ports.items()}
    tasks = {name: asyncio_tasks(found) for name, found in scraped.items() if name != "gateway"}
    return Sample(
        at_s=time.monotonic() - started,
        rss_mib={name: (rss_bytes(pid) or 0) / 2**20 for name, pid in pids.items()},
        fds={name: open_fds(pid) for name, pid in pids.items()},
        threads={name: thread_count(pid) for name, pid in pids.items()},
        tasks={"gateway": stats.asyncio_tasks, **tasks}, db_connections=stats.database.open,
        channels_ready=sum(c.state == "READY" for b in stats.backends for c in b.channels),
        gc={name: gc_pauses(found) for name, found in scraped.items()})


def judge(samples: list[Sample], settled: Sample) -> Verdict:
    """RSS growth after warm-up; descriptors, tasks and connections back to their idle level once idle.

    Counts are compared idle to idle: the first sample (the stack warmed and seeded, before the load) against
    the one after it; a sample taken during the load holds the turns then in flight."""
    warm = samples[max(1, len(samples) // 5)]
    idle = samples[0]
    verdict = Verdict(True)
    for name, start in warm.rss_mib.items():
        grown = max(s.rss_mib[name] for s in samples[samples.index(warm):]) - start
        allowed = max(RSS_GROWTH_SHARE * start, RSS_GROWTH_FLOOR / 2**20)
        if grown > allowed:
            verdict.passed = False
            verdict.reasons.append(f"{name} RSS grew {grown:.1f} MiB after warm-up (allowed {allowed:.1f})")
    checks = [(f"{name} descriptors", idle.fds[name], settled.fds[name]) for name in idle.fds]
    checks += [(f"{name} asyncio tasks", idle.tasks[name], settled.tasks[name]) for name in idle.tasks]
    checks += [("gateway Postgres connections", idle.db_connections, settled.db_connections)]
    for what, before, after in checks:
        if abs(after - before) > SETTLE_SLACK:
            verdict.passed = False
            verdict.reasons.append(f"{what}: {before} idle before the load, {after} idle after (allowed ±{SETTLE_SLACK})")
    return verdict


async def soak(connection: Connection, pids: dict[str, int], metrics_ports: dict[str, int], *, rate: float,
               duration_s: float, sample_every_s: float,
               settle_s: float = 3.0) -> tuple[list[Sample], Sample, Verdict, dict]:
    """Run the load and sample meanwhile; then let the stack idle and sample once more.

    ``metrics_ports``: Prometheus ports, for the backends' asyncio tasks (the gateway's come from GetStats) and
    every process's garbage-collection pauses.
    """
    turns = synthetic(rate=rate, duration_s=duration_s, tenants=[connection.identity], sessions_per_tenant=8,
                      retrieval_share=0.5, max_tokens=16, seed=1)
    args = Namespace(concurrency=None, think_time=0.0, collection="docs", timeout=60.0)
    async with connection.gateway_operator_channel() as channel:
        operator = gateway_pb2_grpc.AgentGatewayStub(channel)
        started = time.monotonic()
        samples = [await _sample(pids, metrics_ports, operator, started)]
        load = asyncio.ensure_future(run_load(connection, args, turns, [connection.identity]))
        while not load.done():
            await asyncio.wait({load}, timeout=sample_every_s)
            samples.append(await _sample(pids, metrics_ports, operator, started))
        results, elapsed = load.result()
        await asyncio.sleep(settle_s)
        settled = await _sample(pids, metrics_ports, operator, started)
    return samples, settled, judge(samples, settled), summarize(results, elapsed)


async def seed(connection: Connection) -> None:
    async with connection.gateway_channel() as channel:
        await gateway_pb2_grpc.AgentGatewayStub(channel).IngestDocuments(pb.IngestDocumentsRequest(
            collection="docs", documents=[retrieval_pb2.Document(id=f"d{i}", text=f"passage {i} on gateways")
                                          for i in range(20)]), timeout=120)


def report(samples: list[Sample], settled: Sample, verdict: Verdict, load: dict) -> None:
    rows = [{"t s": s.at_s, **{f"{n} MiB": v for n, v in s.rss_mib.items()},
             **{f"{n} fds": v for n, v in s.fds.items()}, **{f"{n} tasks": v for n, v in s.tasks.items()},
             "db conns": s.db_connections, "channels": s.channels_ready} for s in [*samples, settled]]
    print_table("soak: resources every sample (the last row: after the load, idle)", rows, list(rows[0]))
    print(f"load: {load['turns']} turns, statuses {load['statuses']}, first token p99 "
          f"{load['first_token_ms'].get('p99', 0):.1f} ms")
    for message, count in load["error_messages"].items():
        print(f"  {count} x {message}")
    report_gc(samples[0], settled)
    print("PASS" if verdict.passed else "FAIL: " + "; ".join(verdict.reasons))


def report_gc(before: Sample, after: Sample) -> None:
    """Garbage collections during the load (between the first sample and the settled one), per process."""
    rows = []
    for name, generations in sorted(after.gc.items()):
        for generation, (count, total_ms, longest_ms) in sorted(generations.items()):
            was = before.gc.get(name, {}).get(generation, [0.0, 0.0, 0.0])
            collections = count - was[0]
            rows.append({"process": name, "generation": generation, "collections": collections,
                         "total ms": total_ms - was[1],
                         "mean ms": (total_ms - was[1]) / collections if collections else 0.0,
                         "longest ms since start": longest_ms})
    if rows:
        print_table("garbage collection during the load (agw.process.gc_*)", rows, list(rows[0]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--sample-every", type=float, default=10.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    root = scratch_dir("soak")
    tls = dev_pki(root)
    metrics_ports = {"inference": free_port(), "retrieval": free_port(), "gateway": free_port()}
    with backend_processes(root, tls, AGW_INFERENCE_METRICS_PORT=str(metrics_ports["inference"]),
                           AGW_RETRIEVAL_METRICS_PORT=str(metrics_ports["retrieval"])) as (ports, started):
        gateway = gateway_process(root, tls, "gateway", ports, AGW_GATEWAY_METRICS_PORT=str(metrics_ports["gateway"]))
        started.append(gateway)
        port = gateway.wait_serving()
        connection = Connection(gateway=f"127.0.0.1:{port}", tls_dir=str(tls), identity="dev")
        pids = {"gateway": gateway.pid, "inference": ports["inference_pid"], "retrieval": ports["retrieval_pid"]}
        asyncio.run(seed(connection))
        samples, settled, verdict, load = asyncio.run(soak(
            connection, pids, metrics_ports, rate=args.rate, duration_s=args.duration,
            sample_every_s=args.sample_every))
    report(samples, settled, verdict, load)
    print(f"command: {command_line()}")
    write_json(args.json, {"samples": [asdict(s) for s in samples], "settled": asdict(settled),
                           "verdict": asdict(verdict), "load": load})
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
