#!/usr/bin/env python3
"""What each step of the gateway's unary edge costs, timed one by one inside a real mTLS call.

The gateway's ``Retrieve`` costs about 300 µs of CPU per call more than a bare
grpc.aio passthrough in front of the same backend (``bench/gateway_overhead.py
--bare``; docs/benchmarks.md), and that difference is what stands between the
unary passthrough and 80% of direct throughput at c=64. This bench splits it:
a grpc.aio server (uvloop, mTLS with client certificates, as the gateway runs)
answers one call from the dev tenant, and inside that call's handler, with
the call's own servicer context, it repeats each step of the edge many times
and reports the median microseconds per step over several rounds:

- the context calls the edge makes (auth context, metadata, deadline);
- authorization, the server span (a public caller's traceparent, linked), admission
  (on the server span, as one-hop calls record it, and as a span of its own, as
  Chat's stage does), bounds, tenant scoping, the backend deadline, the outgoing
  trace metadata (under the server span), the response's wrap;
- the server span's end records the call's duration metric: with ``--metrics``
  through the Prometheus meter provider a deployed gateway installs
  (``AGW_GATEWAY_METRICS_PORT``), without it through the no-op meter (as the
  other benches run the gateway).

Spans (``--spans``): ``default`` is the tracer provider the services install
without a collector, which records no span (nothing would read one), so a
server span is made without the SDK (``telemetry.UnrecordedServerSpans``) and
a child span's cost is the SDK's unsampled span and its context; ``recorded`` records
spans that no processor takes (the services' default before 2026-12-02);
``exported`` records them and exports them to a file, as with a collector
(``AGW_TRACE_FILE``): the in-call cost is then creation, attributes, end and
the hand-off to the batch processor, whose thread competes for the CPU.

    python bench/edge_costs.py [--repeat 2000] [--rounds 5] [--metrics] [--spans default|recorded|exported]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import grpc
import uvloop
from harness import dev_pki, print_table, scratch_dir, write_json

from agent.gateway.v1 import gateway_pb2 as pb
from agent.retrieval.v1 import retrieval_pb2
from servicekit.admission import Admission
from gateway.backends import Deadlines
from servicekit.bounds import Bounds
from gateway.service import GatewayApp, GatewayServicer, _RESPONSE_FIELD
from gateway.settings import GatewaySettings
from servicekit.tenancy import current_tenant, scoped_search
from servicekit import interceptors
from servicekit.passthrough import wrap
from servicekit.server import authorizer_for
from servicekit.telemetry import configure_tracing, outgoing_metadata, unrecorded_server_spans
from tests.support.servers import free_port

SERVICE, NAME = "agent.gateway.v1.AgentGateway", "Retrieve"
METHOD = f"/{SERVICE}/{NAME}"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _retrieve_request() -> pb.RetrieveRequest:
    return pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(
        collection="docs", vector=retrieval_pb2.Vector(values=[0.05] * 384), top_k=1))


def _steps(context, settings: GatewaySettings) -> dict[str, Callable[[], object]]:
    """Each step of a unary Retrieve at the edge, as the gateway runs it, on this call's ``context``."""
    app = GatewayApp(settings)
    authorizer = authorizer_for(app, settings, insecure=False)
    servicer = GatewayServicer(settings, Admission(1024, per_tenant=1024))
    bounds = Bounds(settings)
    deadlines = Deadlines(settings.default_deadline_s, settings.deadline_margin_ms)
    request = _retrieve_request()
    payload = b"x" * 200  # about a top-1 search response
    serialised = request.SerializeToString()
    authorizer.bind(authorizer.authorize(context, METHOD))

    unrecorded = unrecorded_server_spans("link")  # as the interceptor decides: None where spans are recorded

    def server_span() -> None:
        interceptors._ServerSpan(METHOD, context, "link", unrecorded).end()

    def authorize() -> None:
        authorizer.bind(authorizer.authorize(context, METHOD))

    def admission() -> None:
        with ExitStack() as slot:
            servicer._admit(slot, "dev")

    def admission_stage() -> None:
        with ExitStack() as slot:
            servicer._admit(slot, "dev", stage=True)

    return {
        "context.auth_context()": context.auth_context,
        "context.invocation_metadata()": context.invocation_metadata,
        "context.time_remaining()": context.time_remaining,
        "decode the request": lambda: pb.RetrieveRequest.FromString(serialised),
        "authorize (cached certificate)": authorize,
        "server span (client traceparent, linked)": server_span,
        "admission (one-hop call: on the server span)": admission,
        "admission as a span (Chat's stage)": admission_stage,
        "bounds.retrieve": lambda: bounds.retrieve(request),
        # Scoping takes the request's own search over (in place), so each repeat scopes a freshly decoded one:
        # subtract "decode the request" for the scoping alone.
        "decode, then tenant scoping and clamp": lambda: scoped_search(
            settings, current_tenant(), pb.RetrieveRequest.FromString(serialised)),
        "backend deadline": lambda: deadlines.for_call(context),
        "outgoing trace metadata": outgoing_metadata,
        "wrap the response": lambda: wrap(_RESPONSE_FIELD, payload),
    }


def _time(step: Callable[[], object], repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        step()
    return (time.perf_counter() - started) / repeat * 1e6


async def _measure(args, tls: Path) -> list[dict]:
    settings = GatewaySettings(tls_dir=tls)
    results: dict[str, list[float]] = {}

    async def handler(request, context):
        steps = _steps(context, settings)
        # Under a server span of its own, as a handler runs (the outgoing metadata carries it).
        call_span = interceptors._ServerSpan(METHOD, context, "link", unrecorded_server_spans("link"))
        try:
            for step in steps.values():
                step()  # warm
            for _ in range(args.rounds):
                for name, step in steps.items():
                    results.setdefault(name, []).append(_time(step, args.repeat))
        finally:
            call_span.end()
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        NAME: grpc.unary_unary_rpc_method_handler(handler)})])
    folder = tls / "service" / "gateway"
    port = free_port()
    server.add_secure_port(f"127.0.0.1:{port}", grpc.ssl_server_credentials(
        [((folder / "key.pem").read_bytes(), (folder / "cert.pem").read_bytes())],
        root_certificates=(tls / "ca.pem").read_bytes(), require_client_auth=True))
    await server.start()
    client = tls / "tenant" / "dev"
    credentials = grpc.ssl_channel_credentials((tls / "ca.pem").read_bytes(), (client / "key.pem").read_bytes(),
                                               (client / "cert.pem").read_bytes())
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        call = channel.unary_unary(METHOD)
        await call(b"", timeout=600, metadata=(("traceparent", TRACEPARENT),))
    await server.stop(None)
    return [{"step": name, "us": statistics.median(samples), "min_us": min(samples)}
            for name, samples in results.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2000, help="calls of a step per timing")
    parser.add_argument("--rounds", type=int, default=5, help="timings per step (the median is reported)")
    parser.add_argument("--metrics", action="store_true", help="install the Prometheus meter provider first")
    parser.add_argument("--spans", choices=("default", "recorded", "exported"), default="default",
                        help="unsampled (the services' default without a collector), recorded and dropped, or "
                             "recorded and exported to a scratch file")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    root = scratch_dir("edge-costs")
    if args.spans == "recorded":
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider

        trace.set_tracer_provider(TracerProvider())
    configure_tracing("gateway", trace_file=root / "spans.jsonl" if args.spans == "exported" else None)
    if args.metrics:
        from servicekit.metrics import configure_metrics
        configure_metrics("gateway", "127.0.0.1", free_port())
    tls = dev_pki(root)
    rows = uvloop.run(_measure(args, tls))
    print_table("µs per step (median of rounds)", rows, ["step", "us", "min_us"])
    one_hop = [r for r in rows if r["step"] != "admission as a span (Chat's stage)"]
    print(f"a one-hop call's steps together (medians): {sum(r['us'] for r in one_hop):.0f} µs")
    if args.json:
        write_json(args.json, {"rows": rows, "args": vars(args) | {"json": str(args.json)}})


if __name__ == "__main__":
    main()
