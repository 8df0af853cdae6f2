#!/usr/bin/env python3
"""A Chat turn after N seconds of idleness: how much of the steady-state speed survives a pause.

Agent traffic is sparse: a person reads and types between turns. This starts
the stack (as bench/chat_turn.py does), warms it with a few turns, then for
each gap runs turns that each follow `gap` seconds of idleness, and reports
p50s of the gateway's first token, the engine's own first token
(`TurnSummary.engine_timings`), retrieval, and the CPU time and run-queue wait
the services' threads spent on the turn (/proc schedstat; the gateway,
retrieval and the inference service's front end, not vLLM's engine processes,
which spin while they wait), relative to no gap.
Run-queue wait tells "waited for a CPU" from "the same work took more CPU".

    python bench/idle_gap.py [--turns 7] [--gaps 0 0.2 0.5 1 2 5] [--json bench/out/idle.json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from chat_turn import _documents, sampling
from harness import backend_processes, command_line, dev_pki, gateway_process, print_table, scratch_dir, write_json

from agent.gateway.v1 import gateway_pb2 as pb
from agent.gateway.v1 import gateway_pb2_grpc
from servicekit import ChannelSpec, ClientTls, open_channel, wait_ready

QUESTION = "What does the with statement do?"
#: chat_turn.py's answer (16 tokens, greedy), so a turn here is one of its turns.
SAMPLING = sampling(16, 0.0)


def _cpu_and_wait_ms(pids: list[int]) -> tuple[float, float]:
    """On-CPU and run-queue-wait time of every thread of ``pids``, in ms."""
    on_cpu = waited = 0
    for pid in pids:
        for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            try:
                fields = stat.read_text().split()
            except OSError:  # the thread ended meanwhile
                continue
            on_cpu, waited = on_cpu + int(fields[0]), waited + int(fields[1])
    return on_cpu / 1e6, waited / 1e6


async def run(ports: dict[str, int], tls: Path, pids: list[int], turns: int, gaps: list[float]) -> dict[float, list[dict]]:
    spec = ChannelSpec(target=f"127.0.0.1:{ports['gateway']}", tls=ClientTls.for_identity(tls, "tenant/dev"))
    async with open_channel(spec) as channel:
        await wait_ready(channel, timeout_s=30, target="gateway")
        stub = gateway_pb2_grpc.AgentGatewayStub(channel)
        await stub.IngestDocuments(pb.IngestDocumentsRequest(collection="docs", documents=_documents()), timeout=300)

        async def turn() -> dict:
            cpu_before, wait_before = _cpu_and_wait_ms(pids)
            started = time.perf_counter()
            final = None
            async for event in stub.Chat(pb.ChatRequest(  # stateless: every turn is the same prompt
                    message=QUESTION, generation=SAMPLING, retrieval=pb.RetrievalOptions(collection="docs", top_k=3)),
                    timeout=60):
                if event.WhichOneof("event") == "final":
                    final = event.final
            total_ms = (time.perf_counter() - started) * 1000
            cpu_after, wait_after = _cpu_and_wait_ms(pids)
            return {"ttft": final.timings.first_token_ms, "engine_ttft": final.engine_timings.first_token_ms,
                    "retrieval": final.timings.retrieval_ms, "total": total_ms,
                    "cpu": cpu_after - cpu_before, "wait": wait_after - wait_before}

        for _ in range(5):
            await turn()
        results = {}
        for gap in gaps:
            rows = []
            for _ in range(turns):
                await asyncio.sleep(gap)
                rows.append(await turn())
            results[gap] = rows
        return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=7, help="turns per gap")
    parser.add_argument("--gaps", type=float, nargs="+", default=[0, 0.2, 0.5, 1, 2, 5], help="idle seconds")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    root = scratch_dir("idle")
    tls = dev_pki(root)
    with backend_processes(root, tls) as (ports, started):
        gateway = gateway_process(root, tls, "gateway", ports)
        started.append(gateway)
        ports["gateway"] = gateway.wait_serving()
        # The services' own processes. Not vLLM's engine processes: they
        # spin while they wait, so their CPU time is wall time, not work.
        pids = [process.pid for process in started]
        results = asyncio.run(run(ports, tls, pids, args.turns, args.gaps))

    stats, table = {}, []
    base = {key: statistics.median(r[key] for r in results[min(results)]) for key in ("ttft", "cpu")}
    for gap, rows in results.items():
        medians = {key: statistics.median(r[key] for r in rows)
                   for key in ("ttft", "engine_ttft", "retrieval", "total", "cpu", "wait")}
        stats[gap] = medians
        table.append({"idle s": gap, "turns": len(rows), "TTFT p50": medians["ttft"],
                      "x no gap": medians["ttft"] / base["ttft"], "engine TTFT p50": medians["engine_ttft"],
                      "retrieval p50": medians["retrieval"], "CPU ms p50": medians["cpu"],
                      "CPU x": medians["cpu"] / base["cpu"], "run-queue wait ms p50": medians["wait"]})
    print_table("a Chat turn after idleness (first tokens and retrieval in ms; CPU and waits summed over the "
                "threads of the gateway, retrieval and the inference front end)", table, list(table[0]))
    print(f"command: {command_line()}")
    write_json(args.json, {"stats": {str(k): v for k, v in stats.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
