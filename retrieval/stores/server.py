"""Qdrant server through qdrant-client's ``AsyncQdrantClient``: the production path.

gRPC is preferred (smaller payloads, one HTTP/2 connection), every call has a
timeout, and our collection metadata rides in Qdrant's collection metadata, so
any number of retrieval replicas read the same tuned ef. The adapter sends
exactly the trimmed request it is given: ``with_vectors=False``, a payload
include-selector, ``hnsw_ef``/``exact`` in the search params, a bounded limit.

A search needs its collection's spec (dimensions, tuned ef, default payload
fields), which lives on the server: reading it is two round trips
(``collection_exists``, ``get_collection``) before the search's own. The
adapter keeps each spec it reads for ``spec_ttl_s`` (``AGW_RETRIEVAL_QDRANT_SPEC_TTL_S``),
and forgets it at once when this process changes the collection. Another
replica's change (a tune, a deletion) reaches searches here within that time;
a search of a collection deleted meanwhile is NOT_FOUND, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import grpc

from qdrant_client import AsyncQdrantClient
from qdrant_client import models as qm
from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

from servicekit.errors import AlreadyExists, NotFound

from retrieval.stores.base import (
    DOC_ID_KEY,
    FULL_SCAN_THRESHOLD_KB,
    CollectionSpec,
    Hit,
    PayloadFilter,
    SearchQuery,
    StoredPoint,
    StoreUnavailable,
    translate_filter,
)

log = logging.getLogger(__name__)

_DISTANCE = {"cosine": qm.Distance.COSINE, "dot": qm.Distance.DOT, "euclid": qm.Distance.EUCLID}
_DISTANCE_NAME = {value: key for key, value in _DISTANCE.items()}


def server_filter(payload_filter: PayloadFilter) -> qm.Filter | None:
    return translate_filter(
        payload_filter,
        make_filter=lambda must, must_not: qm.Filter(must=must, must_not=must_not),
        make_match=lambda key, value: qm.FieldCondition(key=key, match=qm.MatchValue(value=value)),
        make_range=lambda key, gt, gte, lt, lte: qm.FieldCondition(key=key, range=qm.Range(gt=gt, gte=gte, lt=lt, lte=lte)),
    )


def _unavailable(exc: Exception) -> StoreUnavailable:
    return StoreUnavailable(f"Qdrant server unreachable or too slow: {type(exc).__name__}: {exc}")


def _collection_missing(exc: Exception) -> bool:
    """Whether the server said the collection does not exist (gRPC, REST, and qdrant-client's local mode)."""
    if isinstance(exc, grpc.RpcError):
        return exc.code() == grpc.StatusCode.NOT_FOUND
    if isinstance(exc, UnexpectedResponse):
        return exc.status_code == 404
    text = str(exc)
    return isinstance(exc, ValueError) and text.startswith("Collection ") and text.endswith(" not found")


#: Specs kept at most (one per collection searched lately): a bound, not a working size.
_MAX_SPECS = 4096


class ServerStore:
    """A Qdrant server (or any qdrant-client backend, such as its local mode in tests)."""

    def __init__(self, client: AsyncQdrantClient, *, timeout_s: float = 5.0, spec_ttl_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """
        Args:
            spec_ttl_s: how long a collection's spec answers searches without asking the server (0: never).
            clock: monotonic seconds (tests pass their own).
        """
        self._client = client
        self._timeout = max(1, int(timeout_s))  # qdrant-client takes whole seconds
        self._spec_ttl_s = spec_ttl_s
        self._clock = clock
        #: Collection name -> (read at, spec).
        self._specs: dict[str, tuple[float, CollectionSpec]] = {}

    @classmethod
    def connect(cls, url: str, *, api_key: str | None, timeout_s: float, spec_ttl_s: float = 1.0) -> ServerStore:
        # No version check at start: it is a blocking round trip that fails
        # loudly when the server is down, and start-up must not depend on it.
        client = AsyncQdrantClient(url=url, api_key=api_key, prefer_grpc=True, timeout=max(1, int(timeout_s)),
                                   check_compatibility=False)
        return cls(client, timeout_s=timeout_s, spec_ttl_s=spec_ttl_s)

    async def _call(self, coro):
        """Await a client call, turning "cannot reach the server" into StoreUnavailable."""
        try:
            return await coro
        except (ResponseHandlingException, ConnectionError, TimeoutError, OSError) as exc:
            raise _unavailable(exc) from exc
        except grpc.RpcError as exc:  # prefer_grpc=True
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise _unavailable(exc) from exc
            raise

    async def create_collection(self, spec: CollectionSpec) -> None:
        if await self._call(self._client.collection_exists(spec.name)):
            raise AlreadyExists(f"collection {spec.name!r} already exists")
        await self._call(self._client.create_collection(
            spec.name,
            vectors_config=qm.VectorParams(size=spec.vector_size, distance=_DISTANCE[spec.distance]),
            hnsw_config=qm.HnswConfigDiff(m=spec.hnsw_m, ef_construct=spec.hnsw_ef_construct,
                                          full_scan_threshold=FULL_SCAN_THRESHOLD_KB),
            metadata=spec.metadata(),
            timeout=self._timeout,
        ))
        self._specs.pop(spec.name, None)

    async def get_collection(self, name: str) -> tuple[CollectionSpec, int]:
        if not await self._call(self._client.collection_exists(name)):
            raise NotFound(f"collection {name!r} does not exist")
        info = await self._call(self._client.get_collection(name))
        vectors = info.config.params.vectors
        hnsw = info.config.hnsw_config
        spec = CollectionSpec.from_metadata(
            name, vectors.size, _DISTANCE_NAME.get(vectors.distance, "cosine"), hnsw.m, hnsw.ef_construct,
            info.config.metadata,
        )
        if len(self._specs) >= _MAX_SPECS:
            self._specs.clear()
        self._specs[name] = (self._clock(), spec)
        return spec, info.points_count or 0

    async def collection_spec(self, name: str) -> CollectionSpec:
        kept = self._specs.get(name)
        if kept is not None and self._clock() - kept[0] < self._spec_ttl_s:
            return kept[1]
        spec, _ = await self.get_collection(name)
        return spec

    async def list_collections(self) -> list[str]:
        response = await self._call(self._client.get_collections())
        return sorted(collection.name for collection in response.collections)

    async def update_metadata(self, spec: CollectionSpec) -> None:
        await self._call(self._client.update_collection(spec.name, metadata=spec.metadata(), timeout=self._timeout))
        self._specs.pop(spec.name, None)  # after: a search reading meanwhile could keep the old one

    async def delete_collection(self, name: str) -> bool:
        existed = await self._call(self._client.collection_exists(name))
        if existed:
            await self._call(self._client.delete_collection(name, timeout=self._timeout))
        self._specs.pop(name, None)  # after: a search reading meanwhile could keep it
        return existed

    async def upsert(self, name: str, points: Sequence[StoredPoint]) -> None:
        await self._call(self._client.upsert(
            name,
            points=[qm.PointStruct(id=p.point_id, vector=list(p.vector), payload=p.payload) for p in points],
            wait=True,  # the caller is told "stored" only once it is
        ))

    async def delete(self, name: str, point_ids: Sequence[str]) -> None:
        await self._call(self._client.delete(name, points_selector=qm.PointIdsList(points=list(point_ids)), wait=True))

    async def search(self, name: str, query: SearchQuery) -> list[Hit]:
        try:
            response = await self._query(name, query)
        except (grpc.RpcError, UnexpectedResponse, ValueError) as exc:
            if not _collection_missing(exc):
                raise
            self._specs.pop(name, None)  # deleted since its spec was read (by another replica)
            raise NotFound(f"collection {name!r} does not exist") from None
        hits = []
        for point in response.points:
            payload = dict(point.payload or {})
            doc_id = payload.pop(DOC_ID_KEY, "")
            hits.append(Hit(doc_id=str(doc_id), score=float(point.score), payload=payload))
        return hits

    async def _query(self, name: str, query: SearchQuery):
        return await self._call(self._client.query_points(
            name,
            query=list(query.vector),
            query_filter=server_filter(query.filter),
            search_params=qm.SearchParams(hnsw_ef=query.hnsw_ef, exact=query.exact),
            limit=query.limit,
            with_payload=(True if query.payload_fields is None
                          else qm.PayloadSelectorInclude(include=[DOC_ID_KEY, *query.payload_fields])),
            with_vectors=False,
            score_threshold=query.score_threshold,
            timeout=self._timeout,
        ))

    async def sample_points(self, name: str, limit: int) -> list[StoredPoint]:
        records, _ = await self._call(self._client.scroll(
            name, limit=limit, with_vectors=True, with_payload=qm.PayloadSelectorInclude(include=[DOC_ID_KEY])
        ))
        return [StoredPoint(str(r.id), r.vector, r.payload or {}) for r in records]

    async def prepare_for_search(self, name: str) -> None:
        """The server indexes in the background; nothing to do."""

    async def close(self) -> None:
        await self._client.close()
