"""Qdrant Edge: Qdrant's engine in-process (real HNSW that honours hnsw_ef), the embedded default.

Each collection is one Edge shard under ``<root>/<name>/shard`` with our
metadata in ``<root>/<name>/collection.json``. Edge calls are synchronous
Rust; they run on the store's thread pool, off the event loop, but for
searches that have lately cost less than the hand-off to that pool would
(``inline_search_us``; :mod:`retrieval.stores.search_costs`), which run on the
loop, and never while the collection has a write in flight.
Writes to a collection are serialised by a lock; reads run concurrently.
Edge builds its HNSW index only when asked (``optimize``), so the store marks
a collection dirty on write and optimises before tuning or on demand.

Each shard reads its segments on a search pool of its own. Qdrant's default
sizes it from the CPU count (8 threads on 2 cores), and waking them costs
more than the reads: on 2 cores a pool of one thread halved a search's CPU
and cut its p99 under two concurrent searches from 4-6 ms to 0.5 ms
(docs/benchmarks.md, "Qdrant Edge's search pool"). ``search_threads`` sets
it, for new and loaded shards alike.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import qdrant_edge as qe

from opentelemetry import trace

from servicekit.errors import AlreadyExists, NotFound

from retrieval.stores.base import (
    DOC_ID_KEY,
    FULL_SCAN_THRESHOLD_KB,
    CollectionSpec,
    Hit,
    PayloadFilter,
    SearchQuery,
    StoredPoint,
    translate_filter,
)
from retrieval.stores.search_costs import SearchCosts

log = logging.getLogger(__name__)

_DISTANCE = {"cosine": qe.Distance.Cosine, "dot": qe.Distance.Dot, "euclid": qe.Distance.Euclid}


def edge_filter(payload_filter: PayloadFilter) -> qe.Filter | None:
    return translate_filter(
        payload_filter,
        make_filter=lambda must, must_not: qe.Filter(must=must, must_not=must_not),
        make_match=lambda key, value: qe.FieldCondition(key=key, match=qe.MatchValue(value)),
        make_range=lambda key, gt, gte, lt, lte: qe.FieldCondition(
            key=key, range=qe.RangeFloat(gt=gt, gte=gte, lt=lt, lte=lte)),
    )


def _vectors(spec: CollectionSpec) -> qe.EdgeVectorParams:
    return qe.EdgeVectorParams(size=spec.vector_size, distance=_DISTANCE[spec.distance])


class _Collection:
    def __init__(self, folder: Path, shard: qe.EdgeShard, spec: CollectionSpec) -> None:
        self.folder = folder
        self.shard = shard
        self.spec = spec
        self.write_lock = asyncio.Lock()
        self.dirty = False
        self.search_costs = SearchCosts()


class EdgeStore:
    """Collections as Qdrant Edge shards under one folder."""

    def __init__(self, root: Path, executor: ThreadPoolExecutor, search_threads: int | None,
                 inline_search_us: int = 100) -> None:
        self._root = root
        self._executor = executor
        #: Each shard's search pool (None: Qdrant's CPU-derived default).
        self._search_threads = search_threads
        #: A search that has lately cost less runs on the event loop (0: none does).
        self._inline_search_s = inline_search_us / 1e6
        self._collections: dict[str, _Collection] = {}
        self._registry_lock = asyncio.Lock()

    @classmethod
    async def open(cls, root: Path, threads: int = 2, search_threads: int | None = 1,
                   inline_search_us: int = 100) -> EdgeStore:
        """Open (or create) the store and load every collection in it.

        Args:
            threads: the store's own pool, which keeps Edge calls off the event loop.
            search_threads: each shard's search pool (None: Qdrant's default, from the CPU count).
            inline_search_us: searches that have lately cost less run on the event loop (0: none).
        """
        store = cls(root, ThreadPoolExecutor(threads, thread_name_prefix="qdrant-edge"), search_threads,
                    inline_search_us)
        await store._run(root.mkdir, 0o700, True, True)
        for meta in sorted(root.glob("*/collection.json")):
            folder = meta.parent
            spec = CollectionSpec(**_decode(json.loads(meta.read_text())))
            # The rest comes from the shard (checked against these vectors); the search pool is this process's.
            shard = await store._run(qe.EdgeShard.load, str(folder / "shard"),
                                     qe.EdgeConfig(vectors=_vectors(spec), max_search_threads=search_threads))
            store._collections[spec.name] = _Collection(folder, shard, spec)
        log.info("Qdrant Edge at %s: %d collections", root, len(store._collections))
        return store

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _get(self, name: str) -> _Collection:
        try:
            return self._collections[name]
        except KeyError:
            raise NotFound(f"collection {name!r} does not exist") from None

    async def create_collection(self, spec: CollectionSpec) -> None:
        async with self._registry_lock:
            if spec.name in self._collections:
                raise AlreadyExists(f"collection {spec.name!r} already exists")
            folder = self._root / spec.name
            if folder.exists():  # debris of a crashed create
                await self._run(shutil.rmtree, folder)
            config = qe.EdgeConfig(
                vectors=_vectors(spec),
                hnsw_config=qe.HnswIndexConfig(
                    m=spec.hnsw_m, ef_construct=spec.hnsw_ef_construct, full_scan_threshold=FULL_SCAN_THRESHOLD_KB
                ),
                optimizers=qe.EdgeOptimizersConfig(indexing_threshold=FULL_SCAN_THRESHOLD_KB),
                max_search_threads=self._search_threads,
            )
            shard = await self._run(qe.EdgeShard.create, str(folder / "shard"), config)
            await self._run(_write_json, folder / "collection.json", _encode(spec))
            self._collections[spec.name] = _Collection(folder, shard, spec)

    async def get_collection(self, name: str) -> tuple[CollectionSpec, int]:
        collection = self._get(name)
        info = await self._run(collection.shard.info)
        return collection.spec, info.points_count

    async def collection_spec(self, name: str) -> CollectionSpec:
        # In memory: no trip to the store's thread (a search paid one for a point count it dropped, about
        # 90 µs of CPU and 100 µs of latency a call; docs/benchmarks.md, "A search without thread hops").
        return self._get(name).spec

    async def list_collections(self) -> list[str]:
        return sorted(self._collections)

    async def update_metadata(self, spec: CollectionSpec) -> None:
        collection = self._get(spec.name)
        async with collection.write_lock:
            await self._run(_write_json, collection.folder / "collection.json", _encode(spec))
            collection.spec = spec

    async def delete_collection(self, name: str) -> bool:
        async with self._registry_lock:
            collection = self._collections.pop(name, None)
            if collection is None:
                return False
            async with collection.write_lock:
                await self._run(collection.shard.close)
                await self._run(shutil.rmtree, collection.folder)
            return True

    async def upsert(self, name: str, points: Sequence[StoredPoint]) -> None:
        collection = self._get(name)
        operation = qe.UpdateOperation.upsert_points(
            [qe.Point(id=p.point_id, vector=list(p.vector), payload=p.payload) for p in points]
        )
        async with collection.write_lock:
            await self._run(collection.shard.update, operation)
            collection.dirty = True

    async def delete(self, name: str, point_ids: Sequence[str]) -> None:
        collection = self._get(name)
        async with collection.write_lock:
            await self._run(collection.shard.update, qe.UpdateOperation.delete_points(list(point_ids)))
            collection.dirty = True

    async def search(self, name: str, query: SearchQuery) -> list[Hit]:
        collection = self._get(name)
        request = qe.SearchRequest(
            query=qe.Query.Nearest(query.vector),  # any sequence of floats; no copy of its own
            limit=query.limit,
            filter=edge_filter(query.filter),
            params=qe.SearchParams(hnsw_ef=query.hnsw_ef, exact=query.exact),
            with_vector=False,
            with_payload=(qe.PayloadSelector.Exclude([]) if query.payload_fields is None
                          else qe.PayloadSelector.Include([DOC_ID_KEY, *query.payload_fields])),
            score_threshold=query.score_threshold,
        )
        points = await self._search(collection, request, query)
        return [_hit(p.payload or {}, p.score) for p in points]

    async def _search(self, collection: _Collection, request: qe.SearchRequest, query: SearchQuery) -> list:
        """The shard's search, on the event loop where it costs less than the hand-off (see the module)."""
        shape = (bool(query.filter), query.hnsw_ef)
        costs = collection.search_costs
        # Exact search is an operator's full scan; a write in flight holds the shard, and waiting for it
        # on the loop would stall every call.
        inline = (not query.exact and not collection.write_lock.locked()
                  and costs.under(shape, self._inline_search_s))
        trace.get_current_span().set_attribute("agw.search.inline", inline)
        if inline:
            started = time.perf_counter()
            points = collection.shard.search(request)
            costs.record(shape, time.perf_counter() - started)
            return points
        points, seconds = await self._run(_timed, collection.shard.search, request)
        costs.record(shape, seconds)
        return points

    async def sample_points(self, name: str, limit: int) -> list[StoredPoint]:
        collection = self._get(name)
        request = qe.ScrollRequest(limit=limit, with_vector=True, with_payload=qe.PayloadSelector.Include([DOC_ID_KEY]))
        records, _ = await self._run(collection.shard.scroll, request)
        return [StoredPoint(str(r.id), r.vector, r.payload or {}) for r in records]

    async def prepare_for_search(self, name: str) -> None:
        collection = self._get(name)
        async with collection.write_lock:
            if collection.dirty:
                await self._run(collection.shard.optimize)
                collection.dirty = False

    async def close(self) -> None:
        for collection in self._collections.values():
            async with collection.write_lock:
                await self._run(collection.shard.flush)
                await self._run(collection.shard.close)
        self._collections.clear()
        self._executor.shutdown(wait=True)


def _timed(fn, *args):
    """``(fn(*args), seconds it took)``, measured on the thread that runs it."""
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


def _hit(payload: dict, score: float) -> Hit:
    payload = dict(payload)
    doc_id = payload.pop(DOC_ID_KEY, "")
    return Hit(doc_id=str(doc_id), score=float(score), payload=payload)


def _encode(spec: CollectionSpec) -> dict:
    data = dict(spec.__dict__)
    data["default_payload_fields"] = list(spec.default_payload_fields)
    return data


def _decode(data: dict) -> dict:
    data = dict(data)
    data["default_payload_fields"] = tuple(data.get("default_payload_fields", ()))
    return data


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
