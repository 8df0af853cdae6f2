"""The retrieval service's logic: checks, embedding, trimming, and the store calls.

Knows neither protobuf nor which store it talks to. Every refusal is a
:class:`~servicekit.errors.ServiceError` naming the problem; a store that
cannot be reached becomes ``UNAVAILABLE``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from google.rpc import error_details_pb2
from opentelemetry import trace

from servicekit.errors import InvalidArgument, NotFound, ResourceExhausted, ServiceError, Unavailable
from servicekit.metrics import meter

from retrieval.embedder import Embedder
from retrieval.settings import RetrievalSettings
from retrieval.stores.base import (
    DOC_ID_KEY,
    TEXT_KEY,
    CollectionSpec,
    Hit,
    PayloadFilter,
    SearchQuery,
    StoredPoint,
    StoreUnavailable,
    VectorStore,
    point_id,
)

log = logging.getLogger(__name__)
tracer = trace.get_tracer("agent-gateway.retrieval")
_SEARCH = meter("retrieval").create_histogram(
    "agw.retrieval.search.duration", unit="ms", description="Store query time per Search (embedding excluded).")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
RESERVED_PAYLOAD_KEYS = (DOC_ID_KEY, TEXT_KEY)
DISTANCES = ("cosine", "dot", "euclid")
#: hnsw_ef for a collection not tuned yet (Qdrant's usual default).
UNTUNED_EF = 128


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    payload: dict[str, Any]
    vector: tuple[float, ...] | None = None


@dataclass(frozen=True)
class SearchInput:
    collection: str
    text: str | None
    vector: Sequence[float] | None  # not copied on the way to the store: nothing changes it
    top_k: int
    filter: PayloadFilter
    payload_fields: tuple[str, ...]
    score_threshold: float | None = None
    hnsw_ef: int | None = None
    exact: bool = False


@dataclass(frozen=True)
class SearchOutput:
    hits: list[Hit]
    hnsw_ef: int  # 0 for an exact search


class PartialUpsert(Unavailable):
    """A store failure after some chunks were written: says exactly which were."""

    def __init__(self, stored: int, requested: int, cause: str) -> None:
        info = error_details_pb2.ErrorInfo(
            reason="PARTIAL_UPSERT", domain="agent.retrieval.v1",
            metadata={"stored": str(stored), "requested": str(requested)},
        )
        ServiceError.__init__(
            self,
            f"the store failed after documents[0:{stored}] of {requested} were written; the rest were not. "
            f"Upsert is idempotent: retry the whole request. ({cause})",
            details=[info],
        )


def check_collection_name(name: str, field: str = "collection") -> str:
    if not _NAME_RE.match(name or ""):
        raise InvalidArgument(field, f"{name!r} is not a valid collection name (letters, digits, '-', '_'; 1-128)")
    return name


def check_filter(payload_filter: PayloadFilter) -> None:
    for group, conditions in (("must", payload_filter.must), ("must_not", payload_filter.must_not)):
        for index, condition in enumerate(conditions):
            where = f"filter.{group}[{index}]"
            if not condition.key:
                raise InvalidArgument(f"{where}.key", "is empty; name the payload field to test")
            values = [v for v in (condition.keyword, condition.integer, condition.boolean) if v is not None]
            if condition.is_range and values or len(values) > 1:
                raise InvalidArgument(where, "set exactly one of keyword, integer, boolean or range")
            if not condition.is_range and not values:
                raise InvalidArgument(where, "no match given; set keyword, integer, boolean or a range bound")


class RetrievalCore:
    """Collections, documents and search over one store and one embedder."""

    def __init__(self, store: VectorStore, embedder: Embedder, settings: RetrievalSettings) -> None:
        self.store = store
        self.embedder = embedder
        self.settings = settings

    async def _store(self, coro):
        try:
            return await coro
        except StoreUnavailable as exc:
            raise Unavailable(f"vector store unavailable: {exc}") from exc

    # -- collections ---------------------------------------------------------------

    async def create_collection(self, spec: CollectionSpec) -> tuple[CollectionSpec, int]:
        check_collection_name(spec.name, "collection.name")
        if spec.distance not in DISTANCES:
            raise InvalidArgument("collection.distance", f"must be one of {', '.join(DISTANCES)}")
        if spec.vector_size == 0:
            spec = replace(spec, vector_size=self.embedder.dimension)
        for field in spec.default_payload_fields:
            if not field:
                raise InvalidArgument("collection.default_payload_fields", "field names must not be empty")
        spec = replace(spec, tuned_ef=0, tuned_recall=0.0)
        if spec.tenant:
            held, _ = await self._tenant_usage(spec.tenant)
            if held >= self.settings.max_collections_per_tenant:
                raise ResourceExhausted(
                    f"tenant {spec.tenant} holds {held} collections, its limit "
                    "(AGW_RETRIEVAL_MAX_COLLECTIONS_PER_TENANT); delete one first", retry_after_s=None)
        await self._store(self.store.create_collection(spec))
        return spec, 0

    async def _tenant_usage(self, tenant: str) -> tuple[int, int]:
        """(collections, documents) the tenant holds. Reads every collection's metadata: in memory for
        Qdrant Edge, one call per collection for a Qdrant server (a per-tenant bound is a coarse guard)."""
        collections = documents = 0
        for name in await self._store(self.store.list_collections()):
            try:
                spec, count = await self._store(self.store.get_collection(name))
            except NotFound:  # deleted meanwhile
                continue
            if spec.tenant == tenant:
                collections += 1
                documents += count
        return collections, documents

    async def get_collection(self, name: str) -> tuple[CollectionSpec, int]:
        check_collection_name(name, "name")
        return await self._store(self.store.get_collection(name))

    async def delete_collection(self, name: str) -> bool:
        check_collection_name(name, "name")
        return await self._store(self.store.delete_collection(name))

    # -- documents -----------------------------------------------------------------

    async def upsert(self, collection: str, documents: Sequence[Document]) -> int:
        check_collection_name(collection)
        spec, _ = await self.get_collection(collection)
        if not documents:
            raise InvalidArgument("documents", "is empty; send at least one document")
        if spec.tenant:
            _, held = await self._tenant_usage(spec.tenant)
            # Counted as new documents (an upsert may replace some): the bound errs on the safe side.
            if held + len(documents) > self.settings.max_documents_per_tenant:
                raise ResourceExhausted(
                    f"tenant {spec.tenant} holds {held} documents; {len(documents)} more would pass its limit of "
                    f"{self.settings.max_documents_per_tenant} (AGW_RETRIEVAL_MAX_DOCUMENTS_PER_TENANT)",
                    retry_after_s=None)
        if len(documents) > self.settings.max_upsert_documents:
            raise InvalidArgument(
                "documents", f"{len(documents)} documents in one request; the limit is "
                f"{self.settings.max_upsert_documents} (AGW_RETRIEVAL_MAX_UPSERT_DOCUMENTS)"
            )
        seen: dict[str, int] = {}
        for index, document in enumerate(documents):
            where = f"documents[{index}]"
            if not document.id:
                raise InvalidArgument(f"{where}.id", "is empty")
            if document.id in seen:
                raise InvalidArgument(f"{where}.id", f"{document.id!r} repeats documents[{seen[document.id]}].id")
            seen[document.id] = index
            if document.vector is None and not document.text.strip():
                raise InvalidArgument(f"{where}.text", "is empty; send text to embed, or a vector")
            if document.vector is not None and len(document.vector) != spec.vector_size:
                raise InvalidArgument(
                    f"{where}.vector", f"has {len(document.vector)} values; {collection!r} has {spec.vector_size} dimensions"
                )
            reserved = [key for key in RESERVED_PAYLOAD_KEYS if key in document.payload]
            if reserved:
                raise InvalidArgument(f"{where}.payload", f"key {reserved[0]!r} is reserved by the service")
        if spec.vector_size != self.embedder.dimension and any(d.vector is None for d in documents):
            raise InvalidArgument(
                "documents", f"{collection!r} has {spec.vector_size} dimensions but the embedder makes "
                f"{self.embedder.dimension}; send vectors with every document"
            )

        # Embed everything before writing anything: an embedding failure then
        # leaves the collection untouched. Chunk by chunk, so queries interleave
        # and a cancelled call stops within one chunk (Embedder.embed_documents).
        to_embed = [d for d in documents if d.vector is None]
        vectors = iter(await self.embedder.embed_documents([d.text for d in to_embed], self.settings.embed_batch))
        points = [
            StoredPoint(
                point_id=point_id(d.id),
                vector=d.vector if d.vector is not None else next(vectors),
                payload={**d.payload, DOC_ID_KEY: d.id, TEXT_KEY: d.text},
            )
            for d in documents
        ]
        stored = 0
        for start in range(0, len(points), self.settings.upsert_chunk):
            chunk = points[start:start + self.settings.upsert_chunk]
            try:
                await self.store.upsert(collection, chunk)
            except StoreUnavailable as exc:
                if stored == 0:
                    raise Unavailable(f"vector store unavailable; nothing was written: {exc}") from exc
                raise PartialUpsert(stored, len(points), str(exc)) from exc
            stored += len(chunk)
        return stored

    async def delete(self, collection: str, ids: Sequence[str]) -> None:
        check_collection_name(collection)
        await self.get_collection(collection)
        if not ids:
            raise InvalidArgument("ids", "is empty; name at least one document")
        await self._store(self.store.delete(collection, [point_id(i) for i in ids]))

    # -- search --------------------------------------------------------------------

    def check_top_k(self, top_k: int) -> None:
        if top_k <= 0 or top_k > self.settings.top_k_cap:
            raise InvalidArgument(
                "top_k", f"must be between 1 and {self.settings.top_k_cap} (got {top_k}; cap: AGW_RETRIEVAL_TOP_K_CAP)"
            )

    def _payload_fields(self, request: SearchInput, spec: CollectionSpec) -> tuple[str, ...] | None:
        """What a hit carries: the fields asked for, else the collection's defaults (None: everything)."""
        if request.payload_fields:
            return tuple(dict.fromkeys(request.payload_fields))
        return tuple(dict.fromkeys(spec.default_payload_fields)) if self.settings.trim_payloads else None

    async def search(self, request: SearchInput) -> SearchOutput:
        check_collection_name(request.collection)
        self.check_top_k(request.top_k)
        check_filter(request.filter)
        if request.hnsw_ef is not None and request.hnsw_ef <= 0:
            raise InvalidArgument("hnsw_ef", f"must be > 0 (got {request.hnsw_ef})")
        if request.vector is None and not (request.text or "").strip():
            raise InvalidArgument("query", "is empty; send query text or a vector")
        spec = await self._store(self.store.collection_spec(request.collection))
        if request.vector is not None:
            vector = request.vector
            if len(vector) != spec.vector_size:
                raise InvalidArgument(
                    "query.vector", f"has {len(vector)} values; {request.collection!r} has {spec.vector_size} dimensions"
                )
        else:
            if spec.vector_size != self.embedder.dimension:
                raise InvalidArgument(
                    "query.text", f"{request.collection!r} has {spec.vector_size} dimensions but the embedder makes "
                    f"{self.embedder.dimension}; search it with a vector"
                )
            with tracer.start_as_current_span("embed query", attributes={
                "agw.embed.model": self.settings.embed_model or "all-MiniLM-L6-v2", "agw.embed.texts": 1,
            }):
                vector = await self.embedder.embed_query(request.text)
        ef = 0 if request.exact else (request.hnsw_ef or spec.tuned_ef or UNTUNED_EF)
        query = SearchQuery(
            vector=vector,
            limit=request.top_k,
            payload_fields=self._payload_fields(request, spec),
            filter=request.filter,
            score_threshold=request.score_threshold,
            hnsw_ef=ef or None,
            exact=request.exact,
        )
        with tracer.start_as_current_span("qdrant search", attributes={
            "db.system.name": "qdrant",
            "db.collection.name": request.collection,
            "agw.search.top_k": request.top_k,
            "agw.search.hnsw_ef": ef,
            "agw.search.exact": request.exact,
            "agw.search.payload_fields": list(query.payload_fields) if query.payload_fields is not None else ["*"],
        }) as span:
            started = time.perf_counter()
            hits = await self._store(self.store.search(request.collection, query))
            _SEARCH.record((time.perf_counter() - started) * 1000, {"exact": request.exact})
            span.set_attribute("agw.search.returned", len(hits))
            if span.is_recording():  # serialising payloads is work only a recorded span needs
                # What the payloads weigh as JSON: the number the trimming exists to keep small.
                span.set_attribute("agw.search.payload_bytes", sum(len(json.dumps(h.payload, default=str)) for h in hits))
        return SearchOutput(hits=hits, hnsw_ef=ef)

