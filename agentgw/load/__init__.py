"""``agentgw load``: open-loop load of agent turns against a gateway, with a report, JSON, a plot and SLOs.

    agentgw load --rate 4 --duration 60 --json run.json --plot run.png --slo first_token_p99=800ms --slo errors=0
    agentgw load --replay traces.jsonl [--time-scale 0.5]
    agentgw load --concurrency 8 --duration 30          # closed loop

Exit 0 when every ``--slo`` holds, 1 when one is missed, 2 on a usage or connection error.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

from agent.gateway.v1 import gateway_pb2_grpc
from agentgw.connection import Connection, NoConnection
from agentgw.load.runner import Target, TurnResult, closed_loop, open_loop
from agentgw.load.slo import Slo
from agentgw.load.workload import TurnSpec, replay, synthetic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shape = parser.add_argument_group("load shape")
    shape.add_argument("--rate", type=float, default=4.0, help="turns per second, Poisson arrivals (open loop)")
    shape.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    shape.add_argument("--concurrency", type=int, help="closed loop instead: this many turns in flight")
    shape.add_argument("--think-time", type=float, default=0.0, help="closed loop: pause after each answer (s)")
    shape.add_argument("--replay", type=Path, help="replay the Chat turns of a trace file (AGW_TRACE_FILE or OTLP JSON)")
    shape.add_argument("--time-scale", type=float, default=1.0, help="replay: multiply the recorded gaps")
    shape.add_argument("--tenants", default="", help="tenants to spread turns over, comma-separated (default: yours)")
    shape.add_argument("--sessions", type=int, default=8, help="sessions per tenant (0: stateless turns)")
    shape.add_argument("--retrieval-share", type=float, default=0.5, help="share of turns with retrieval")
    shape.add_argument("--max-tokens", type=int, default=32, help="tokens each turn generates")
    shape.add_argument("--collection", default="docs", help="the tenants' collection for retrieval")
    shape.add_argument("--seed", type=int, default=0)
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, help="write the summary and every turn's figures")
    out.add_argument("--plot", type=Path, help="write a PNG: latency over time and its CDF")
    out.add_argument("--slo", action="append", default=[], type=_slo,
                     help="threshold, repeatable: first_token_p99=800ms, total_p50=2s, errors=0, error_rate=1%%")
    where = parser.add_argument_group("target")
    where.add_argument("--target", help="gateway address (default: from $AGW_HOME/connection.json)")
    where.add_argument("--tls-dir", type=Path, help="TLS folder with ca.pem and tenant/<name>/ certificates")
    where.add_argument("--identity", default="dev", help="your tenant (its certificate), with --target")
    where.add_argument("--timeout", type=float, default=60.0, help="deadline per turn, in seconds")


def _slo(text: str) -> Slo:
    try:
        return Slo.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def schedule(args: argparse.Namespace, tenants: list[str]) -> list[TurnSpec]:
    if args.replay:
        return replay(args.replay, time_scale=args.time_scale, tenant=tenants[0])
    return synthetic(rate=args.rate, duration_s=args.duration, tenants=tenants, sessions_per_tenant=args.sessions,
                     retrieval_share=args.retrieval_share, max_tokens=args.max_tokens, seed=args.seed)


async def run(connection: Connection, args: argparse.Namespace, turns: list[TurnSpec], tenants: list[str],
              progress=None) -> tuple[list[TurnResult], float]:
    """Send ``turns``; returns every turn's result and the run's wall time."""
    async with AsyncExitStack() as stack:
        stubs = {}
        for tenant in tenants:
            channel = await stack.enter_async_context(connection.tenant_channel(tenant))
            stubs[tenant] = gateway_pb2_grpc.AgentGatewayStub(channel)
        target = Target(stubs, collection=args.collection, timeout_s=args.timeout)
        on_result = progress or (lambda result: None)
        started = time.perf_counter()
        if args.concurrency:
            results = await closed_loop(target, turns, args.concurrency, args.think_time, on_result)
        else:
            results = await open_loop(target, turns, on_result)
        return results, time.perf_counter() - started


def main(args: argparse.Namespace, settings) -> int:
    try:
        connection = Connection.for_cli(settings, args.target, args.tls_dir, args.identity)
        tenants = [t for t in args.tenants.split(",") if t] or [connection.identity]
        turns = schedule(args, tenants)
    except (NoConnection, ValueError, OSError) as exc:
        print(f"agentgw load: {exc}", file=sys.stderr)
        return 2
    if args.concurrency and not args.replay:  # closed loop: as many turns as the duration's arrivals
        turns = [TurnSpec(0.0, t.tenant, t.session, t.message_chars, t.retrieval, t.max_tokens) for t in turns]
    from agentgw.load.report import summarize, text_report, write_json, write_plot  # numpy, matplotlib: here only

    results, elapsed = _with_progress(connection, args, turns, tenants)
    summary = summarize(results, elapsed)
    print(text_report(summary))
    meta = {"command": " ".join(sys.argv), "target": connection.gateway, "tenants": tenants,
            "mode": "closed" if args.concurrency else "replay" if args.replay else "open"}
    if args.json:
        write_json(args.json, summary, results, meta)
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(args.plot, results, f"agentgw load: {meta['mode']} loop, {summary['turns']} turns")
        print(f"wrote {args.plot}")
    missed = False
    for slo in args.slo:
        met, detail = slo.check(summary)
        missed |= not met
        print(f"{'PASS' if met else 'FAIL'}  slo {detail}")
    return 1 if missed else 0


def _with_progress(connection: Connection, args: argparse.Namespace, turns: list[TurnSpec],
                   tenants: list[str]) -> tuple[list[TurnResult], float]:
    """Run with a live progress line (rich) on a terminal, quietly otherwise."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[status]}"))
    with Progress(*columns, transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("turns", total=len(turns), status="")
        errors = 0

        def on_result(result: TurnResult) -> None:
            nonlocal errors
            errors += result.status != "OK"
            bar.update(task, advance=1, status=f"errors {errors}")

        return asyncio.run(run(connection, args, turns, tenants, on_result))
