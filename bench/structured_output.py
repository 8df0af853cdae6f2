#!/usr/bin/env python3
"""Structured outputs and tool calls: what a constraint costs the first token, and a tool loop's cached prefix.

Starts the stack (inference, retrieval, a private Postgres, one gateway), then:

1. On the inference service directly, interleaved round by round so that every
   mode sees the same machine noise, the same chat prompt under four modes:
   unconstrained; a JSON schema never seen before (a cold grammar: a unique
   property name per request); one schema sent every time (a cached grammar);
   and a required tool call (two tools, always the same). It reports time to
   first token and time per output token, p50/p95/p99, the first-token ratio of
   each mode to unconstrained, and the constraint cache's hit rate after each
   schema's first use (from GenerationResult.constraint_cache_hit).
2. Through the gateway, 3-step tool loops (a forced search, a second search,
   an answer), each in its own session: per step, the prompt tokens and the
   share read from the prefix cache.

    python bench/structured_output.py [--rounds 30] [--loops 5] [--json bench/out/structured.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from contextlib import AsyncExitStack

from harness import (backend_processes, command_line, dev_pki, gateway_process, print_table, round_order,
                     scratch_dir, summary, write_json)

from agent.gateway.v1 import gateway_pb2 as pb
from agent.gateway.v1 import gateway_pb2_grpc
from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from servicekit import ChannelSpec, ClientTls, open_channel, wait_ready

SYSTEM = "You are a travel assistant. Answer in the requested format."
QUESTION = "Plan a short trip to Lisbon: the city, the number of days and three tags."
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "tags"], "properties": {
    "city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 10}}}}
TOOLS = [
    inference_pb2.Tool(name="search_docs", description="Search the travel guides.", parameters=json.dumps(
        {"type": "object", "additionalProperties": False, "required": ["query"],
         "properties": {"query": {"type": "string", "maxLength": 24}}})),
    inference_pb2.Tool(name="book_trip", description="Book a trip.", parameters=json.dumps(SCHEMA)),
]
MAX_TOKENS = 48


def _cold_schema(round_: int) -> str:
    """The schema with one property renamed per round: its text is new, so nothing of it is cached."""
    schema = json.loads(json.dumps(SCHEMA))
    schema["properties"][f"note_{round_}"] = {"type": "string", "maxLength": 4}
    return json.dumps(schema, separators=(",", ":"))


def _request(mode: str, round_: int) -> inference_pb2.GenerateRequest:
    sampling = inference_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=round_)
    chat = inference_pb2.ChatMessages(messages=[
        inference_pb2.ChatMessage(role=inference_pb2.ROLE_SYSTEM, content=SYSTEM),
        inference_pb2.ChatMessage(role=inference_pb2.ROLE_USER, content=QUESTION)])
    request = inference_pb2.GenerateRequest(chat=chat, sampling=sampling)
    if mode == "unconstrained":
        request.sampling.ignore_eos = True  # as long as a constrained answer, not cut short by a random EOS
        request.sampling.max_tokens = 24
    elif mode == "json_cold":
        request.sampling.structured_output.json_schema = _cold_schema(round_)
    elif mode == "json_cached":
        request.sampling.structured_output.json_schema = json.dumps(SCHEMA, separators=(",", ":"))
    elif mode == "tool_required":
        request.chat.tools.extend(TOOLS)
        request.tool_choice.mode = inference_pb2.TOOL_CHOICE_MODE_REQUIRED
    return request


async def _generate(stub, request) -> dict:
    started = time.perf_counter()
    first = result = None
    tokens = 0
    async for message in stub.Generate(request, timeout=120):
        if message.token_ids and first is None:
            first = time.perf_counter()
        tokens += len(message.token_ids)
        if message.HasField("result"):
            result = message.result
    done = time.perf_counter()
    return {"ttft": (first - started) * 1000, "tpot": (done - first) * 1000 / max(1, tokens - 1),
            "hit": result.constraint_cache_hit, "tokens": tokens,
            "finish": inference_pb2.FinishReason.Name(result.finish_reason)}


async def constraint_modes(inference, rounds: int) -> dict:
    modes = ("unconstrained", "json_cold", "json_cached", "tool_required")
    rows = {mode: [] for mode in modes}
    for round_ in range(rounds):
        for mode in round_order(modes, round_):  # each goes first, and after each other, in turn
            rows[mode].append(await _generate(inference, _request(mode, round_)))
    base = summary([r["ttft"] for r in rows["unconstrained"]])["p50"]
    table = {}
    for mode, runs in rows.items():
        ttft = summary([r["ttft"] for r in runs])
        later = runs[1:]  # after the schema's first use
        table[mode] = {"ttft": ttft, "tpot": summary([r["tpot"] for r in runs]), "ttft_ratio": ttft["p50"] / base,
                       "hit_rate_after_first": sum(r["hit"] for r in later) / len(later) if later else 0.0,
                       "finishes": {f: sum(r["finish"] == f for r in runs) for f in {r["finish"] for r in runs}}}
    return table


async def tool_loops(gateway, loops: int) -> list[dict]:
    steps = {1: [], 2: [], 3: []}
    search = inference_pb2.ToolChoice(tool_name="search_docs")
    for loop in range(loops):
        session = (await gateway.CreateSession(pb.CreateSessionRequest(), timeout=10)).session.id
        results: list[pb.ToolResult] = []
        for step in (1, 2, 3):
            request = pb.ChatRequest(session_id=session, system_prompt=SYSTEM, tools=TOOLS, tool_results=results,
                                     message=QUESTION if step == 1 else "",
                                     tool_choice=search if step < 3 else inference_pb2.ToolChoice(
                                         mode=inference_pb2.TOOL_CHOICE_MODE_NONE),
                                     generation=inference_pb2.SamplingParams(max_tokens=32, temperature=1.0, seed=loop))
            calls, final = [], None
            async for event in gateway.Chat(request, timeout=120):
                if event.WhichOneof("event") == "tool_call":
                    calls.append(event.tool_call.call)
                elif event.WhichOneof("event") == "final":
                    final = event.final
            steps[step].append(final.usage)
            results = [pb.ToolResult(tool_call_id=c.id, content=json.dumps(
                {"passages": [f"Guide {loop}.{step}: Lisbon has trams, hills and pastries."]})) for c in calls]
    out = []
    for step, usages in steps.items():
        prompt = sum(u.prompt_tokens for u in usages)
        cached = sum(u.cached_prompt_tokens for u in usages)
        out.append({"step": step, "loops": len(usages), "prompt_tokens": prompt / len(usages),
                    "cached_tokens": cached / len(usages), "cached_share": cached / prompt if prompt else 0.0})
    return out


def _channel(port: int, tls_dir, identity: str):
    return open_channel(ChannelSpec(target=f"127.0.0.1:{port}", tls=ClientTls.for_identity(tls_dir, identity)))


async def run(ports: dict, tls_dir, rounds: int, loops: int) -> dict:
    async with AsyncExitStack() as stack:
        inference_channel = await stack.enter_async_context(_channel(ports["inference"], tls_dir, "operator/admin"))
        await wait_ready(inference_channel, timeout_s=60, target="inference")
        gateway_channel = await stack.enter_async_context(_channel(ports["gateway"], tls_dir, "tenant/dev"))
        await wait_ready(gateway_channel, timeout_s=60, target="gateway")
        modes = await constraint_modes(inference_pb2_grpc.InferenceStub(inference_channel), rounds)
        steps = await tool_loops(gateway_pb2_grpc.AgentGatewayStub(gateway_channel), loops)
    return {"modes": modes, "tool_loop": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--loops", type=int, default=5)
    parser.add_argument("--json", type=lambda p: __import__("pathlib").Path(p))
    args = parser.parse_args()
    root = scratch_dir("structured")
    tls_dir = dev_pki(root)
    with backend_processes(root, tls_dir) as (ports, started):
        gateway = gateway_process(root, tls_dir, "gateway", ports)
        started.append(gateway)
        ports["gateway"] = gateway.wait_serving()
        results = asyncio.run(run(ports, tls_dir, args.rounds, args.loops))
    print(f"command: {command_line()}")
    print_table("first token and time per output token (ms), inference service direct", [
        {"mode": mode, "ttft_p50": r["ttft"]["p50"], "ttft_p95": r["ttft"]["p95"], "ttft_p99": r["ttft"]["p99"],
         "ttft_vs_unconstrained": r["ttft_ratio"], "tpot_p50": r["tpot"]["p50"], "tpot_p95": r["tpot"]["p95"],
         "cache_hits_after_first": r["hit_rate_after_first"], "finishes": r["finishes"]}
        for mode, r in results["modes"].items()],
        ["mode", "ttft_p50", "ttft_p95", "ttft_p99", "ttft_vs_unconstrained", "tpot_p50", "tpot_p95",
         "cache_hits_after_first", "finishes"])
    print_table("3-step tool loop through the gateway: prompt tokens read from the prefix cache", results["tool_loop"],
                ["step", "loops", "prompt_tokens", "cached_tokens", "cached_share"])
    write_json(args.json, results)


if __name__ == "__main__":
    main()
