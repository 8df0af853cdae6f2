#!/usr/bin/env python3
"""Where the edge's unary cost at c=1 goes: Envoy's filters against the backend's public handler.

`bench/gateway_overhead.py --edge` finds the edge's ``Retrieve`` about
0.05 ms above a plain Envoy at one call at a time (docs/benchmarks.md, "The
edge"). This bench splits that: one retrieval service (behind the edge it
serves the public ``Retrieve``), called at c=1 on each path below, in rounds
whose order changes from round to round (``harness.round_order``: the
same noise for all), reporting each path's
median p50 and its paired difference from the plain Envoy:

- ``direct``: ``Retrieval.Search`` on the service, no hop;
- ``envoy``: the same through a plain Envoy (no filter, no header);
- ``envoy-twin``: the same through a second plain Envoy, configured as the
  first: its paired difference from ``envoy`` should be 0, so what it
  measures is the host's noise in a paired difference, the floor under
  which no other path's gap from Envoy is resolved (on 2 shared cores,
  tenths of a millisecond in a run: docs/benchmarks.md);
- ``envoy-lean``: the same plain Envoy with the two settings the edge takes
  from it (no ``x-request-id`` generated, no ``x-envoy-*`` headers): what the
  edge costs over an Envoy as lean as itself;
- ``edge``: ``AgentGateway.Retrieve`` through the edge as `agentgw
  edge-config` writes it (the tenant's certificate forwarded, the request
  held by the buffer filter, the trace headers dropped);
- ``edge-nobuffer``, ``edge-nostrip``: the same without the buffer filter, or
  without the header removal: what each of Envoy's extra steps costs;
- ``public-direct``: ``AgentGateway.Retrieve`` on the service itself, called
  with the edge's certificate and a forwarded-certificate header as Envoy sets
  it: the backend's public handler (the forwarded certificate's authorization,
  the bounds, the tenant's scoping, the wrap) with no Envoy at all;
- ``direct-xfcc``, ``direct-xfcc-uri``: ``Search`` called directly with the
  forwarded-certificate header as the edge sets it, and with the same header
  less the certificate (``URI`` and ``Hash`` alone): what the header itself
  costs the backend (a plain ``Search`` reads none of it), and how much of
  that is the certificate's 1.2 KB.

Next to each path's latency it reports the retrieval process's CPU per call
(every thread's on-CPU time from ``/proc/<pid>/task/*/schedstat``, in
nanoseconds, summed over the rounds): what the backend's own work per call
costs, with less of the host's noise than a latency; and the same of the
path's proxy (its Envoy, every worker), which shares the host's cores with
the backend. ``--concurrency 64`` runs each path's calls 64 at a time, as
the issue's c=64 throughput goal does, and the calls/s column (each round's
calls over its wall time, the median of the rounds, and its ratio to
direct) says what the per-call CPU of each step costs in throughput.

    python bench/edge_unary_paths.py [--rounds 8] [--calls 300] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote

from harness import UNBOUNDED_ADMISSION, dev_pki, retrieval_process, round_order, scratch_dir

from agent.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from agent.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from agentgw.edge import edge_config
from agentgw.edge_process import envoy_binary
from gateway_overhead import COLLECTION, DIM, envoy_config, run_level
from servicekit import ChannelSpec, ClientTls, open_channel, wait_ready
from servicekit.forwarded import XFCC_HEADER
from servicekit.procfs import thread_cpu_s
from servicekit.tenancy import physical_collection
from tests.support.servers import free_port


#: The paths through a proxy, in the order their proxies start.
PROXIED = ("envoy", "envoy-twin", "envoy-lean", "edge", "edge-nobuffer", "edge-nostrip")
#: The plain Envoys' paths: ``Search`` as an operator calls it.
PLAIN = ("envoy", "envoy-twin", "envoy-lean")


def start_envoy(workdir: Path, bootstrap: dict) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "bootstrap.json"
    path.write_text(json.dumps(bootstrap))
    return subprocess.Popen([envoy_binary(), "-c", str(path), "--concurrency", "2", "--log-level", "error",
                             "--use-dynamic-base-id"], stdout=(workdir / "envoy.log").open("wb"),
                            stderr=subprocess.STDOUT)


def lean(bootstrap: dict) -> dict:
    """A bootstrap whose connection managers generate no request id and whose routers add no x-envoy-* headers."""
    bootstrap = copy.deepcopy(bootstrap)
    for listener in bootstrap["static_resources"]["listeners"]:
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        manager["generate_request_id"] = False
        manager["http_filters"][-1]["typed_config"]["suppress_envoy_headers"] = True
    return bootstrap


def edge_variant(tls: Path, workdir: Path, port: int, retrieval_port: int, *, buffer: bool = True,
                 strip: bool = True) -> subprocess.Popen:
    """The edge's bootstrap, less its buffer filter or its header removal."""
    config = edge_config(tls, workdir / "edge.json", listen=f"127.0.0.1:{port}", gateway="127.0.0.1:9",
                         inference=["127.0.0.1:9"], retrieval=f"127.0.0.1:{retrieval_port}")
    config.write()  # the secret files the bootstrap names
    bootstrap = copy.deepcopy(config.bootstrap)
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    if not buffer:
        manager["http_filters"] = [f for f in manager["http_filters"] if "buffer" not in f["name"]]
        for route in routes:
            route.pop("typed_per_filter_config", None)
    if not strip:
        for route in routes:
            route.pop("request_headers_to_remove", None)
    return start_envoy(workdir, bootstrap)


async def seed(tls: Path, port: int) -> None:
    """The dev tenant's collection, written as the gateway would write it."""
    async with open_channel(ChannelSpec(target=f"127.0.0.1:{port}",
                                        tls=ClientTls.for_identity(tls, "service/gateway"))) as channel:
        stub = retrieval_pb2_grpc.RetrievalStub(channel)
        name = physical_collection("dev", COLLECTION)
        await stub.CreateCollection(retrieval_pb2.CreateCollectionRequest(
            collection=retrieval_pb2.Collection(name=name, vector_size=DIM)), timeout=60)
        await stub.Upsert(retrieval_pb2.UpsertRequest(collection=name, documents=[
            retrieval_pb2.Document(id=f"d{i}", vector=retrieval_pb2.Vector(values=[(i % 7) / 7.0 + 0.01] * DIM))
            for i in range(200)]), timeout=60)


def process_cpu_s(pid: int) -> float:
    """Every thread's on-CPU time of process ``pid`` (schedstat, ns resolution), in seconds."""
    return sum(thread_cpu_s(pid).values())


@dataclass
class Measured:
    """Per path: each round's p50 (ms) and calls/s, and the CPU per call over all rounds (µs) of the backend
    process and of the path's proxy (paths through one)."""

    p50s: dict[str, list[float]]
    rates: dict[str, list[float]]
    retrieval_cpu_us: dict[str, float]
    proxy_cpu_us: dict[str, float]


async def _one(answer) -> int:
    """A unary call awaited, counted as one message (``gateway_overhead.run_level`` counts what it reads)."""
    await answer
    return 1


async def measure(tls: Path, ports: dict[str, int], rounds: int, calls: int, concurrency: int, backend_pid: int,
                  proxy_pids: dict[str, int]) -> Measured:
    """Each round: ``calls`` calls, ``concurrency`` at a time, on each path in turn; the backend's and each path's
    proxy's (``proxy_pids``, by path) CPU is read around each path's calls."""
    def channel(port: int, identity: str):
        return open_channel(ChannelSpec(target=f"127.0.0.1:{port}", tls=ClientTls.for_identity(tls, identity)))

    vector = retrieval_pb2.Vector(values=[0.05] * DIM)
    search = retrieval_pb2.SearchRequest(collection=physical_collection("dev", COLLECTION), vector=vector, top_k=1)
    retrieve = gateway_pb2.RetrieveRequest(
        request=retrieval_pb2.SearchRequest(collection=COLLECTION, vector=vector, top_k=1))
    # As Envoy sets it for the dev tenant's certificate (agentgw.edge: SANITIZE_SET, Cert and URI).
    cert = quote((tls / "tenant" / "dev" / "cert.pem").read_text(), safe="")
    forwarded = ((XFCC_HEADER, f'By=spiffe://agentgw.local/service/edge;Hash=00;Cert="{cert}";'
                               "URI=spiffe://agentgw.local/tenant/dev"),)
    # The same header without the certificate (Envoy's URI field alone; Hash is always set): what its size costs.
    uri_only = ((XFCC_HEADER, f"By=spiffe://agentgw.local/service/edge;Hash={'0' * 64};"
                              "URI=spiffe://agentgw.local/tenant/dev"),)
    channels = {"direct": channel(ports["retrieval"], "operator/admin"),
                **{name: channel(ports[name], "operator/admin") for name in PLAIN},
                **{name: channel(ports[name], "tenant/dev") for name in ("edge", "edge-nobuffer", "edge-nostrip")},
                "public-direct": channel(ports["retrieval"], "service/edge")}
    for name, ch in channels.items():
        await wait_ready(ch, timeout_s=30, target=name)
    # Every path's stub is built once: a stub builds a callable per method of its service, tens of µs a call
    # if built per call (until 2026-12-06 the direct, Envoy and public-direct paths did, and the edge's did not).
    searches = {name: retrieval_pb2_grpc.RetrievalStub(channels[name]).Search for name in ("direct", *PLAIN)}
    retrieves = {name: gateway_pb2_grpc.AgentGatewayStub(channels[name]).Retrieve
                 for name in ("edge", "edge-nobuffer", "edge-nostrip", "public-direct")}
    paths = {
        **{name: (lambda call: lambda: call(search, timeout=10))(searches[name]) for name in ("direct", *PLAIN)},
        **{name: (lambda call: lambda: call(retrieve, timeout=10))(retrieves[name])
           for name in ("edge", "edge-nobuffer", "edge-nostrip")},
        "public-direct": lambda: retrieves["public-direct"](retrieve, timeout=10, metadata=forwarded),
        "direct-xfcc": lambda: searches["direct"](search, timeout=10, metadata=forwarded),
        "direct-xfcc-uri": lambda: searches["direct"](search, timeout=10, metadata=uri_only),
    }
    p50s: dict[str, list[float]] = {name: [] for name in paths}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    cpu_s = dict.fromkeys(paths, 0.0)
    proxy_cpu_s = dict.fromkeys(proxy_pids, 0.0)
    counted = {name: (lambda call: lambda: _one(call()))(call) for name, call in paths.items()}
    for call in paths.values():  # warm every path
        for _ in range(100):
            await call()
    names = list(paths)
    for index in range(rounds):
        # Each path follows each other in turn (harness.round_order), so none inherits one neighbour's
        # wake-ups and cache state in every round.
        for name in round_order(names, index):
            used = process_cpu_s(backend_pid)
            proxy_used = process_cpu_s(proxy_pids[name]) if name in proxy_pids else 0.0
            latencies, rate, _ = await run_level([counted[name]], concurrency, calls)
            cpu_s[name] += process_cpu_s(backend_pid) - used
            if name in proxy_pids:
                proxy_cpu_s[name] += process_cpu_s(proxy_pids[name]) - proxy_used
            p50s[name].append(statistics.median(latencies))
            rates[name].append(rate)
        print(f"round {index + 1}: " + ", ".join(f"{name} {values[-1]:.3f}" for name, values in p50s.items()),
              flush=True)
    for ch in channels.values():
        await ch.close()

    def per_call_us(seconds: dict[str, float]) -> dict[str, float]:
        return {name: total / (rounds * calls) * 1e6 for name, total in seconds.items()}
    return Measured(p50s, rates, per_call_us(cpu_s), per_call_us(proxy_cpu_s))


def report(measured: Measured, rounds: int, calls: int, concurrency: int) -> None:
    p50s = measured.p50s
    print(f"\nc={concurrency}, {calls} calls per path and round, {rounds} rounds; medians of the rounds' p50s and "
          "calls/s; CPU per call over all rounds")
    print(f"{'path':16} {'p50 ms':>8} {'added ms':>9} {'vs envoy, paired ms':>20} {'calls/s':>8} "
          f"{'vs direct':>9} {'retrieval cpu us/call':>22} {'proxy cpu us/call':>18}")
    direct_rate = statistics.median(measured.rates["direct"])
    for name, values in p50s.items():
        added = statistics.median(v - d for v, d in zip(values, p50s["direct"]))
        paired = statistics.median(v - e for v, e in zip(values, p50s["envoy"]))
        rate = statistics.median(measured.rates[name])
        proxy = f"{measured.proxy_cpu_us[name]:18.1f}" if name in measured.proxy_cpu_us else f"{'':18}"
        print(f"{name:16} {statistics.median(values):8.3f} {added:+9.3f} {paired:+20.3f} {rate:8.0f} "
              f"{rate / direct_rate:9.0%} {measured.retrieval_cpu_us[name]:22.1f} {proxy}")
    twin = statistics.median(t - e for t, e in zip(p50s["envoy-twin"], p50s["envoy"]))
    print(f"noise floor: a second plain Envoy, configured as the first, measured {twin:+.3f} ms against it (paired): "
          f"a path's gap from Envoy within ±{abs(twin):.3f} ms is not resolved by this run")
    print(f"command: python bench/edge_unary_paths.py --rounds {rounds} --calls {calls} --concurrency {concurrency}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds; each calls every path in turn")
    parser.add_argument("--calls", type=int, default=300, help="calls per path and round")
    parser.add_argument("--concurrency", type=int, default=1, help="calls in flight at once on a path")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    root = scratch_dir("edge-unary")
    tls = dev_pki(root)
    retrieval = retrieval_process(root, tls, "retrieval", AGW_RETRIEVAL_EDGE_CLIENTS="service/edge",
                                  **UNBOUNDED_ADMISSION)
    proxies = []
    try:
        ports = {"retrieval": retrieval.wait_serving(), **{name: free_port() for name in PROXIED}}
        proxies = [*(start_envoy(root / name, envoy_config(tls, ports[name], ports["retrieval"], 9))
                     for name in ("envoy", "envoy-twin")),
                   start_envoy(root / "envoy-lean",
                               lean(envoy_config(tls, ports["envoy-lean"], ports["retrieval"], 9))),
                   edge_variant(tls, root / "edge", ports["edge"], ports["retrieval"]),
                   edge_variant(tls, root / "edge-nobuffer", ports["edge-nobuffer"], ports["retrieval"], buffer=False),
                   edge_variant(tls, root / "edge-nostrip", ports["edge-nostrip"], ports["retrieval"], strip=False)]
        asyncio.run(seed(tls, ports["retrieval"]))
        measured = asyncio.run(measure(tls, ports, args.rounds, args.calls, args.concurrency, retrieval.pid,
                                       dict(zip(PROXIED, (proxy.pid for proxy in proxies)))))
    finally:
        for proxy in proxies:
            proxy.terminate()
            proxy.wait()
        retrieval.stop()
    report(measured, args.rounds, args.calls, args.concurrency)
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "calls": args.calls,
                                         "concurrency": args.concurrency, **asdict(measured)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
