"""Ingest is bounded work: embedded chunk by chunk, stopped by a cancel, and never embedded twice on a retry."""

from __future__ import annotations

import asyncio

import pytest

from agent.retrieval.v1 import retrieval_pb2 as pb
from agent.retrieval.v1 import retrieval_pb2_grpc
from retrieval.service import RETRIEVAL_SERVICE
from retrieval.stores.base import StoreUnavailable
from tests.support.grpc_client import mtls_channel
from tests.support.retrieval_service import retrieval_server

pytestmark = pytest.mark.integration

CHUNK = 16


def _documents(count: int, tag: str) -> list[pb.Document]:
    return [pb.Document(id=f"{tag}-{i}", text=f"{tag} document {i}: " + "a gateway keeps its channels warm. " * 8)
            for i in range(count)]


@pytest.fixture
async def retrieval(tmp_path, pki):
    async with retrieval_server(tmp_path / "home", pki.root, embed_batch=CHUNK) as (running, app):
        async with mtls_channel(running.port, pki.root, services=[RETRIEVAL_SERVICE]) as channel:
            stub = retrieval_pb2_grpc.RetrievalStub(channel)
            await stub.CreateCollection(pb.CreateCollectionRequest(collection=pb.Collection(name="work")), timeout=10)
            yield stub, app


async def test_a_cancelled_ingest_frees_the_embedder_within_one_chunk(retrieval):
    stub, app = retrieval
    embedder = app.servicer.core.embedder
    before = embedder.texts_embedded
    call = stub.Upsert(pb.UpsertRequest(collection="work", documents=_documents(40 * CHUNK, "cancel")), timeout=120)
    for _ in range(600):
        if embedder.texts_embedded - before >= 2 * CHUNK:
            break
        await asyncio.sleep(0.01)
    call.cancel()
    at_cancel = embedder.texts_embedded
    with pytest.raises(asyncio.CancelledError):
        await call
    # A query right after is served, behind at most the chunk that was under way.
    found = await stub.Search(pb.SearchRequest(collection="work", text="warm channels", top_k=1), timeout=30)
    assert found is not None
    await asyncio.sleep(1.0)
    assert embedder.texts_embedded - at_cancel <= CHUNK + 1, (at_cancel, embedder.texts_embedded)  # +1: the query
    assert embedder.texts_embedded - before < 40 * CHUNK  # the rest was never embedded


async def test_a_retried_upsert_embeds_each_text_once(retrieval):
    stub, app = retrieval
    core = app.servicer.core
    store_upsert, failures = core.store.upsert, []

    async def fails_once(name, points):
        if not failures:
            failures.append(name)
            raise StoreUnavailable("injected: the store dropped the first write")
        return await store_upsert(name, points)

    core.store.upsert = fails_once
    try:
        before = core.embedder.texts_embedded
        response = await stub.Upsert(pb.UpsertRequest(collection="work", documents=_documents(20, "retry")), timeout=60)
    finally:
        core.store.upsert = store_upsert
    assert failures == ["work"]  # the first attempt failed at the store; gRPC's retry policy sent it again
    assert response.upserted == 20
    assert core.embedder.texts_embedded - before == 20  # not 40: the retry took the vectors from the cache
