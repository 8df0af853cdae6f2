"""The retrieval service on real Qdrant Edge with the real all-MiniLM-L6-v2 embedder."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.rpc import error_details_pb2

from agent.retrieval.v1 import retrieval_pb2 as pb
from servicekit.errors import status_details
from retrieval.ingest import sample_corpus
from tests.support.retrieval_service import passage_documents, retrieval_server, retrieval_stub

pytestmark = pytest.mark.integration

COLLECTION = "pydoc"


@pytest.fixture(scope="module")
async def service(tmp_path_factory, pki):
    async with retrieval_server(tmp_path_factory.mktemp("retrieval"), pki.root) as (running, app):
        yield running, app


@pytest.fixture(scope="module")
async def stub(service, pki):
    running, _ = service
    async with retrieval_stub(running.port, pki.root) as stub:
        yield stub


@pytest.fixture(scope="module")
async def corpus(stub):
    """A few hundred passages of Python's help topics, ingested once."""
    passages = sample_corpus(max_per_topic=6)
    await stub.CreateCollection(pb.CreateCollectionRequest(collection=pb.Collection(
        name=COLLECTION, default_payload_fields=["topic"]
    )), timeout=10)
    response = await stub.Upsert(pb.UpsertRequest(collection=COLLECTION, documents=passage_documents(passages)), timeout=120)
    assert response.upserted == len(passages) >= 300
    return passages


async def _search(stub, **fields) -> pb.SearchResponse:
    return await stub.Search(pb.SearchRequest(collection=COLLECTION, **fields), timeout=10)


@pytest.mark.parametrize(
    ("query", "topic"),
    [
        ("context manager enter and exit", "with"),
        ("iterate over the items of a sequence with a loop", "for"),
        ("format a string with placeholders", "formatstrings"),
        ("import a module from a package", "import"),
    ],
)
async def test_query_about_a_topic_finds_its_passage_in_the_top_3(stub, corpus, query, topic):
    response = await _search(stub, text=query, top_k=3)
    topics = [r.payload["topic"] for r in response.results]
    assert topic in topics, f"{query!r} -> {[r.id for r in response.results]}"
    assert response.hnsw_ef > 0 and not response.truncated


async def test_collection_reports_dimension_and_count(stub, corpus):
    collection = (await stub.GetCollection(pb.GetCollectionRequest(name=COLLECTION), timeout=5)).collection
    assert collection.vector_size == 384
    assert collection.distance == pb.DISTANCE_COSINE
    assert collection.point_count == len(corpus)
    assert list(collection.default_payload_fields) == ["topic"]


async def test_filter_restricts_results(stub, corpus):
    must = pb.Filter(must=[pb.FieldCondition(key="topic", keyword="for")])
    response = await _search(stub, text="exceptions and error handling", top_k=10, filter=must)
    assert response.results and {r.payload["topic"] for r in response.results} == {"for"}
    must_not = pb.Filter(must_not=[pb.FieldCondition(key="topic", keyword="with")])
    response = await _search(stub, text="context manager enter and exit", top_k=10, filter=must_not)
    assert "with" not in {r.payload["topic"] for r in response.results}
    ranged = pb.Filter(must=[pb.FieldCondition(key="index", range=pb.Range(gte=2, lt=3))])
    response = await _search(stub, text="statements", top_k=10, filter=ranged, payload_fields=["index"])
    assert {r.payload["index"] for r in response.results} == {2}


async def test_only_selected_payload_fields_and_never_vectors(stub, corpus):
    default = await _search(stub, text="the while loop", top_k=5)
    assert all(set(r.payload.keys()) == {"topic"} for r in default.results)
    chosen = await _search(stub, text="the while loop", top_k=5, payload_fields=["text", "index"])
    for result in chosen.results:
        assert set(result.payload.keys()) == {"text", "index"}
        assert all(not isinstance(v, (list, tuple)) and not hasattr(v, "values") or isinstance(v, str)
                   for v in result.payload.values())
    assert "vector" not in pb.ScoredDocument.DESCRIPTOR.fields_by_name


async def test_vector_query_and_exact_search(stub, corpus):
    text_hits = await _search(stub, text="the while loop", top_k=5, exact=True)
    assert text_hits.hnsw_ef == 0
    assert [r.score for r in text_hits.results] == sorted((r.score for r in text_hits.results), reverse=True)


async def test_score_threshold_drops_weak_results(stub, corpus):
    response = await _search(stub, text="the while loop", top_k=50, score_threshold=0.45)
    assert response.results and all(r.score >= 0.45 for r in response.results)


async def test_delete_removes_documents(stub, corpus):
    await stub.Upsert(pb.UpsertRequest(collection=COLLECTION, documents=[pb.Document(id="temp-1", text="zebra crossings")]), timeout=10)
    hits = await _search(stub, text="zebra crossings", top_k=1, payload_fields=["text"])
    assert hits.results[0].id == "temp-1"
    await stub.Delete(pb.DeleteRequest(collection=COLLECTION, ids=["temp-1", "never-existed"]), timeout=10)
    hits = await _search(stub, text="zebra crossings", top_k=1)
    assert hits.results[0].id != "temp-1"


async def test_upsert_replaces_by_id(stub, corpus):
    for text in ("first version about penguins", "second version about volcanoes"):
        await stub.Upsert(pb.UpsertRequest(collection=COLLECTION, documents=[pb.Document(id="replace-me", text=text)]), timeout=10)
    hits = await _search(stub, text="volcanoes", top_k=1, payload_fields=["text"])
    assert hits.results[0].id == "replace-me" and "volcanoes" in hits.results[0].payload["text"]
    await stub.Delete(pb.DeleteRequest(collection=COLLECTION, ids=["replace-me"]), timeout=10)


async def test_large_results_are_cut_to_the_response_bound(tmp_path, pki):
    async with retrieval_server(tmp_path, pki.root, max_response_bytes=4096) as (running, _):
        async with retrieval_stub(running.port, pki.root) as small:
            await small.CreateCollection(pb.CreateCollectionRequest(collection=pb.Collection(name="big")), timeout=10)
            passages = sample_corpus(max_per_topic=1)[:40]
            await small.Upsert(pb.UpsertRequest(collection="big", documents=passage_documents(passages)), timeout=60)
            response = await small.Search(pb.SearchRequest(collection="big", text="statements", top_k=40, payload_fields=["text"]), timeout=10)
    assert response.truncated
    assert 0 < len(response.results) < 40
    assert response.ByteSize() <= 4096


async def test_untrimmed_payloads_only_when_switched_off(tmp_path, pki):
    """AGW_RETRIEVAL_TRIM_PAYLOADS=0 (debugging) returns whole payloads to a Search naming no fields."""
    passages = sample_corpus(max_per_topic=1)[:10]
    for trim, wanted in ((True, lambda keys: keys == {"text"}),
                         (False, lambda keys: keys >= {"text", "topic", "index", "source"})):
        async with retrieval_server(tmp_path / str(trim), pki.root, trim_payloads=trim) as (running, _):
            async with retrieval_stub(running.port, pki.root) as stub:
                await stub.CreateCollection(pb.CreateCollectionRequest(collection=pb.Collection(name="c")), timeout=10)
                await stub.Upsert(pb.UpsertRequest(collection="c", documents=passage_documents(passages)), timeout=60)
                found = await stub.Search(pb.SearchRequest(collection="c", text="statements", top_k=3), timeout=10)
                assert found.results and all(wanted(set(r.payload.keys())) for r in found.results), trim
                named = await stub.Search(pb.SearchRequest(
                    collection="c", text="statements", top_k=3, payload_fields=["topic"]), timeout=10)
                assert all(set(r.payload.keys()) == {"topic"} for r in named.results)


def _bad(code, needle):
    return code, needle


@pytest.mark.parametrize(
    ("request_", "code", "needle"),
    [
        (pb.SearchRequest(collection="missing", text="x", top_k=1), grpc.StatusCode.NOT_FOUND, "'missing' does not exist"),
        (pb.SearchRequest(collection=COLLECTION, vector=pb.Vector(values=[0.1, 0.2]), top_k=1), grpc.StatusCode.INVALID_ARGUMENT, "has 2 values; 'pydoc' has 384 dimensions"),
        (pb.SearchRequest(collection=COLLECTION, text="   ", top_k=1), grpc.StatusCode.INVALID_ARGUMENT, "query: is empty"),
        (pb.SearchRequest(collection=COLLECTION, text="x", top_k=0), grpc.StatusCode.INVALID_ARGUMENT, "top_k: must be between 1 and 100"),
        (pb.SearchRequest(collection=COLLECTION, text="x", top_k=101), grpc.StatusCode.INVALID_ARGUMENT, "(got 101"),
        (pb.SearchRequest(collection=COLLECTION, text="x", top_k=1, filter=pb.Filter(must=[pb.FieldCondition(key="topic")])), grpc.StatusCode.INVALID_ARGUMENT, "filter.must[0]: no match given"),
        (pb.SearchRequest(collection=COLLECTION, text="x", top_k=1, filter=pb.Filter(must=[pb.FieldCondition(keyword="for")])), grpc.StatusCode.INVALID_ARGUMENT, "filter.must[0].key: is empty"),
        (pb.SearchRequest(collection=COLLECTION, text="x", top_k=1, hnsw_ef=0), grpc.StatusCode.INVALID_ARGUMENT, "hnsw_ef: must be > 0"),
        (pb.SearchRequest(collection="bad name!", text="x", top_k=1), grpc.StatusCode.INVALID_ARGUMENT, "not a valid collection name"),
    ],
)
async def test_bad_search_gets_its_status(stub, corpus, request_, code, needle):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Search(request_, timeout=10)
    assert caught.value.code() == code
    assert needle in caught.value.details(), caught.value.details()


async def test_duplicate_id_in_one_batch_writes_nothing(stub, corpus):
    before = (await stub.GetCollection(pb.GetCollectionRequest(name=COLLECTION), timeout=5)).collection.point_count
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Upsert(pb.UpsertRequest(collection=COLLECTION, documents=[
            pb.Document(id="dup-a", text="one"), pb.Document(id="dup-b", text="two"), pb.Document(id="dup-a", text="three"),
        ]), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "documents[2].id: 'dup-a' repeats documents[0].id" == caught.value.details()
    after = (await stub.GetCollection(pb.GetCollectionRequest(name=COLLECTION), timeout=5)).collection.point_count
    assert after == before


@pytest.mark.parametrize(
    ("documents", "needle"),
    [
        ([pb.Document(id="", text="x")], "documents[0].id: is empty"),
        ([pb.Document(id="a", text="")], "documents[0].text: is empty"),
        ([pb.Document(id="a", text="x", vector=pb.Vector(values=[1.0]))], "documents[0].vector: has 1 values"),
        ([], "documents: is empty"),
    ],
)
async def test_bad_upsert_gets_invalid_argument(stub, corpus, documents, needle):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Upsert(pb.UpsertRequest(collection=COLLECTION, documents=documents), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(needle), caught.value.details()


async def test_reserved_payload_key_is_refused(stub, corpus):
    document = passage_documents(sample_corpus(max_per_topic=1)[:1])[0]
    document.payload.update({"doc_id": "sneaky"})
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Upsert(pb.UpsertRequest(collection=COLLECTION, documents=[document]), timeout=10)
    assert caught.value.details() == "documents[0].payload: key 'doc_id' is reserved by the service"


async def test_create_twice_is_already_exists_and_delete_is_idempotent(stub):
    create = pb.CreateCollectionRequest(collection=pb.Collection(name="twice"))
    await stub.CreateCollection(create, timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.CreateCollection(create, timeout=10)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert (await stub.DeleteCollection(pb.DeleteCollectionRequest(name="twice"), timeout=10)).existed
    assert not (await stub.DeleteCollection(pb.DeleteCollectionRequest(name="twice"), timeout=10)).existed
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stub.GetCollection(pb.GetCollectionRequest(name="twice"), timeout=10)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


async def test_unreachable_qdrant_server_is_unavailable_within_the_deadline(tmp_path, pki):
    # Nothing listens on port 1: the store is unreachable.
    async with retrieval_server(tmp_path, pki.root, qdrant_url="http://127.0.0.1:1", qdrant_timeout_s=1) as (running, _):
        async with retrieval_stub(running.port, pki.root) as dead:
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await dead.Search(pb.SearchRequest(collection="any", text="x", top_k=1), timeout=5)
            assert time.monotonic() - started < 5
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "vector store unavailable" in caught.value.details()


async def test_store_failure_mid_upsert_says_exactly_what_was_stored(tmp_path, pki):
    """Fault injection: the real Edge store, made to fail its second write once."""
    from retrieval.stores.base import StoreUnavailable

    async with retrieval_server(tmp_path, pki.root, upsert_chunk=10) as (running, app):
        store = app.servicer.core.store
        real_upsert = store.upsert
        calls = []

        async def fail_second_write(name, points):
            calls.append(len(points))
            if len(calls) == 2:
                raise StoreUnavailable("injected fault")
            await real_upsert(name, points)

        store.upsert = fail_second_write
        documents = passage_documents(sample_corpus(max_per_topic=1)[:25])
        # Without client retries, the caller sees exactly what was stored.
        async with retrieval_stub(running.port, pki.root, retry=None) as once:
            await once.CreateCollection(pb.CreateCollectionRequest(collection=pb.Collection(name="partial")), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await once.Upsert(pb.UpsertRequest(collection="partial", documents=documents), timeout=60)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "documents[0:10] of 25 were written" in caught.value.details()
            info = error_details_pb2.ErrorInfo()
            assert status_details(caught.value).details[0].Unpack(info)
            assert dict(info.metadata) == {"stored": "10", "requested": "25"}
            count = (await once.GetCollection(pb.GetCollectionRequest(name="partial"), timeout=5)).collection.point_count
            assert count == 10

        # With the channel factory's retry policy (Upsert is IDEMPOTENT), the
        # same transient fault is healed by one automatic retry.
        calls.clear()
        async with retrieval_stub(running.port, pki.root) as retried:
            assert (await retried.Upsert(pb.UpsertRequest(collection="partial", documents=documents), timeout=60)).upserted == 25
        assert calls == [10, 10, 10, 10, 5]


async def test_concurrent_queries_share_embedding_passes_and_keep_their_own_hits(stub, corpus, service):
    _, app = service
    embedder = app.servicer.core.embedder
    queries = ["context manager enter and exit", "iterate over a sequence", "format a string", "import a module",
               "define a class", "catch an exception", "anonymous function", "assert a condition"]
    alone = [await _search(stub, text=q, top_k=3) for q in queries]
    passes = embedder.query_passes
    together = await asyncio.gather(*(_search(stub, text=q, top_k=3) for q in queries))
    # Fewer forward passes than queries: those that arrived during a pass shared the next.
    assert embedder.query_passes - passes < len(queries)
    # In bfloat16 (AGW_RETRIEVAL_EMBED_BF16 where the CPU runs it natively) a shared pass pads a query to another
    # length than its lone pass does, and its scores then move by a few 1e-4 (3.4e-4 seen), still far less than
    # two queries' differ.
    tolerance = 2e-3 if embedder.bf16 else 1e-4
    for one, batched in zip(alone, together):
        assert {h.id for h in batched.results} == {h.id for h in one.results}
        assert [h.score for h in batched.results] == pytest.approx([h.score for h in one.results], abs=tolerance)
