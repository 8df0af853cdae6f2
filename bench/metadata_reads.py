#!/usr/bin/env python3
"""What reading a call's metadata anew costs a server: servicekit's edge, reading it once against once per reader.

grpc.aio's ``context.invocation_metadata()`` builds a new tuple from the C
core's metadata each time it is called. gRPC builds one for the handler
lookup; servicekit's edge then read it again for the server span and, on a
call an edge forwarded, again for the forwarded certificate (1.2 KB). Since
2026-12-07 the edge keeps the lookup's tuple for the call
(``servicekit.call_metadata``). This bench runs servicekit's real edge
(``EdgeHandlers`` behind ``GenericHandlersOnly``, an ``Authorizer`` that
believes ``service/edge``) in two echo servers, each its own process, mTLS:

- ``each read``: every reader calls ``invocation_metadata()``, as before
  (``keep`` replaced by a no-op in that process);
- ``read once``: servicekit as it is.

Each is called at c=1 two ways: ``plain`` (an operator's certificate, no
header) and ``edge`` (the edge's certificate with the forwarded-certificate
header as Envoy sets it). Rounds change the order (harness.round_order);
reported: the median of the rounds' p50s and each server's CPU per call (all its threads,
``/proc/<pid>/task/*/schedstat``), paired against ``each read``; and, from
one more call on each path, servicekit's reads of the metadata a call
(counted in the server) and what one read costs there (timed over 2,000
in the handler): a fresh tuple in ``each read``, the kept one in ``read
once``. The reads a call times the difference per read is the saving, with
none of the host's noise.

    python bench/metadata_reads.py [--rounds 8] [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import quote

import grpc
from grpc_health.v1 import health_pb2
from harness import (add_serve_arguments, child_servers, command_line, dev_pki, echo_handler,
                     process_threads_cpu_s, round_order, scratch_dir, serve_mtls, served_as_child)

from servicekit.forwarded import XFCC_HEADER
from servicekit.tls import ClientTls

SERVERS = ("each read", "read once")
CALLERS = ("plain", "edge")
#: An echo method of no real service (health's own path the edge passes untouched): authorized and traced.
SERVICE = "agent.bench.v1.Echo"
METHOD = f"/{SERVICE}/Check"


#: Reads of the call's metadata by servicekit in the call now being served (see _count_reads).
_READS = [0]


async def _check(request, context):
    if request.service == "time-reads":  # the reads as the edge makes them, timed in this call, and counted
        from servicekit.call_metadata import call_metadata

        reads, started = _READS[0], time.perf_counter()
        for _ in range(2000):
            call_metadata(context)
        context.set_trailing_metadata((("x-read-us", f"{(time.perf_counter() - started) / 2000 * 1e6:.3f}"),
                                       ("x-reads", str(reads))))
    return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _count_reads() -> None:
    """Count servicekit's reads of a call's metadata (the server span's and the authorization's), per call."""
    import servicekit.authz as authz
    import servicekit.interceptors as interceptors

    read = interceptors.call_metadata

    def counted(context):
        _READS[0] += 1
        return read(context)

    interceptors.call_metadata = authz.call_metadata = counted
    lookup = interceptors._WrappedOnce.service

    def service(self, details):
        _READS[0] = 0  # a new call
        return lookup(self, details)

    interceptors._WrappedOnce.service = service


async def _serve(server_kind: str, port: int, tls: Path) -> None:
    import servicekit.interceptors as interceptors
    from servicekit.authz import Authorizer, Policy
    from servicekit.interceptors import EdgeHandlers, Readiness
    from servicekit.server import GenericHandlersOnly

    if server_kind == "each read":
        interceptors.keep = lambda metadata: None  # every reader falls back to context.invocation_metadata()
    _count_reads()
    readiness = Readiness("bench")
    readiness.ready = True
    authorizer = Authorizer("bench", Policy(["operator/*", "tenant/*"]), trust_domain="agentgw.local",
                            edges=("service/edge",))
    server = grpc.aio.server()
    handler = echo_handler(SERVICE, _check)
    GenericHandlersOnly(server, EdgeHandlers(readiness, authorizer)).add_generic_rpc_handlers([handler])
    await serve_mtls(server, port, tls)


async def _measure(tls: Path, ports: dict[str, int], pids: dict[str, int], rounds: int,
                   calls: int) -> tuple[dict, dict, dict]:
    cert = quote((tls / "tenant" / "dev" / "cert.pem").read_text(), safe="")
    forwarded = ((XFCC_HEADER, f'By=spiffe://agentgw.local/service/edge;Hash=00;Cert="{cert}";'
                               "URI=spiffe://agentgw.local/tenant/dev"),)
    identities, metadata = {"plain": "operator/admin", "edge": "service/edge"}, {"plain": (), "edge": forwarded}
    channels = {(server, caller): grpc.aio.secure_channel(f"127.0.0.1:{ports[server]}",
                                                          ClientTls.for_identity(tls, identities[caller]).credentials())
                for server in SERVERS for caller in CALLERS}
    calls_of = {path: channel.unary_unary(METHOD, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                          response_deserializer=health_pb2.HealthCheckResponse.FromString)
                for path, channel in channels.items()}
    request = health_pb2.HealthCheckRequest()
    paths = list(channels)
    for path in paths:
        for _ in range(300):  # connections up, code paths warm, the wrapper built, the certificates read
            await calls_of[path](request, metadata=metadata[path[1]], timeout=10)
    p50s: dict[tuple, list[float]] = {path: [] for path in paths}
    cpu_us: dict[tuple, list[float]] = {path: [] for path in paths}
    for index in range(rounds):
        for path in round_order(paths, index):
            latencies, used = [], process_threads_cpu_s(pids[path[0]])
            for _ in range(calls):
                started = time.perf_counter()
                await calls_of[path](request, metadata=metadata[path[1]], timeout=10)
                latencies.append((time.perf_counter() - started) * 1e6)
            cpu_us[path].append((process_threads_cpu_s(pids[path[0]]) - used) / calls * 1e6)
            p50s[path].append(statistics.median(latencies))
    per_read: dict[tuple, tuple[float, int]] = {}  # (µs a read, reads a call) as each server made them
    for path in paths:
        call = calls_of[path](health_pb2.HealthCheckRequest(service="time-reads"), metadata=metadata[path[1]],
                              timeout=30)
        await call
        trailer = dict(await call.trailing_metadata())
        per_read[path] = (float(trailer["x-read-us"]), int(trailer["x-reads"]))
    for channel in channels.values():
        await channel.close()
    return p50s, cpu_us, per_read


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds; each calls every path in turn")
    parser.add_argument("--calls", type=int, default=2000, help="calls per path and round, one at a time")
    add_serve_arguments(parser, SERVERS)
    args = parser.parse_args()
    if served_as_child(args, _serve):
        return 0
    tls = dev_pki(scratch_dir("metadata-reads"))
    with child_servers(__file__, SERVERS, tls) as (ports, pids):
        time.sleep(3)  # both listening
        p50s, cpu_us, per_read = asyncio.run(_measure(tls, ports, pids, args.rounds, args.calls))
    print(f"\nc=1, {args.calls} calls per path and round, {args.rounds} rounds; medians of the rounds")
    print(f"{'caller':7} {'server':10} {'p50 us':>8} {'vs each read':>13} {'cpu us/call':>12} {'vs each read':>13} "
          f"{'reads/call':>10} {'us/read':>8}")
    for caller in CALLERS:
        base = ("each read", caller)
        for server in SERVERS:
            path = (server, caller)
            paired_p50 = statistics.median(a - b for a, b in zip(p50s[path], p50s[base]))
            paired_cpu = statistics.median(a - b for a, b in zip(cpu_us[path], cpu_us[base]))
            print(f"{caller:7} {server:10} {statistics.median(p50s[path]):8.1f} {paired_p50:+13.1f} "
                  f"{statistics.median(cpu_us[path]):12.1f} {paired_cpu:+13.1f} {per_read[path][1]:10d} "
                  f"{per_read[path][0]:8.2f}")
    print(f"command: {command_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
