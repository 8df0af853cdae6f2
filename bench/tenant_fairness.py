#!/usr/bin/env python3
"""Fair share per tenant: tenant B's first token while tenant A floods the gateway at 4x A's bound.

Starts the stack (inference with the smoke model, retrieval, Postgres) and two
gateways on the same backends: one with a per-tenant bound
(AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT, the default kind of deployment) and one
without (0). Tenant B sends its normal traffic, one stateless Chat turn at a
time with a short think time. In three phases, in balanced orders
(harness.round_order), B runs:

- alone (no flood);
- while A floods the bounded gateway: 4 x A's bound concurrent turn loops,
  each retrying a refusal after the gateway's retry hint;
- while A floods the unbounded gateway the same way (every flood turn admitted).

Reports B's first-token p50/p99 in each phase and the ratio to B alone (goal:
within 1.5x at p50 with the bound), and A's admitted and refused turns.

    python bench/tenant_fairness.py [--turns 40] [--bound 2] [--rounds 2] [--json bench/out/fairness.json]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from contextlib import AsyncExitStack
from pathlib import Path

from harness import (backend_processes, command_line, dev_pki, gateway_process, print_table, round_order,
                     scratch_dir, summary, write_json)

import grpc

from agent.gateway.v1 import gateway_pb2 as pb
from agent.gateway.v1 import gateway_pb2_grpc
from agent.inference.v1 import inference_pb2
from servicekit import ChannelSpec, ClientTls, open_channel, wait_ready
from servicekit.errors import retry_delay_s

SYSTEM = "You are a helpful assistant for a platform team. Answer briefly and precisely."
SAMPLING = inference_pb2.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
THINK_S = 0.05


def _turn(tag: str, index: int) -> pb.ChatRequest:
    return pb.ChatRequest(message=f"{tag} question {index}: how do gateways keep connections warm?",
                          system_prompt=SYSTEM, generation=SAMPLING)


async def _first_token_ms(stub, request) -> float:
    started = time.perf_counter()
    first = None
    async for event in stub.Chat(request, timeout=120):
        if first is None and event.HasField("delta"):
            first = (time.perf_counter() - started) * 1000
    return first


async def _b_turns(stub, turns: int, phase: str) -> list[float]:
    ttft = []
    for index in range(turns):
        ttft.append(await _first_token_ms(stub, _turn(f"B {phase}", index)))
        await asyncio.sleep(THINK_S)
    return ttft


async def _flood(stub, loops: int, stop: asyncio.Event, counts: dict) -> None:
    async def loop(number: int) -> None:
        index = 0
        while not stop.is_set():
            index += 1
            try:
                await _first_token_ms(stub, _turn(f"A{number}", index))
                counts["admitted"] += 1
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                counts["refused"] += 1
                await asyncio.sleep(retry_delay_s(exc) or 0.05)

    await asyncio.gather(*(loop(n) for n in range(loops)))


async def run(ports: dict, tls: Path, turns: int, bound: int, rounds: int) -> dict:
    async with AsyncExitStack() as stack:
        stubs = {}
        for gateway in ("bounded", "unbounded"):
            for tenant in ("alpha", "beta"):
                spec = ChannelSpec(target=f"127.0.0.1:{ports[gateway]}", tls=ClientTls.for_identity(tls, f"tenant/{tenant}"))
                channel = await stack.enter_async_context(open_channel(spec))
                await wait_ready(channel, timeout_s=10, target=gateway)
                stubs[gateway, tenant] = gateway_pb2_grpc.AgentGatewayStub(channel)
        for gateway in ("bounded", "unbounded"):  # warm both paths: first turns compile nothing twice
            await _b_turns(stubs[gateway, "beta"], 3, "warm")
        phases = {"alone": [], "flood, bounded": [], "flood, unbounded": []}
        flood_counts = {name: {"admitted": 0, "refused": 0} for name in phases}
        for round_number in range(rounds):
            for phase in round_order(list(phases), round_number):
                if phase == "alone":
                    phases[phase] += await _b_turns(stubs["bounded", "beta"], turns, phase)
                    continue
                gateway = "bounded" if phase == "flood, bounded" else "unbounded"
                stop = asyncio.Event()
                flood = asyncio.create_task(_flood(stubs[gateway, "alpha"], 4 * bound, stop, flood_counts[phase]))
                await asyncio.sleep(1.0)  # the flood is under way
                phases[phase] += await _b_turns(stubs[gateway, "beta"], turns, phase)
                stop.set()
                await flood
        return {"ttft": phases, "flood": flood_counts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=40, help="B's turns per phase and round")
    parser.add_argument("--bound", type=int, default=2, help="AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT (A floods at 4x)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three phases, in balanced orders")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    root = scratch_dir("fairness")
    tls = dev_pki(root, tenants=("alpha", "beta"))
    with backend_processes(root, tls) as (ports, started):
        for name, per_tenant in (("bounded", args.bound), ("unbounded", 0)):
            gateway = gateway_process(root, tls, name, ports, AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT=str(per_tenant))
            started.append(gateway)
            ports[name] = gateway.wait_serving()
        results = asyncio.run(run(ports, tls, args.turns, args.bound, args.rounds))

    alone = summary(results["ttft"]["alone"])
    rows = []
    for phase, values in results["ttft"].items():
        s = summary(values)
        counts = results["flood"][phase]
        rows.append({"phase": phase, "B turns": s["n"], "B TTFT p50": s["p50"], "B TTFT p95": s["p95"],
                     "B TTFT p99": s["p99"], "p50 vs alone": s["p50"] / alone["p50"],
                     "p99 vs alone": s["p99"] / alone["p99"],
                     "A admitted": counts["admitted"] if phase != "alone" else None,
                     "A refused": counts["refused"] if phase != "alone" else None})
    print_table(f"tenant B's first token (ms) while tenant A floods at 4 x its bound of {args.bound} "
                "(16 tokens, smoke model)", rows,
                ["phase", "B turns", "B TTFT p50", "B TTFT p95", "B TTFT p99", "p50 vs alone", "p99 vs alone",
                 "A admitted", "A refused"])
    bounded = next(r for r in rows if r["phase"] == "flood, bounded")
    print(f"goal: B's p50 within 1.5x of alone under the flood, with the bound: "
          f"{bounded['p50 vs alone']:.2f}x ({'met' if bounded['p50 vs alone'] <= 1.5 else 'NOT met'})")
    print(f"command: {command_line()}")
    write_json(args.json, {"rows": rows, "raw": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
