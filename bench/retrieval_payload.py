#!/usr/bin/env python3
"""Search latency and response size: trimmed payloads against full ones, top_k 100.

Root cause addressed: oversized vector-search payloads (the analysis: 1,247
points with full payloads cost 97.6 ms to deserialise, a trimmed result
8.3 ms). Loads documents with large payloads (a 4 KB body, 50 tags, nested
metadata) and compares, in one run:
- ours, trimmed: Search returns the collection's default field (a title);
- ours, every field: Search asked for all payload fields;
- direct and untrimmed: Qdrant Edge in-process with the whole payload and the
  vector, as an untuned client asks for it (no gRPC, so its latency is a floor
  for the work, and its size is the JSON the points would take).

    python bench/retrieval_payload.py [--n 200] [--json bench/out/payload.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from google.protobuf import struct_pb2
from harness import clustered_vectors, command_line, dev_pki, print_table, retrieval_process, scratch_dir, summary, write_json

from agent.retrieval.v1 import retrieval_pb2 as pb
from agent.retrieval.v1 import retrieval_pb2_grpc
from servicekit import ChannelSpec, ClientTls, open_channel

FIELDS = ["title", "body", "tags", "meta"]
WORDS = "gateway latency token cache prefix channel handshake vector payload search recall tenant".split()


def payload_for(index: int, rng: random.Random) -> dict:
    return {
        "title": f"Document {index}",
        "body": " ".join(rng.choice(WORDS) for _ in range(600)),  # about 4 KB
        "tags": [rng.choice(WORDS) for _ in range(50)],
        "meta": {"source": f"s3://bucket/{index}.md", "version": index % 7, "authors": ["a", "b", "c"]},
    }


async def timed_search(stub, request, n: int) -> tuple[list[float], int, int]:
    latencies, size, count = [], 0, 0
    for _ in range(n):
        started = time.perf_counter()
        response = await stub.Search(request, timeout=30)
        latencies.append((time.perf_counter() - started) * 1000)
        size, count = response.ByteSize(), len(response.results)
    return latencies, size, count


async def run(port: int, tls_dir: Path, docs: int, n: int) -> dict:
    rng = random.Random(0)
    vectors = clustered_vectors(docs, 384)
    spec = ChannelSpec(target=f"127.0.0.1:{port}", tls=ClientTls.for_identity(tls_dir, "operator/admin"))
    async with open_channel(spec) as channel:
        stub = retrieval_pb2_grpc.RetrievalStub(channel)
        await stub.CreateCollection(pb.CreateCollectionRequest(
            collection=pb.Collection(name="payload", default_payload_fields=["title"])), timeout=10)
        for start in range(0, docs, 500):
            documents = []
            for i in range(start, min(docs, start + 500)):
                payload = struct_pb2.Struct()
                payload.update(payload_for(i, rng))
                documents.append(pb.Document(id=f"d{i}", vector=pb.Vector(values=vectors[i].tolist()), payload=payload))
            await stub.Upsert(pb.UpsertRequest(collection="payload", documents=documents), timeout=300)
        query = pb.Vector(values=vectors[0].tolist())
        trimmed = pb.SearchRequest(collection="payload", vector=query, top_k=100)
        full = pb.SearchRequest(collection="payload", vector=query, top_k=100, payload_fields=FIELDS)
        await timed_search(stub, trimmed, 5)
        await timed_search(stub, full, 5)
        results = {}
        for _ in range(2):  # alternate halves so drift hits both alike
            for name, request in (("ours, trimmed", trimmed), ("ours, every field", full)):
                latencies, size, count = await timed_search(stub, request, n // 2)
                entry = results.setdefault(name, {"latencies": [], "bytes": size, "results": count})
                entry["latencies"] += latencies
    return results


def direct_untrimmed(edge_dir: Path, vector, n: int) -> dict:
    """The same search straight on the Edge shard, asking for everything."""
    import qdrant_edge as qe

    shard = qe.EdgeShard.load(str(edge_dir / "payload" / "shard"))
    try:
        request = qe.SearchRequest(query=qe.Query.Nearest(list(vector)), limit=100, with_payload=True, with_vector=True)
        latencies, size = [], 0
        for _ in range(n):
            started = time.perf_counter()
            points = shard.search(request)
            records = [{"id": str(p.id), "score": p.score, "payload": p.payload, "vector": p.vector} for p in points]
            latencies.append((time.perf_counter() - started) * 1000)
            size = len(json.dumps(records))
        return {"latencies": latencies, "bytes": size, "results": len(points)}
    finally:
        shard.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--n", type=int, default=200, help="searches per variant")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    root = scratch_dir("payload")
    tls_dir = dev_pki(root)
    service = retrieval_process(root, tls_dir, "retrieval")
    try:
        results = asyncio.run(run(service.wait_serving(), tls_dir, args.docs, args.n))
    finally:
        service.stop()
    # The service is stopped, so the shard can be opened directly.
    results["direct, untrimmed (vectors too)"] = direct_untrimmed(
        root / "home" / "qdrant-edge", clustered_vectors(args.docs, 384)[0], args.n)
    rows, stats = [], {}
    for name, entry in results.items():
        s = summary(entry["latencies"])
        stats[name] = {**s, "bytes": entry["bytes"], "results": entry["results"]}
        rows.append({"variant": name, "results": entry["results"], "response bytes": entry["bytes"],
                     "p50 ms": s["p50"], "p95 ms": s["p95"], "p99 ms": s["p99"]})
    print_table(f"Search, top_k 100, {args.docs} documents with ~5 KB payloads", rows,
                ["variant", "results", "response bytes", "p50 ms", "p95 ms", "p99 ms"])
    trimmed, full = stats["ours, trimmed"], stats["ours, every field"]
    print(f"\ntrimmed vs every field: {full['bytes'] / trimmed['bytes']:.0f}x fewer bytes, "
          f"p50 {full['p50'] / trimmed['p50']:.1f}x faster")
    print(f"command: {command_line()}")
    write_json(args.json, stats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
