"""``agentgw ingest`` and ``agentgw tune-ef``: clients of a running retrieval service."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from agent.retrieval.v1 import retrieval_pb2 as pb
from agent.retrieval.v1 import retrieval_pb2_grpc
from servicekit import ChannelSpec, ClientTls, ServiceSettings, open_channel, wait_ready
from servicekit.identity import Identity

from retrieval.convert import passage_to_proto
from retrieval.ingest import Passage, files_to_passages, sample_corpus

# Only the contract, not the service: this module is imported by every
# `agentgw` invocation to build its parser, and must stay light.
RETRIEVAL_SERVICE = pb.DESCRIPTOR.services_by_name["Retrieval"]
BATCH = 128


def add_arguments(ingest: argparse.ArgumentParser, tune: argparse.ArgumentParser) -> None:
    for parser in (ingest, tune):
        parser.add_argument("--target", default="127.0.0.1:50052", help="retrieval service address")
        parser.add_argument("--identity", default=str(Identity.operator()),
                            help="certificate to present, kind/name (default: the operator's)")
    ingest.add_argument("paths", nargs="*", type=Path, help="text or Markdown files or folders")
    ingest.add_argument("--sample", action="store_true", help="ingest the bundled sample corpus (Python's help topics)")
    ingest.add_argument("--collection", default="docs")
    tune.add_argument("collection")
    tune.add_argument("--target-recall", type=float, default=0.0, help="default: the service's (0.98)")
    tune.add_argument("--k", type=int, default=10)
    tune.add_argument("--sample-size", type=int, default=100)
    tune.add_argument("--queries", type=Path, help="file with one query per line, instead of sampled documents")


def channel_spec(args, settings: ServiceSettings) -> ChannelSpec:
    """The channel ``ingest`` and ``tune-ef`` open: the operator's certificate, the settings' keepalive."""
    return ChannelSpec(target=args.target, tls=ClientTls.for_identity(settings.tls_dir, args.identity),
                       services=[RETRIEVAL_SERVICE], keepalive=settings.keepalive)


def _channel(args, settings: ServiceSettings):
    return open_channel(channel_spec(args, settings))


def _progress(done: int, total: int) -> None:
    width = 30
    filled = width * done // max(total, 1)
    print(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end="", file=sys.stderr, flush=True)


async def ingest(args, settings: ServiceSettings) -> int:
    passages: list[Passage] = sample_corpus() if args.sample else []
    passages += files_to_passages(args.paths)
    if not passages:
        print("agentgw ingest: nothing to ingest; name files or folders, or pass --sample", file=sys.stderr)
        return 2
    async with _channel(args, settings) as channel:
        await wait_ready(channel, timeout_s=10, target=args.target)
        stub = retrieval_pb2_grpc.RetrievalStub(channel)
        try:
            await stub.GetCollection(pb.GetCollectionRequest(name=args.collection), timeout=10)
        except Exception:  # noqa: BLE001 - NOT_FOUND: create it; anything else recurs below
            await stub.CreateCollection(pb.CreateCollectionRequest(
                collection=pb.Collection(name=args.collection, default_payload_fields=["text", "source"])), timeout=10)
        print(f"ingesting {len(passages)} passages into {args.collection!r}", file=sys.stderr)
        for start in range(0, len(passages), BATCH):
            documents = [passage_to_proto(passage) for passage in passages[start:start + BATCH]]
            await stub.Upsert(pb.UpsertRequest(collection=args.collection, documents=documents), timeout=300)
            _progress(min(start + BATCH, len(passages)), len(passages))
    print(file=sys.stderr)
    return 0


async def tune_ef(args, settings: ServiceSettings) -> int:
    queries = [q.strip() for q in args.queries.read_text().splitlines() if q.strip()] if args.queries else []
    async with _channel(args, settings) as channel:
        stub = retrieval_pb2_grpc.RetrievalStub(channel)
        report = await stub.TuneCollection(pb.TuneCollectionRequest(
            collection=args.collection, target_recall=args.target_recall, k=args.k,
            sample_size=args.sample_size, queries=queries), timeout=900)
    print(f"{'ef':>5}  {'recall@' + str(args.k):>9}  {'p50 ms':>7}  {'p95 ms':>7}")
    for m in report.measurements:
        print(f"{m.ef:>5}  {m.recall:>9.3f}  {m.p50_ms:>7.2f}  {m.p95_ms:>7.2f}")
    verdict = "meets the target" if report.target_met else "is the best found; the target was NOT met"
    print(f"stored ef={report.chosen_ef} with {args.collection!r} (recall {report.recall:.3f}); it {verdict}")
    return 0 if report.target_met else 1


def run(command: str, args, settings: ServiceSettings) -> int:
    return asyncio.run(ingest(args, settings) if command == "ingest" else tune_ef(args, settings))
