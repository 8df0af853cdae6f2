"""The two stores: what the server adapter sends, and both stores agreeing on exact search.

The Qdrant server adapter is exercised against qdrant-client's local mode, the
API-level peer available without a server.
"""

from __future__ import annotations

import asyncio
import gc
import random
from pathlib import Path

import numpy as np
import pytest
from qdrant_client import AsyncQdrantClient
from qdrant_client import models as qm

from retrieval.stores.base import CollectionSpec, Condition, PayloadFilter, SearchQuery, StoredPoint, point_id
from retrieval.stores.edge import EdgeStore
from retrieval.stores.server import ServerStore
from servicekit.errors import NotFound

pytestmark = [
    pytest.mark.integration,
    # Local mode says it ignores search_params; here we check what is sent, not what it does with it.
    pytest.mark.filterwarnings("ignore:Local mode performs exact"),
]

DIM = 32


class RecordingClient:
    """The real local-mode client, recording the arguments of every query and the name of every other call."""

    def __init__(self, client: AsyncQdrantClient | None = None) -> None:
        self._client = client or AsyncQdrantClient(location=":memory:")
        self.queries: list[dict] = []
        self.calls: list[str] = []

    async def query_points(self, collection_name, **kwargs):
        self.queries.append(kwargs)
        return await self._client.query_points(collection_name, **kwargs)

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self._client, name)


def _points(count: int, seed: int = 0) -> list[StoredPoint]:
    rng = np.random.default_rng(seed)
    vectors = rng.normal(size=(count, DIM)).astype(np.float32)
    return [
        StoredPoint(point_id(f"doc-{i}"), vectors[i].tolist(),
                    {"doc_id": f"doc-{i}", "text": f"text {i}", "group": "even" if i % 2 == 0 else "odd", "rank": i})
        for i in range(count)
    ]


@pytest.fixture
async def stores(tmp_path):
    edge = await EdgeStore.open(tmp_path / "edge")
    recording = RecordingClient()
    server = ServerStore(recording, timeout_s=5)
    spec = CollectionSpec(name="c", vector_size=DIM, default_payload_fields=("text",))
    points = _points(300)
    for store in (edge, server):
        await store.create_collection(spec)
        await store.upsert("c", points)
    yield edge, server, recording
    await edge.close()
    await server.close()


async def test_server_adapter_sends_a_trimmed_request(stores):
    _, server, recording = stores
    query = SearchQuery(vector=[0.1] * DIM, limit=7, payload_fields=("text",), hnsw_ef=64)
    hits = await server.search("c", query)
    sent = recording.queries[-1]
    assert sent["with_vectors"] is False
    assert isinstance(sent["with_payload"], qm.PayloadSelectorInclude)
    assert set(sent["with_payload"].include) == {"doc_id", "text"}
    assert sent["search_params"].hnsw_ef == 64 and sent["search_params"].exact is False
    assert sent["limit"] == 7
    assert len(hits) == 7 and all(set(h.payload) == {"text"} for h in hits)


async def test_server_adapter_passes_exact_and_filter(stores):
    _, server, recording = stores
    query = SearchQuery(vector=[0.1] * DIM, limit=5, payload_fields=("group",), exact=True,
                        filter=PayloadFilter(must=(Condition(key="group", keyword="odd"),)))
    hits = await server.search("c", query)
    sent = recording.queries[-1]
    assert sent["search_params"].exact is True
    assert sent["query_filter"].must[0].key == "group"
    assert {h.payload["group"] for h in hits} == {"odd"}


async def test_both_stores_agree_on_exact_search(stores):
    edge, server, _ = stores
    rng = random.Random(3)
    filters = [PayloadFilter(), PayloadFilter(must=(Condition(key="group", keyword="even"),)),
               PayloadFilter(must=(Condition(key="rank", gte=50, lt=200),))]
    for index in range(20):
        vector = [rng.gauss(0, 1) for _ in range(DIM)]
        query = SearchQuery(vector=vector, limit=10, payload_fields=("rank",), exact=True, filter=filters[index % 3])
        edge_hits = await edge.search("c", query)
        server_hits = await server.search("c", query)
        assert [h.doc_id for h in edge_hits] == [h.doc_id for h in server_hits]
        assert [h.score for h in edge_hits] == pytest.approx([h.score for h in server_hits], abs=1e-4)


async def test_both_stores_keep_metadata_and_counts(stores):
    edge, server, _ = stores
    for store in (edge, server):
        spec, count = await store.get_collection("c")
        assert count == 300
        await store.update_metadata(CollectionSpec(**{**spec.__dict__, "tuned_ef": 48, "tuned_recall": 0.99}))
        again, _ = await store.get_collection("c")
        assert (again.tuned_ef, again.tuned_recall, again.default_payload_fields) == (48, 0.99, ("text",))


async def test_both_stores_give_a_collection_spec_or_not_found(stores):
    edge, server, _ = stores
    for store in (edge, server):
        spec = await store.collection_spec("c")
        assert (spec.name, spec.vector_size, spec.default_payload_fields) == ("c", DIM, ("text",))
        with pytest.raises(NotFound, match="'missing' does not exist"):
            await store.collection_spec("missing")


async def test_edge_store_survives_a_restart(tmp_path):
    edge = await EdgeStore.open(tmp_path / "edge")
    await edge.create_collection(CollectionSpec(name="kept", vector_size=DIM))
    await edge.upsert("kept", _points(20))
    await edge.close()
    reopened = await EdgeStore.open(tmp_path / "edge")
    try:
        spec, count = await reopened.get_collection("kept")
        assert (spec.vector_size, count) == (DIM, 20)
    finally:
        await reopened.close()


def _search_pool_threads() -> int:
    """Threads of this process in Qdrant Edge's search pools (named ``edge-search-<n>``)."""
    names = (task / "comm" for task in Path("/proc/self/task").iterdir())
    return sum(1 for name in names if name.exists() and name.read_text().startswith("edge-search"))


async def _settled_search_pool_threads() -> int:
    """The count once earlier tests' stores have let their pools go: a pool collected or ending between the
    two counts of a test would move its difference."""
    gc.collect()
    count = _search_pool_threads()
    for _ in range(40):
        await asyncio.sleep(0.05)
        now = _search_pool_threads()
        if now == count:
            return count
        count = now
    return count


async def test_each_collection_gets_the_search_pool_it_is_given_created_and_loaded(tmp_path):
    before = await _settled_search_pool_threads()
    edge = await EdgeStore.open(tmp_path / "edge", search_threads=1)
    await edge.create_collection(CollectionSpec(name="kept", vector_size=DIM))
    await edge.upsert("kept", _points(20))
    hits = await edge.search("kept", SearchQuery(vector=[0.1] * DIM, limit=3, payload_fields=None))
    assert len(hits) == 3
    assert _search_pool_threads() - before == 1  # Qdrant's own default is one per CPU or more
    await edge.close()
    before = await _settled_search_pool_threads()
    reopened = await EdgeStore.open(tmp_path / "edge", search_threads=2)  # a loaded shard takes this process's
    try:
        assert len(await reopened.search("kept", SearchQuery(vector=[0.1] * DIM, limit=3, payload_fields=None))) == 3
        assert _search_pool_threads() - before == 2
    finally:
        await reopened.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _server_with_collection(client: RecordingClient, clock: Clock, ttl_s: float = 1.0) -> ServerStore:
    server = ServerStore(client, timeout_s=5, spec_ttl_s=ttl_s, clock=clock)
    await server.create_collection(CollectionSpec(name="c", vector_size=DIM, default_payload_fields=("text",)))
    await server.upsert("c", _points(20))
    client.calls.clear()
    return server


async def test_server_store_reads_a_spec_once_within_its_ttl():
    client, clock = RecordingClient(), Clock()
    server = await _server_with_collection(client, clock)
    query = SearchQuery(vector=[0.1] * DIM, limit=3, payload_fields=("text",))
    for _ in range(3):
        spec = await server.collection_spec("c")
        await server.search("c", query)
    assert spec.default_payload_fields == ("text",)
    assert client.calls == ["collection_exists", "get_collection"]  # two round trips once, not before each search
    clock.now += 1.5
    await server.collection_spec("c")
    assert client.calls[2:] == ["collection_exists", "get_collection"]


async def test_server_store_with_no_ttl_reads_the_spec_every_time():
    client, clock = RecordingClient(), Clock()
    server = await _server_with_collection(client, clock, ttl_s=0.0)
    await server.collection_spec("c")
    await server.collection_spec("c")
    assert client.calls == ["collection_exists", "get_collection"] * 2


async def test_server_store_forgets_a_spec_it_changes():
    client, clock = RecordingClient(), Clock()
    server = await _server_with_collection(client, clock)
    spec = await server.collection_spec("c")
    await server.update_metadata(CollectionSpec(**{**spec.__dict__, "tuned_ef": 48, "tuned_recall": 0.99}))
    assert (await server.collection_spec("c")).tuned_ef == 48
    assert await server.delete_collection("c")
    assert not await server.delete_collection("c")  # deleting it again: it did not exist
    with pytest.raises(NotFound):
        await server.collection_spec("c")


async def _deleted_elsewhere_after_its_spec_was_kept() -> ServerStore:
    """A replica that read collection "c"'s spec, once another replica (the same server) deleted "c"."""
    shared = AsyncQdrantClient(location=":memory:")
    clock = Clock()
    here = await _server_with_collection(RecordingClient(shared), clock)
    elsewhere = ServerStore(RecordingClient(shared), timeout_s=5, clock=clock)
    await here.collection_spec("c")
    assert await elsewhere.delete_collection("c")
    return here


async def test_deleting_a_collection_another_replica_deleted_forgets_its_spec():
    here = await _deleted_elsewhere_after_its_spec_was_kept()
    assert not await here.delete_collection("c")
    with pytest.raises(NotFound):  # within the TTL, yet not from the spec it had kept
        await here.collection_spec("c")


async def test_a_search_of_a_collection_another_replica_deleted_is_not_found():
    here = await _deleted_elsewhere_after_its_spec_was_kept()
    assert (await here.collection_spec("c")).name == "c"  # within the TTL this replica has not heard
    with pytest.raises(NotFound, match="'c' does not exist"):
        await here.search("c", SearchQuery(vector=[0.1] * DIM, limit=3, payload_fields=()))
    with pytest.raises(NotFound):  # and the spec it kept is gone
        await here.collection_spec("c")
