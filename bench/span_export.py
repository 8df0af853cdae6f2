#!/usr/bin/env python3
"""What exporting every span does to a server's calls: OpenTelemetry's OTLP exporter against ours, side by side.

Two grpc.aio servers, alike but for their span exporter: the SDK's
``OTLPSpanExporter`` ("sdk") and ``servicekit.span_export.WireOtlpSpanExporter``
("ours", what our services run). Each call records ``--spans-per-call`` spans
with the attributes a gateway call's spans carry, and both servers export
every span to the trace sink (``trace_sink.py``, a process of its own) through
the batch processor at its defaults: a batch of 512 spans whenever that many
are queued. A client calls one server at a time, at concurrency 1, in rounds
that alternate between them (the order flips every round), so the host's
drift falls on both.

It reports, for each exporter, the calls' latency (p50, p99, p99.9, max,
and how many took over 5 and 10 ms), the server's CPU seconds in all, and
its exporting thread's CPU per batch. A call whose server exports meanwhile
waits for the GIL while the batch is encoded; the thread's CPU per batch is
that encoding, and the tail is what it costs the calls.

The servers and the client talk over plaintext loopback: the bench isolates
the exporter, and TLS would add the same to every call of both.

    python bench/span_export.py --rounds 10 --calls 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness import command_line, percentile, print_table, trace_sink, write_json

from servicekit.procfs import cpu_seconds

EXPORTERS = ("sdk", "ours")
METHOD = "/bench.Echo/Call"


def serve(exporter: str, sink: str, spans_per_call: int) -> None:
    """The server of one exporter (a child process): prints its port, serves until its stdin closes, then
    prints its export counts as JSON."""
    import grpc
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace import SpanKind

    if exporter == "ours":
        from servicekit.span_export import WireOtlpSpanExporter as Exporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Exporter

    exported = {"exports": 0, "spans": 0, "thread_cpu_s": 0.0}

    class Counted(Exporter):
        def export(self, spans, *args, **kwargs):
            started = time.thread_time()
            try:
                return super().export(spans, *args, **kwargs)
            finally:
                exported["thread_cpu_s"] += time.thread_time() - started
                exported["exports"] += 1
                exported["spans"] += len(spans)

    provider = TracerProvider(resource=Resource.create({"service.name": f"bench-{exporter}"}))
    provider.add_span_processor(BatchSpanProcessor(Counted(endpoint=sink, insecure=True)))
    tracer = provider.get_tracer("bench.span_export")
    calls = 0

    async def call(request: bytes, context) -> bytes:
        nonlocal calls
        calls += 1
        with tracer.start_as_current_span(METHOD, kind=SpanKind.SERVER, attributes={
                "rpc.system": "grpc", "rpc.service": "bench.Echo", "rpc.method": "Call", "net.peer.ip": "127.0.0.1",
                "agw.tenant": "dev", "agw.caller": "spiffe://agentgw.local/tenant/dev",
                "agw.request_bytes": len(request), "agw.call": calls, "rpc.grpc.status_code": 0}):
            for step in range(spans_per_call - 1):
                with tracer.start_as_current_span(f"step {step}", attributes={
                        "agw.step": step, "agw.collection": "docs", "agw.returned": calls % 7}):
                    pass
        return request

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {
            "Call": grpc.unary_unary_rpc_method_handler(call)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        stdin_closed = asyncio.Event()
        loop = asyncio.get_running_loop()
        threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stdin_closed.set)),
                         daemon=True).start()
        await stdin_closed.wait()
        await server.stop(None)

    asyncio.run(main())
    provider.shutdown()  # exports what is left
    print(json.dumps(exported), flush=True)


async def measure(ports: dict[str, int], rounds: int, calls: int) -> dict[str, list[float]]:
    """Latencies (ms) per exporter: ``rounds`` rounds of ``calls`` calls to each server, at concurrency 1."""
    import grpc

    channels = {name: grpc.aio.insecure_channel(f"127.0.0.1:{port}") for name, port in ports.items()}
    stubs = {name: channel.unary_unary(METHOD) for name, channel in channels.items()}
    payload = b"x" * 100
    for stub in stubs.values():  # connections up, code paths warm
        for _ in range(200):
            await stub(payload, timeout=10)
    latencies: dict[str, list[float]] = {name: [] for name in ports}
    for round_ in range(rounds):
        for name in (EXPORTERS if round_ % 2 == 0 else EXPORTERS[::-1]):
            stub, kept = stubs[name], latencies[name]
            for _ in range(calls):
                started = time.perf_counter()
                await stub(payload, timeout=10)
                kept.append((time.perf_counter() - started) * 1000)
    for channel in channels.values():
        await channel.close()
    return latencies


def _last_line(output: str) -> dict:
    """The JSON a server printed last (its export counts), or {} where it printed none (it died first): a
    server's failure then stays the error reported, not a parse of its empty output."""
    lines = output.splitlines()
    return json.loads(lines[-1]) if lines else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds; each calls both servers in turn")
    parser.add_argument("--calls", type=int, default=1000, help="calls to each server per round")
    parser.add_argument("--spans-per-call", type=int, default=4, help="spans each call records (the server span "
                        "and its children)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve", nargs=2, metavar=("EXPORTER", "SINK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1], args.spans_per_call)
        return 0

    with trace_sink() as sink:
        servers = {name: subprocess.Popen(
            [sys.executable, __file__, "--serve", name, f"http://127.0.0.1:{sink.port}",
             "--spans-per-call", str(args.spans_per_call)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for name in EXPORTERS}
        try:
            ports = {name: int(server.stdout.readline()) for name, server in servers.items()}
            cpu_before = {name: cpu_seconds(server.pid) for name, server in servers.items()}
            latencies = asyncio.run(measure(ports, args.rounds, args.calls))
            cpu = {name: cpu_seconds(server.pid) - cpu_before[name] for name, server in servers.items()}
        finally:  # closing a server's stdin stops it; it prints its counts last
            counts = {name: _last_line(server.communicate(timeout=60)[0]) for name, server in servers.items()}
    if not all(counts.values()):
        raise RuntimeError("a server exited without its export counts: exit codes "
                           + ", ".join(f"{name} {server.returncode}" for name, server in servers.items()))
    rows = []
    for name in EXPORTERS:
        values = latencies[name]
        exported = counts[name]
        rows.append({
            "exporter": name, "calls": len(values), "p50 ms": percentile(values, 50),
            "p99 ms": percentile(values, 99), "p99.9 ms": percentile(values, 99.9), "max ms": max(values),
            "over 5 ms": sum(v > 5 for v in values), "over 10 ms": sum(v > 10 for v in values),
            "server cpu s": cpu[name], "exports": exported["exports"],
            "export cpu ms/batch": 1000 * exported["thread_cpu_s"] / max(1, exported["exports"]),
            "spans": exported["spans"]})
    print_table(f"c=1 calls to a server exporting every span ({args.spans_per_call} a call), by exporter", rows,
                list(rows[0]))
    sdk, ours = rows
    print(f"ours / sdk: p99 {ours['p99 ms'] / sdk['p99 ms']:.2f}x, p99.9 {ours['p99.9 ms'] / sdk['p99.9 ms']:.2f}x, "
          f"server CPU {ours['server cpu s'] / sdk['server cpu s']:.2f}x, export CPU a batch "
          f"{ours['export cpu ms/batch'] / sdk['export cpu ms/batch']:.2f}x; the sink took "
          f"{sink.counts['exports']} exports, {sink.counts['bytes'] / 2**20:.1f} MiB")
    print(f"command: {command_line()}")
    write_json(args.json, {"rows": rows, "sink": sink.counts})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
