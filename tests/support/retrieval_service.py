"""The retrieval service in-process on loopback (real Qdrant Edge, real MiniLM), and a client."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

from agent.retrieval.v1 import retrieval_pb2 as pb
from agent.retrieval.v1 import retrieval_pb2_grpc
from retrieval.service import RETRIEVAL_SERVICE, RetrievalApp
from retrieval.settings import RetrievalSettings
from servicekit import running_service
from retrieval.convert import passage_to_proto
from retrieval.ingest import Passage
from tests.support.grpc_client import mtls_channel


@asynccontextmanager
async def retrieval_server(home: Path, tls_dir: Path, *, interceptors=(), **overrides):
    """Yields (RunningService, RetrievalApp)."""
    settings = RetrievalSettings(home=home, tls_dir=tls_dir, port=0, grace_s=1.0, **overrides)
    app = RetrievalApp(settings)
    async with running_service(app, settings, interceptors=interceptors) as running:
        yield running, app


@asynccontextmanager
async def retrieval_stub(port: int, tls_dir: Path, **channel_options):
    async with mtls_channel(port, tls_dir, identity="service/gateway", services=[RETRIEVAL_SERVICE], **channel_options) as channel:
        yield retrieval_pb2_grpc.RetrievalStub(channel)


def passage_documents(passages: list[Passage]) -> list[pb.Document]:
    """The passages as Documents, with a boolean ``long`` payload field for filter tests."""
    return [passage_to_proto(passage, long=len(passage.text) > 800) for passage in passages]
