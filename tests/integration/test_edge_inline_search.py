"""Qdrant Edge searches on the event loop where they cost less than the hand-off to the store's thread.

A real Edge shard behind a thin wrapper that records the thread each search
ran on (and, for one test, makes one search slow: an injected fault).
"""

from __future__ import annotations

import threading
import time
from contextlib import asynccontextmanager

import numpy as np
import pytest

from retrieval.stores.base import CollectionSpec, SearchQuery, StoredPoint, point_id
from retrieval.stores.edge import EdgeStore
from servicekit.errors import NotFound

pytestmark = pytest.mark.integration

DIM = 16


class RecordingShard:
    """The real shard; records the thread of every search and every other call made to it."""

    def __init__(self, shard) -> None:
        self._shard = shard
        self.search_threads: list[threading.Thread] = []
        self.other_calls: list[str] = []
        self.slow_next_s = 0.0

    def search(self, request):
        self.search_threads.append(threading.current_thread())
        if self.slow_next_s:
            time.sleep(self.slow_next_s)
            self.slow_next_s = 0.0
        return self._shard.search(request)

    def __getattr__(self, name):
        self.other_calls.append(name)
        return getattr(self._shard, name)

    def on_loop(self) -> list[bool]:
        return [thread is threading.main_thread() for thread in self.search_threads]


@asynccontextmanager
async def _opened(tmp_path, inline_search_us: int):
    """A store with collection ``c`` of 200 points, and its recording shard; closed on exit."""
    store = await EdgeStore.open(tmp_path / "edge", inline_search_us=inline_search_us)
    try:
        await store.create_collection(CollectionSpec(name="c", vector_size=DIM))
        vectors = np.random.default_rng(1).normal(size=(200, DIM)).tolist()
        await store.upsert("c", [StoredPoint(point_id(f"d{i}"), vectors[i], {"doc_id": f"d{i}"})
                                 for i in range(200)])
        collection = store._collections["c"]
        collection.shard = RecordingShard(collection.shard)
        yield store, collection.shard
    finally:
        await store.close()


QUERY = SearchQuery(vector=[0.1] * DIM, limit=5, payload_fields=())


async def test_a_cheap_search_moves_onto_the_loop_after_its_first_and_finds_the_same(tmp_path):
    # A budget no search on this machine reaches: the mechanism, apart from this host's timings.
    async with _opened(tmp_path, inline_search_us=1_000_000) as (store, shard):
        results = [await store.search("c", QUERY) for _ in range(4)]
        assert shard.on_loop() == [False, True, True, True]  # the first of its shape is measured on the thread
        assert all(hits == results[0] for hits in results) and len(results[0]) == 5
        assert shard.other_calls == []  # a search reads the spec from memory: no shard.info for a point count


async def test_each_query_shape_is_measured_on_the_thread_first(tmp_path):
    async with _opened(tmp_path, inline_search_us=1_000_000) as (store, shard):
        await store.search("c", QUERY)
        await store.search("c", SearchQuery(vector=[0.1] * DIM, limit=5, payload_fields=(), hnsw_ef=256))
        await store.search("c", SearchQuery(vector=[0.1] * DIM, limit=5, payload_fields=(), hnsw_ef=256))
        assert shard.on_loop() == [False, False, True]


async def test_a_zero_budget_keeps_every_search_on_the_thread(tmp_path):
    async with _opened(tmp_path, inline_search_us=0) as (store, shard):
        for _ in range(3):
            await store.search("c", QUERY)
        assert shard.on_loop() == [False, False, False]


async def test_exact_search_never_runs_on_the_loop(tmp_path):
    async with _opened(tmp_path, inline_search_us=1_000_000) as (store, shard):
        exact = SearchQuery(vector=[0.1] * DIM, limit=5, payload_fields=(), exact=True)
        for _ in range(3):
            await store.search("c", exact)
        assert shard.on_loop() == [False, False, False]


async def test_a_write_in_flight_sends_searches_to_the_thread(tmp_path):
    async with _opened(tmp_path, inline_search_us=1_000_000) as (store, shard):
        await store.search("c", QUERY)
        async with store._collections["c"].write_lock:  # as upsert, delete and optimize hold it
            await store.search("c", QUERY)
        await store.search("c", QUERY)
        assert shard.on_loop() == [False, False, True]


async def test_a_slow_search_sends_its_shape_back_to_the_thread_until_its_cost_decays(tmp_path):
    async with _opened(tmp_path, inline_search_us=50_000) as (store, shard):  # 50 ms: far above a real search here
        await store.search("c", QUERY)
        await store.search("c", QUERY)
        shard.slow_next_s = 0.2  # the third runs on the loop, and takes 200 ms
        await store.search("c", QUERY)
        for _ in range(20):
            await store.search("c", QUERY)
        placed = shard.on_loop()
        assert placed[:3] == [False, True, True]
        # 0.2 s decays by 0.9 a search: under 50 ms after 14 more (0.2 x 0.9^14 = 0.046).
        assert placed[3:] == [False] * 14 + [True] * 6


async def test_a_search_of_a_missing_collection_is_not_found(tmp_path):
    async with _opened(tmp_path, inline_search_us=1_000_000) as (store, _):
        with pytest.raises(NotFound, match="'other' does not exist"):
            await store.search("other", QUERY)
        with pytest.raises(NotFound):
            await store.collection_spec("other")
        assert (await store.collection_spec("c")).vector_size == DIM
