#!/usr/bin/env python3
"""A vector search's own Python, in process: what the retrieval service does for one ``Search`` besides gRPC.

One real Qdrant Edge store with the passthrough benches' collection (200
points of 384 values, ``gateway_overhead.COLLECTION``), and the servicer's
path for a ``Search`` with a vector and ``top_k=1``: the request parsed,
converted (``search_from_proto``), searched (``RetrievalCore.search``), and
the answer converted and serialised. No gRPC, no event loop other than the
bench's own: these are the per-call costs that code of ours decides, apart
from the transport's (which ``edge_unary_paths.py`` measures with them, in a
served process, where the host's noise is larger than they are).

Reported: CPU microseconds a call (``time.process_time``) for the whole path,
the median of ``--repeats`` loops of ``--calls`` calls, then each stage on
its own (the best of five loops, ``timeit``'s way).

    python bench/search_path.py [--calls 5000] [--repeats 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import timeit
from pathlib import Path

from gateway_overhead import COLLECTION, DIM
from harness import command_line, scratch_dir, write_json

from agent.retrieval.v1 import retrieval_pb2
from retrieval.convert import documents_from_proto, search_from_proto, search_to_proto
from retrieval.core import RetrievalCore
from retrieval.settings import RetrievalSettings
from retrieval.stores.base import CollectionSpec
from retrieval.stores.edge import EdgeStore

NAME = f"t3-dev-{COLLECTION}"


class _VectorsOnly:
    """The embedder's place in the core: every document and query here comes with its vector."""

    dimension = DIM

    async def embed_documents(self, texts, batch_size):
        return []


def _best_us(call, number: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


async def measure(root: Path, calls: int, repeats: int) -> dict:
    store = await EdgeStore.open(root / "edge")
    settings = RetrievalSettings(home=root)
    core = RetrievalCore(store, _VectorsOnly(), settings)
    try:
        await core.create_collection(CollectionSpec(name=NAME, vector_size=DIM))
        await core.upsert(NAME, documents_from_proto([
            retrieval_pb2.Document(id=f"d{i}", vector=retrieval_pb2.Vector(values=[(i % 7) / 7.0 + 0.01] * DIM))
            for i in range(200)]))
        await store.prepare_for_search(NAME)
        data = retrieval_pb2.SearchRequest(collection=NAME, vector=retrieval_pb2.Vector(values=[0.05] * DIM),
                                           top_k=1).SerializeToString()

        async def one() -> bytes:
            request = retrieval_pb2.SearchRequest.FromString(data)
            output = await core.search(search_from_proto(request))
            return search_to_proto(output, settings.max_response_bytes).SerializeToString()

        for _ in range(calls // 2):  # warm: the store's cost record, the allocator
            await one()
        loops = []
        for _ in range(repeats):
            started = time.process_time()
            for _ in range(calls):
                await one()
            loops.append((time.process_time() - started) / calls * 1e6)
        request = retrieval_pb2.SearchRequest.FromString(data)
        converted = search_from_proto(request)
        output = await core.search(converted)
        core_loops = []
        for _ in range(repeats):
            started = time.process_time()
            for _ in range(calls):
                await core.search(converted)
            core_loops.append((time.process_time() - started) / calls * 1e6)
        number = max(1000, calls * 4)
        return {
            "whole_us": statistics.median(loops), "whole_loops_us": loops,
            "parse_us": _best_us(lambda: retrieval_pb2.SearchRequest.FromString(data), number),
            "search_from_proto_us": _best_us(lambda: search_from_proto(request), number),
            "core_search_us": statistics.median(core_loops),
            "search_to_proto_us": _best_us(
                lambda: search_to_proto(output, settings.max_response_bytes).SerializeToString(), number),
        }
    finally:
        await store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls per loop")
    parser.add_argument("--repeats", type=int, default=7, help="loops; the median is reported")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(measure(scratch_dir("search-path"), args.calls, args.repeats))
    print(f"a Search's own path, CPU µs a call: {result['whole_us']:.1f} "
          f"(loops {', '.join(f'{v:.1f}' for v in result['whole_loops_us'])})")
    for stage in ("parse", "search_from_proto", "core_search", "search_to_proto"):
        print(f"  {stage:18} {result[f'{stage}_us']:6.2f}")
    print(f"command: {command_line()}")
    write_json(args.json, {"calls": args.calls, "repeats": args.repeats, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
