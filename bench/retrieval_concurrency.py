#!/usr/bin/env python3
"""Search latency under concurrency: query embeddings batched across concurrent calls, against one pass each.

Root cause addressed: CPU work queued on the event loop's executor (each text
query is a forward pass of the embedder; eight concurrent searches made eight
passes in a row, and the agent-turn bench measured retrieval at 180-450 ms
p50 at concurrency 8). Two retrieval services on the same corpus, in one run:
- batched: queries arriving while a pass runs share the next pass
  (``AGW_RETRIEVAL_EMBED_QUERY_BATCH=32``, the default);
- one pass each: ``AGW_RETRIEVAL_EMBED_QUERY_BATCH=1``, as before.
They take turns, in halves, at each concurrency level, so drift hits both.
With ``--compare precision`` (or ``--precision``), the two services both
batch, and differ in the embedder's matrix products instead: bfloat16
(``AGW_RETRIEVAL_EMBED_BF16=on``) against fp32 (``off``). With ``--compare
query-batch``, in the largest pass: 32 queries (the default) against 16. With
``--compare fused``, the forward pass fused (``AGW_RETRIEVAL_EMBED_FUSED``,
the default) against the model's own modules.

    python bench/retrieval_concurrency.py [--n 160] [--compare batching|precision|query-batch|fused] [--json bench/out/retrieval_concurrency.json]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from contextlib import AsyncExitStack
from pathlib import Path

from harness import command_line, dev_pki, print_table, retrieval_process, scratch_dir, summary, write_json

from agent.retrieval.v1 import retrieval_pb2 as pb
from agent.retrieval.v1 import retrieval_pb2_grpc
from retrieval.convert import passage_to_proto
from retrieval.ingest import sample_corpus
from servicekit import ChannelSpec, ClientTls, open_channel, wait_ready

QUERIES = ["context manager enter and exit", "iterate over a sequence", "format a string with placeholders",
           "import a module from a package", "define a class with methods", "catch an exception",
           "anonymous function", "assert a condition holds", "delete a name", "global and nonlocal names",
           "slicing a list", "comparison operators", "boolean operations", "the while loop", "raise an error",
           "numeric literals"]
#: Each comparison's two services, by the settings that tell them apart; the ratio is the second's p50 over the first's.
COMPARISONS = {
    "batching": {"batched": {"AGW_RETRIEVAL_EMBED_QUERY_BATCH": "32"},
                 "one pass each": {"AGW_RETRIEVAL_EMBED_QUERY_BATCH": "1"}},
    "precision": {"bf16": {"AGW_RETRIEVAL_EMBED_BF16": "on"}, "fp32": {"AGW_RETRIEVAL_EMBED_BF16": "off"}},
    "query-batch": {"batch 32": {"AGW_RETRIEVAL_EMBED_QUERY_BATCH": "32"},
                    "batch 16": {"AGW_RETRIEVAL_EMBED_QUERY_BATCH": "16"}},
    "fused": {"fused": {"AGW_RETRIEVAL_EMBED_FUSED": "true"}, "modules": {"AGW_RETRIEVAL_EMBED_FUSED": "false"}},
}


async def searches(stub, concurrency: int, n: int) -> list[float]:
    latencies: list[float] = []

    async def worker(index: int) -> None:
        for turn in range(n // concurrency):
            request = pb.SearchRequest(collection="docs", text=QUERIES[(index * 7 + turn) % len(QUERIES)], top_k=4)
            started = time.perf_counter()
            await stub.Search(request, timeout=30)
            latencies.append((time.perf_counter() - started) * 1000)

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return latencies


async def run(ports: dict[str, int], tls_dir: Path, levels: list[int], n: int) -> tuple[dict, dict[str, float]]:
    """Search latencies by level and service, and each service's time to ingest the corpus (ms)."""
    documents = [passage_to_proto(passage) for passage in sample_corpus(max_per_topic=2)[:200]]
    upserts: dict[str, float] = {}
    async with AsyncExitStack() as stack:
        stubs = {}
        for name, port in ports.items():
            channel = await stack.enter_async_context(open_channel(ChannelSpec(
                target=f"127.0.0.1:{port}", tls=ClientTls.for_identity(tls_dir, "operator/admin"))))
            await wait_ready(channel, timeout_s=60, target=name)
            stubs[name] = retrieval_pb2_grpc.RetrievalStub(channel)
        # Every service ready before the first ingest: one still loading its model would take CPU from it.
        for name, stub in stubs.items():
            await stub.CreateCollection(pb.CreateCollectionRequest(collection=pb.Collection(name="docs")), timeout=10)
            started = time.perf_counter()
            await stub.Upsert(pb.UpsertRequest(collection="docs", documents=documents), timeout=300)
            upserts[name] = (time.perf_counter() - started) * 1000
            await searches(stub, 1, 8)  # warm
        results: dict[int, dict[str, list[float]]] = {}
        for concurrency in levels:
            rows = results.setdefault(concurrency, {name: [] for name in stubs})
            for half in range(2):
                for name in (list(stubs) if half == 0 else list(reversed(stubs))):
                    rows[name] += await searches(stubs[name], concurrency, n // 2)
        return results, upserts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=160, help="searches per variant and concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="batching",
                        help="batching: batched against one pass each; precision: bfloat16 against fp32; "
                             "query-batch: passes of up to 32 queries against 16; fused: the fused forward pass "
                             "against the model's modules")
    parser.add_argument("--precision", action="store_const", const="precision", dest="compare",
                        help="the same as --compare precision")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    root = scratch_dir("retrieval-concurrency")
    tls_dir = dev_pki(root)
    variants = COMPARISONS[args.compare]
    first, second = variants
    ratio_name = f"p50 ratio ({second} / {first})"
    services = {name: retrieval_process(root, tls_dir, name.replace(" ", "-"), **env,
                                        AGW_HOME=str(root / name.replace(" ", "-") / "home"))  # its own Edge store
                for name, env in variants.items()}
    try:
        ports = {name: service.wait_serving() for name, service in services.items()}
        results, upserts = asyncio.run(run(ports, tls_dir, args.concurrency, args.n))
    finally:
        for service in services.values():
            service.stop()
    table, stats = [], {}
    for concurrency, rows in results.items():
        for name, latencies in rows.items():
            s = summary(latencies)
            stats.setdefault(str(concurrency), {})[name] = s
            table.append({"conc": concurrency, "variant": name, "n": s["n"], "p50": s["p50"], "p95": s["p95"],
                          "p99": s["p99"]})
        stats[str(concurrency)][ratio_name] = stats[str(concurrency)][second]["p50"] / stats[str(concurrency)][first]["p50"]
    print_table("Search with a text query, latency ms (all-MiniLM-L6-v2 on CPU, Qdrant Edge, 200 passages)", table,
                ["conc", "variant", "n", "p50", "p95", "p99"])
    for concurrency in results:
        print(f"c={concurrency}: {second} / {first}, p50: {stats[str(concurrency)][ratio_name]:.2f}x")
    print("ingest of the 200 passages (one Upsert, embedded in passes of 64): "
          + ", ".join(f"{name} {ms:.0f} ms" for name, ms in upserts.items()))
    print(f"command: {command_line()}")
    write_json(args.json, {"stats": stats, "upsert_ms": upserts})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
