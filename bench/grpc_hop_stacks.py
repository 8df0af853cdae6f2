#!/usr/bin/env python3
"""What one unary proxy hop costs in each of gRPC Python's two stacks, with nothing of ours in it.

Issue 13's unary goal (a hop that adds no more than Envoy at c=1) is missed,
and about three quarters of the gateway's CPU per unary call is gRPC's own
machinery (docs/benchmarks.md). grpc.aio runs every call through a poller
thread and hops back to the event loop; its alternative I/O manager was
removed from grpcio. The next step is a stack change, and this bench says
which one is worth it before any gateway code moves:

- ``direct``: the client calls the backend;
- ``aio``: a grpc.aio server whose handler awaits a grpc.aio client call (the gateway's stack);
- ``aio_uvloop``: the same on uvloop's event loop, as the gateway runs it;
- ``aio_interceptor``: the same with one server interceptor that does nothing but wrap the handler per call, the
  shape of servicekit's edge until 2026-12-07 (what the interceptor machinery itself costs; bench/edge_wrapping.py);
- ``aio_config``: ``aio`` with the gateway's server options and its backend channel's (servicekit: keepalive,
  limits, service config with retries, reconnect backoff);
- ``aio_metadata``: ``aio`` that also sends what the gateway adds to each call on the wire: a trace id
  trailer back to the caller, and a traceparent to the backend;
- ``sync``: a grpc sync server (a thread pool) whose handler makes a blocking client call;
- ``envoy``: Envoy, configured as bench/gateway_overhead.py does (the peer's floor).

Each proxy is a bare passthrough (identity serialisers, one long-lived
channel), so what it adds is the stack's floor. Every hop accepts the
keepalive pings of servicekit's clients (transport only), so
bench/gateway_overhead.py's client channels are not sent away mid-run. Backend, proxy and client are
separate processes; every hop is mTLS with client certificates, as ours are.
The backend echoes a 200-byte message, about a top-1 search response.

    python bench/grpc_hop_stacks.py [--calls 400] [--levels 1,16,64] [--sync-threads 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import uvloop
from gateway_overhead import start_envoy
from harness import dev_pki, print_table, scratch_dir, summary, write_json

from servicekit.keepalive import KeepalivePolicy
from servicekit.procfs import cpu_seconds
from tests.support.servers import free_port

#: Under the retrieval service's name, so that the Envoy route of bench/gateway_overhead.py sends it to the backend.
SERVICE, NAME = "agent.retrieval.v1.Retrieval", "BenchEcho"
METHOD = f"/{SERVICE}/{NAME}"
#: The server-streaming method a bare hop forwards when given a stream upstream (the inference service).
STREAMED = "/agent.inference.v1.Inference/Generate"
PAYLOAD = b"x" * 200
#: The proxies measured, each a process of its own (Envoy is added apart).
PROXIES = ("aio", "aio_uvloop", "aio_interceptor", "aio_config", "aio_metadata", "sync")


def _identity(value: bytes) -> bytes:
    return value


def _server_credentials(tls: Path, name: str) -> grpc.ServerCredentials:
    folder = tls / "service" / name
    return grpc.ssl_server_credentials([((folder / "key.pem").read_bytes(), (folder / "cert.pem").read_bytes())],
                                       root_certificates=(tls / "ca.pem").read_bytes(), require_client_auth=True)


def channel_credentials(tls: Path, identity: str) -> grpc.ChannelCredentials:
    folder = tls / identity
    return grpc.ssl_channel_credentials((tls / "ca.pem").read_bytes(), (folder / "key.pem").read_bytes(),
                                        (folder / "cert.pem").read_bytes())


def _echo_handler() -> grpc.GenericRpcHandler:
    async def echo(request, context):
        return request
    method = grpc.unary_unary_rpc_method_handler(echo, request_deserializer=_identity, response_serializer=_identity)
    return grpc.method_handlers_generic_handler(SERVICE, {NAME: method})


def stream_request(messages: int, gap_ms: float) -> bytes:
    """What the backend's ``Generate`` stand-in is asked: ``messages`` messages of ``TOKEN``, ``gap_ms`` apart (an
    engine's decode steps; 0 sends them back to back)."""
    return f"{messages} {gap_ms}".encode()


#: One streamed message of the backend's stand-in: about a one-token delta of the inference service's.
TOKEN = b"t" * 40


def _stream_echo_handler() -> grpc.GenericRpcHandler:
    """``Generate`` as a paced stand-in: a stream of :data:`TOKEN`, as :func:`stream_request` asks."""
    async def stream(request, context):
        count, gap_ms = request.split()
        gap_s = float(gap_ms) / 1000
        for _ in range(int(count)):
            if gap_s > 0:
                await asyncio.sleep(gap_s)
            await context.write(TOKEN)
    service, name = STREAMED.strip("/").split("/")
    method = grpc.unary_stream_rpc_method_handler(stream, request_deserializer=_identity,
                                                  response_serializer=_identity)
    return grpc.method_handlers_generic_handler(service, {name: method})


class _Forward(grpc.GenericRpcHandler):
    """Every unary method, forwarded as bytes over one long-lived channel: a bare passthrough.

    ``channel`` is a grpc.aio or a sync channel; ``behaviour(call)`` makes the handler for an upstream call.
    ``streams`` (grpc.aio only) maps server-streaming methods to the channel they are forwarded on, each message
    read and written as the gateway's Generate does (read, then write, one task).
    """

    def __init__(self, channel, behaviour, streams: dict | None = None) -> None:
        self._channel, self._behaviour, self._handlers = channel, behaviour, {}
        self._streams = streams or {}

    def service(self, details):
        handler = self._handlers.get(details.method)
        if handler is None and details.method in self._streams:
            upstream = self._streams[details.method].unary_stream(details.method, request_serializer=_identity,
                                                                  response_deserializer=_identity)
            handler = self._handlers[details.method] = grpc.unary_stream_rpc_method_handler(
                _aio_stream_forwarding(upstream), request_deserializer=_identity, response_serializer=_identity)
        elif handler is None:
            upstream = self._channel.unary_unary(details.method, request_serializer=_identity,
                                                 response_deserializer=_identity)
            handler = self._handlers[details.method] = grpc.unary_unary_rpc_method_handler(
                self._behaviour(upstream), request_deserializer=_identity, response_serializer=_identity)
        return handler


def _aio_stream_forwarding(upstream):
    async def call(request, context):
        upstream_call = upstream(request, timeout=60)
        while (message := await upstream_call.read()) is not grpc.aio.EOF:
            await context.write(message)
    return call


def _aio_forwarding(upstream):
    async def call(request, context):
        return await upstream(request, timeout=10)
    return call


#: What the gateway adds on the wire to each forwarded call: the trace id trailer back, the trace context on.
_TRAILER = (("x-trace-id", "0af7651916cd43dd8448eb211c80319c"),)
_TRACEPARENT = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)


def _aio_forwarding_with_metadata(upstream):
    async def call(request, context):
        context.set_trailing_metadata(_TRAILER)
        return await upstream(request, timeout=10, metadata=_TRACEPARENT)
    return call


class _PerCallWrap(grpc.aio.ServerInterceptor):
    """Does nothing but what servicekit's edge interceptor's shape cost: awaited per call, it wraps the handler."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        behaviour = handler.unary_unary

        async def wrapped(request, context):
            return await behaviour(request, context)
        return handler._replace(unary_unary=wrapped)


def _our_options(tls: Path, upstream: int) -> tuple[list, grpc.aio.Channel]:
    """The gateway's own server options, and a backend channel as servicekit opens it, for ``aio_config``."""
    from agent.retrieval.v1 import retrieval_pb2
    from gateway.settings import GatewaySettings
    from servicekit.channels import ChannelSpec, open_channel
    from servicekit.server import server_options
    from servicekit.tls import ClientTls

    spec = ChannelSpec(f"127.0.0.1:{upstream}", ClientTls.from_dir(tls / "service" / "gateway"),
                       services=[retrieval_pb2.DESCRIPTOR.services_by_name["Retrieval"]])
    return server_options(GatewaySettings(tls_dir=tls)), open_channel(spec)


async def _serve_aio(port: int, tls: Path, upstream: int | None, role: str, stream_upstream: int | None = None) -> None:
    """The echo backend (``upstream`` None), or the bare grpc.aio hop that ``role`` names.

    With ``stream_upstream``, the hop also forwards the inference service's ``Generate`` stream there.
    """
    channel = None
    if role == "aio_config":
        options, channel = _our_options(tls, upstream)
    else:
        # Accept the keepalive pings of servicekit's clients (bench/gateway_overhead.py's): gRPC's default answers
        # them with GOAWAY too_many_pings, and the reconnect's handshake lands in a measured run. Transport only.
        options = KeepalivePolicy().server_options()
    server = grpc.aio.server(interceptors=[_PerCallWrap()] if role == "aio_interceptor" else None, options=options)
    if upstream is None:
        server.add_generic_rpc_handlers([_echo_handler(), _stream_echo_handler()])
    else:
        channel = channel or grpc.aio.secure_channel(f"127.0.0.1:{upstream}",
                                                     channel_credentials(tls, "service/gateway"))
        forwarding = _aio_forwarding_with_metadata if role == "aio_metadata" else _aio_forwarding
        streams = {} if stream_upstream is None else {STREAMED: grpc.aio.secure_channel(
            f"127.0.0.1:{stream_upstream}", channel_credentials(tls, "service/gateway"))}
        server.add_generic_rpc_handlers([_Forward(channel, forwarding, streams)])
    server.add_secure_port(f"127.0.0.1:{port}", _server_credentials(tls, "retrieval" if upstream is None else "gateway"))
    await server.start()
    await server.wait_for_termination()


def _serve_sync(port: int, tls: Path, upstream: int, threads: int) -> None:
    channel = grpc.secure_channel(f"127.0.0.1:{upstream}", channel_credentials(tls, "service/gateway"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), maximum_concurrent_rpcs=None)
    server.add_generic_rpc_handlers([_Forward(channel, lambda call: lambda request, context: call(request,
                                                                                                  timeout=10))])
    server.add_secure_port(f"127.0.0.1:{port}", _server_credentials(tls, "gateway"))
    server.start()
    server.wait_for_termination()


def _role_main(args) -> None:
    if args.role == "sync":
        _serve_sync(args.port, args.tls, args.upstream, args.sync_threads)
    else:
        run = uvloop.run if args.role == "aio_uvloop" else asyncio.run
        run(_serve_aio(args.port, args.tls, None if args.role == "backend" else args.upstream, args.role,
                       args.stream_upstream))


def start_bare_proxy(port: int, tls: Path, upstream: int, stream_upstream: int | None = None,
                     env: dict[str, str] | None = None) -> subprocess.Popen:
    """A bare grpc.aio passthrough on uvloop (as the gateway runs), on ``port`` to ``upstream``, as its own process.

    With ``stream_upstream`` it also forwards ``Generate`` streams there (bench/gateway_overhead.py --bare);
    ``env``, the process's whole environment (bench/grpc_experiments.py sets gRPC's own variables in it).
    """
    return _start("aio_uvloop", port, tls, upstream, 0, stream_upstream, env)


def start_backend(port: int, tls: Path) -> subprocess.Popen:
    """The echo backend (unary echo, and the paced ``Generate`` stand-in) on ``port``, as its own process."""
    return _start("backend", port, tls, None, 0)


def _start(role: str, port: int, tls: Path, upstream: int | None, threads: int,
           stream_upstream: int | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [sys.executable, __file__, "--role", role, "--port", str(port), "--tls", str(tls),
               "--sync-threads", str(threads)]
    if upstream is not None:
        command += ["--upstream", str(upstream)]
    if stream_upstream is not None:
        command += ["--stream-upstream", str(stream_upstream)]
    return subprocess.Popen(command, env=env)


async def _load(port: int, tls: Path, concurrency: int, calls: int) -> tuple[list[float], float]:
    """Per-call latencies (ms) and calls per second, ``concurrency`` at a time over one channel."""
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", channel_credentials(tls, "tenant/dev")) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)  # the proxy process is up and connected
        call = channel.unary_unary(METHOD, request_serializer=_identity, response_deserializer=_identity)
        for _ in range(50):  # connections up, code paths warm
            await call(PAYLOAD, timeout=10)
        latencies: list[float] = []
        remaining = iter(range(calls))

        async def worker() -> None:
            for _ in remaining:
                started = time.perf_counter()
                await call(PAYLOAD, timeout=10)
                latencies.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, calls / (time.perf_counter() - started)


async def _measure(args, tls: Path, ports: dict[str, int], processes: dict[str, subprocess.Popen]) -> list[dict]:
    rows = []
    for concurrency in args.levels:
        direct_p50 = direct_rate = None
        for path in ("direct", *PROXIES, "envoy"):
            proxy = processes.get(path)
            cpu_before = cpu_seconds(proxy.pid) if proxy else None
            latencies, rate = await _load(ports[path], tls, concurrency, args.calls * max(1, concurrency // 4))
            stats = summary(latencies)
            if path == "direct":
                direct_p50, direct_rate = stats["p50"], rate
            cpu = (cpu_seconds(proxy.pid) - cpu_before) / len(latencies) * 1e6 if proxy else None
            rows.append({"path": path, "c": concurrency, "p50_ms": stats["p50"], "p99_ms": stats["p99"],
                         "added_p50_ms": stats["p50"] - direct_p50, "rate_vs_direct": rate / direct_rate,
                         "proxy_cpu_us_per_call": cpu})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=400, help="calls at c=1 (c/4 times as many at level c)")
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--sync-threads", type=int, default=64, help="the sync proxy's thread pool")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--role", choices=["backend", *PROXIES], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--stream-upstream", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tls", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        return _role_main(args)

    root = scratch_dir("hop-stacks")
    tls = dev_pki(root)
    ports = {"direct": free_port(), **{path: free_port() for path in PROXIES}}
    processes = {"direct": start_backend(ports["direct"], tls)}
    for path in PROXIES:
        processes[path] = _start(path, ports[path], tls, ports["direct"], args.sync_threads)
    processes["envoy"], ports["envoy"] = start_envoy(root, tls, ports["direct"], ports["direct"])
    try:
        rows = asyncio.run(_measure(args, tls, ports, {k: v for k, v in processes.items() if k != "direct"}))
    finally:
        for process in processes.values():
            process.terminate()
            process.wait()
    print_table("one unary hop, mTLS, 200-byte echo; added = p50 - direct's p50 at the same c", rows,
                ["path", "c", "p50_ms", "p99_ms", "added_p50_ms", "rate_vs_direct", "proxy_cpu_us_per_call"])
    write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
