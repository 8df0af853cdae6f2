#!/usr/bin/env python3
"""What tracing adds to an agent turn: Chat with the gateway's tracing off, on, on with content, and dead.

One inference and one retrieval service (both exporting to a real OTLP
receiver started here), and a gateway process for each mode on them:
- off: no OTEL_EXPORTER_OTLP_ENDPOINT (no span recorded since 2026-12-02; every call still gets a trace id);
- on: exporting to the receiver over OTLP/gRPC;
- content: exporting, with AGW_TRACE_CONTENT=1 (prompt and answer on spans);
- dead: exporting to an address where nothing listens (a collector that is down);
- sampled, with ``--sampled RATIO``: exporting, with OpenTelemetry's own
  ``OTEL_TRACES_SAMPLER=parentbased_traceidratio`` at that ratio.
Turns go round-robin over the four (or five), so the machine's noise falls on all
alike. Each turn: session history, retrieval, 16 generated tokens, persist.
Each mode calls as a tenant of its own (``tenant/trace-<mode>``), so its
session's prompts have a prefix-cache partition of their own: the four
sessions ask the same questions and get the same greedy answers, and until
2026-12-06, under one tenant, whichever mode went first in a round left the
others its whole prompt cached.
Reports first token and total, p50/p95/p99, and each mode's p50 against off;
and each mode's gateway CPU per timed turn (its own process's threads, from
``/proc/<pid>/task/*/schedstat`` before and after the timed rounds), which does not move
with the host's noise as the latencies do: all of it, and less what the
gateway spends idle (measured for ``IDLE_S`` before the rounds, with no call
running: health and metric readers, the span exporter's thread), which at
one turn in four a gateway weighs on each of its turns. The backends export
spans for every mode alike, so their CPU is not told apart by mode.
Every exporting service runs OpenTelemetry's batch processor at the SDK's
own delay between exports (5 s; ``--schedule-delay-ms``), as a deployment
does. Until 2026-12-06 this bench ran at the 100 ms the tests' receiver
sets, which about doubled the export's CPU. The bench waits one delay and a
second after the warm-up rounds and after the timed ones, so that each
batch's export falls in the measure it belongs to.

    python bench/tracing_overhead.py [--turns 60] [--sampled 0.1] [--schedule-delay-ms 5000] [--json bench/out/tracing.json]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from harness import (backend_processes, command_line, dev_pki, gateway_process, print_table, round_order,
                     sampling_environment, scratch_dir, summary, write_json)

from agent.gateway.v1 import gateway_pb2 as pb
from agent.gateway.v1 import gateway_pb2_grpc
from agent.inference.v1 import inference_pb2
from retrieval.ingest import sample_corpus
from servicekit import ChannelSpec, ClientTls, open_channel, wait_ready
from servicekit.procfs import descendants, thread_cpu_s
from tests.support.otlp_receiver import otlp_receiver
from tests.support.retrieval_service import passage_documents
from tests.support.servers import free_port

MODES = ("off", "on", "content", "dead")
#: Rounds (a turn on every mode) before the timed ones.
WARM_UP_ROUNDS = 3
#: Seconds each gateway's CPU is measured with no call running, before the timed rounds.
IDLE_S = 5.0
#: OpenTelemetry's batch span processor's own default delay between exports (OTEL_BSP_SCHEDULE_DELAY), ms.
SDK_SCHEDULE_DELAY_MS = 5000
QUESTIONS = ["How does the for statement work?", "What does with do?", "Explain try and except.",
             "How are classes defined?", "What is a lambda?", "How do imports work?"]
SAMPLING = inference_pb2.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


async def turn(stub, session: str, question: str) -> dict:
    started = time.perf_counter()
    first = None
    async for event in stub.Chat(pb.ChatRequest(
            session_id=session, message=question, generation=SAMPLING,
            retrieval=pb.RetrievalOptions(collection="docs", top_k=3)), timeout=60):
        if event.WhichOneof("event") == "delta" and first is None:
            first = (time.perf_counter() - started) * 1000
    return {"ttft": first, "total": (time.perf_counter() - started) * 1000}


async def run(ports: dict[str, int], tls: Path, turns: int, gateway_pids: dict[str, int],
              settle_s: float) -> tuple[dict, dict]:
    """Each mode's timed turns, and each mode's gateway CPU over them (the warm-up rounds left out): ``cpu_s``,
    seconds, and ``idle_s_per_s``, what it spent per second with no call running. ``settle_s`` (a batch
    processor's delay and a second) is waited after the warm-up rounds, so their spans are exported before
    the idle measure, and after the timed rounds, so that theirs are exported inside the measure; the idle
    rate is taken off that wait as off the rounds."""
    modes = tuple(gateway_pids)
    channels = {mode: open_channel(ChannelSpec(target=f"127.0.0.1:{ports[mode]}",
                                               tls=ClientTls.for_identity(tls, f"tenant/{_tenant(mode)}")))
                for mode in modes}
    try:
        stubs = {}
        for mode, channel in channels.items():
            await wait_ready(channel, timeout_s=30, target=mode)
            stubs[mode] = gateway_pb2_grpc.AgentGatewayStub(channel)
        documents = passage_documents(sample_corpus(max_per_topic=2)[:120])
        for stub in stubs.values():  # a tenant's collection is its own
            await stub.IngestDocuments(pb.IngestDocumentsRequest(collection="docs", documents=documents), timeout=300)
        sessions = {mode: (await stub.CreateSession(pb.CreateSessionRequest(), timeout=5)).session.id
                    for mode, stub in stubs.items()}

        async def one_round(index: int) -> dict[str, dict]:
            return {mode: await turn(stubs[mode], sessions[mode], QUESTIONS[index % len(QUESTIONS)])
                    for mode in round_order(modes, index)}  # who goes first, and after whom, changes too

        for index in range(WARM_UP_ROUNDS):  # every path warm before anything is timed
            await one_round(index)
        await asyncio.sleep(settle_s)
        idle_before, idle_started = _cpus(gateway_pids), time.perf_counter()
        await asyncio.sleep(IDLE_S)
        cpu_before, started = _cpus(gateway_pids), time.perf_counter()
        rows: dict[str, list[dict]] = {mode: [] for mode in modes}
        for index in range(WARM_UP_ROUNDS, WARM_UP_ROUNDS + turns):
            for mode, result in (await one_round(index)).items():
                rows[mode].append(result)
        await asyncio.sleep(settle_s)
        cpu_after, wall_s = _cpus(gateway_pids), time.perf_counter() - started
        return rows, {mode: {"cpu_s": cpu_after[mode] - cpu_before[mode], "wall_s": wall_s,
                             "idle_s_per_s": (cpu_before[mode] - idle_before[mode]) / (started - idle_started)}
                      for mode in gateway_pids}
    finally:
        for channel in channels.values():
            await channel.close()


def _tenant(mode: str) -> str:
    """Each mode's tenant: a prefix-cache partition and a collection of its own."""
    return f"trace-{mode}"


def _cpus(gateway_pids: dict[str, int]) -> dict[str, float]:
    """Each mode's gateway's CPU seconds so far, its process's and any it started, summed over their live
    threads in nanoseconds (``/proc/<pid>/stat`` counts 10 ms ticks: a few in an idle gateway's five seconds)."""
    return {mode: sum(sum(thread_cpu_s(each).values()) for each in (pid, *descendants(pid)))
            for mode, pid in gateway_pids.items()}


def _vs(value: float, base: float) -> str:
    return f"{(value / base - 1) * 100:+.1f}%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=60, help="turns per mode")
    parser.add_argument("--sampled", type=float, metavar="RATIO",
                        help="also a gateway exporting a RATIO of its traces (parentbased_traceidratio)")
    parser.add_argument("--schedule-delay-ms", type=int, default=SDK_SCHEDULE_DELAY_MS,
                        help="OTEL_BSP_SCHEDULE_DELAY for every exporting service: the SDK's default, as a "
                             "deployment runs it (until 2026-12-06 this bench ran at 100, the tests' delay)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    modes = MODES + (("sampled",) if args.sampled is not None else ())
    root = scratch_dir("tracing")
    tls = dev_pki(root, tenants=tuple(_tenant(mode) for mode in modes))
    with otlp_receiver() as receiver:
        exporting = {**receiver.environment(), "OTEL_BSP_SCHEDULE_DELAY": str(args.schedule_delay_ms)}
        with backend_processes(root, tls, **exporting) as (ports, started):
            gateway_pids: dict[str, int] = {}
            for mode in modes:
                env = dict(exporting) if mode != "off" else {}
                if mode == "content":
                    env["AGW_TRACE_CONTENT"] = "1"
                if mode == "dead":
                    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
                if mode == "sampled":
                    env.update(sampling_environment(args.sampled))
                gateway = gateway_process(root, tls, f"gateway-{mode}", ports, **env)
                started.append(gateway)
                ports[mode] = gateway.wait_serving()
                gateway_pids[mode] = gateway.pid
            rows, cpu = asyncio.run(run(ports, tls, args.turns, gateway_pids, args.schedule_delay_ms / 1000 + 1))
        exported = len(receiver.spans())

    # A turn whose tokens all decode to empty text (the smoke model's random
    # weights can do that) has no first-token time; it still counts for total.
    stats = {mode: {"ttft": summary([r["ttft"] for r in rows[mode] if r["ttft"] is not None]),
                    "total": summary([r["total"] for r in rows[mode]]),
                    "gateway_cpu_ms_per_turn": cpu[mode]["cpu_s"] * 1000 / len(rows[mode]),
                    "gateway_idle_ms_per_s": cpu[mode]["idle_s_per_s"] * 1000,
                    "gateway_cpu_ms_per_turn_less_idle": (cpu[mode]["cpu_s"] - cpu[mode]["idle_s_per_s"]
                                                          * cpu[mode]["wall_s"]) * 1000 / len(rows[mode])}
             for mode in modes}
    base = stats["off"]
    table = [{"mode": mode, "turns": s["total"]["n"], "TTFT p50": s["ttft"]["p50"], "TTFT p99": s["ttft"]["p99"],
              "total p50": s["total"]["p50"], "total p95": s["total"]["p95"], "total p99": s["total"]["p99"],
              "p50 vs off": _vs(s["total"]["p50"], base["total"]["p50"]),
              "gw CPU ms/turn": s["gateway_cpu_ms_per_turn"], "gw idle ms/s": s["gateway_idle_ms_per_s"],
              "gw CPU less idle": s["gateway_cpu_ms_per_turn_less_idle"],
              "less idle vs off": _vs(s["gateway_cpu_ms_per_turn_less_idle"],
                                      base["gateway_cpu_ms_per_turn_less_idle"])}
             for mode, s in stats.items()]
    print_table("Chat turn with the gateway's tracing off / on / on + content / dead collector, ms (16 tokens)", table,
                ["mode", "turns", "TTFT p50", "TTFT p99", "total p50", "total p95", "total p99", "p50 vs off",
                 "gw CPU ms/turn", "gw idle ms/s", "gw CPU less idle", "less idle vs off"])
    print(f"spans received by the OTLP receiver: {exported} (goal: under 3% added at p50)")
    print(f"command: {command_line()}")
    write_json(args.json, {"stats": stats, "spans_exported": exported})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
