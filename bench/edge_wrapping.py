#!/usr/bin/env python3
"""What wrapping a method's handler costs per call: a grpc.aio interceptor against a wrapper built once.

servicekit's edge (authorization, the server span, the error mapping) wraps
every method's handler. Until 2026-12-07 a grpc.aio server interceptor did,
awaited on every call, building the wrapped handler anew each time; now
``servicekit.interceptors.EdgeHandlers`` builds it once per method. This bench
measures what the two shapes cost with nothing else in them: four echo
servers, each its own process, all mTLS as ours are:

- ``none``: the handler as registered, no wrapper;
- ``interceptor``: a server interceptor that only awaits the lookup (gRPC's machinery);
- ``per-call``: a server interceptor that wraps the handler on every call, as servicekit's did
  (``_replace`` of the deserialiser and the behaviour, and their closures);
- ``once``: the same wrapper, built at the first call of the method and kept (servicekit's now).

Each is called at c=1 in rounds in balanced orders (harness.round_order),
so drift falls on all alike. Reported: the median of the rounds' p50s, and each server's CPU per
call (all its threads, ``/proc/<pid>/task/*/schedstat``), each with its
paired difference from ``none``.

    python bench/edge_wrapping.py [--rounds 8] [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import (add_serve_arguments, child_servers, command_line, dev_pki, echo_handler,
                     process_threads_cpu_s, round_order, scratch_dir, serve_mtls, served_as_child)

from servicekit.tls import ClientTls

SHAPES = ("none", "interceptor", "per-call", "once")


def _wrap(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """What servicekit's edge does to a unary handler, less its per-call work: a tolerant deserialiser and a
    behaviour that awaits the original."""
    deserializer, behavior = handler.request_deserializer, handler.unary_unary

    def decode(data: bytes):
        return deserializer(data)

    async def wrapped(request, context):
        return await behavior(request, context)

    return handler._replace(request_deserializer=decode)._replace(unary_unary=wrapped)


class _Lookup(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        return await continuation(details)


class _PerCall(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        return None if handler is None else _wrap(handler)


class _Once(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner, self._wrapped = inner, {}

    def service(self, details):
        handler = self._wrapped.get(details.method)
        if handler is None:
            handler = self._inner.service(details)
            if handler is not None:
                handler = self._wrapped[details.method] = _wrap(handler)
        return handler


async def _check(request, context):
    return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def _serve(shape: str, port: int, tls: Path) -> None:
    interceptors = {"interceptor": [_Lookup()], "per-call": [_PerCall()]}.get(shape)
    server = grpc.aio.server(interceptors=interceptors)
    handler = echo_handler("grpc.health.v1.Health", _check)
    server.add_generic_rpc_handlers([_Once(handler) if shape == "once" else handler])
    await serve_mtls(server, port, tls)


async def _measure(tls: Path, ports: dict[str, int], pids: dict[str, int], rounds: int,
                   calls: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    credentials = ClientTls.for_identity(tls, "service/gateway").credentials()
    channels = {shape: grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) for shape, port in ports.items()}
    stubs = {shape: health_pb2_grpc.HealthStub(channel).Check for shape, channel in channels.items()}
    request = health_pb2.HealthCheckRequest()
    for shape, channel in channels.items():
        await asyncio.wait_for(channel.channel_ready(), 30)
        for _ in range(300):  # connections up, code paths warm, the once-wrapper built
            await stubs[shape](request, timeout=10)
    p50s: dict[str, list[float]] = {shape: [] for shape in ports}
    cpu_us: dict[str, list[float]] = {shape: [] for shape in ports}
    for index in range(rounds):
        for shape in round_order(SHAPES, index):
            latencies, used = [], process_threads_cpu_s(pids[shape])
            for _ in range(calls):
                started = time.perf_counter()
                await stubs[shape](request, timeout=10)
                latencies.append((time.perf_counter() - started) * 1e6)
            cpu_us[shape].append((process_threads_cpu_s(pids[shape]) - used) / calls * 1e6)
            p50s[shape].append(statistics.median(latencies))
    for channel in channels.values():
        await channel.close()
    return p50s, cpu_us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds; each calls every server in turn")
    parser.add_argument("--calls", type=int, default=2000, help="calls per server and round, one at a time")
    add_serve_arguments(parser, SHAPES)
    args = parser.parse_args()
    if served_as_child(args, _serve):
        return 0
    tls = dev_pki(scratch_dir("edge-wrapping"))
    with child_servers(__file__, SHAPES, tls) as (ports, pids):
        p50s, cpu_us = asyncio.run(_measure(tls, ports, pids, args.rounds, args.calls))
    print(f"\nc=1, {args.calls} calls per server and round, {args.rounds} rounds; medians of the rounds")
    print(f"{'shape':12} {'p50 us':>8} {'vs none':>8} {'cpu us/call':>12} {'vs none':>8}")
    for shape in SHAPES:
        paired_p50 = statistics.median(a - b for a, b in zip(p50s[shape], p50s["none"]))
        paired_cpu = statistics.median(a - b for a, b in zip(cpu_us[shape], cpu_us["none"]))
        print(f"{shape:12} {statistics.median(p50s[shape]):8.1f} {paired_p50:+8.1f} "
              f"{statistics.median(cpu_us[shape]):12.1f} {paired_cpu:+8.1f}")
    print(f"command: {command_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
