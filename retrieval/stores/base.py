"""What the retrieval service needs from a vector store, and the types it speaks.

Two stores implement :class:`VectorStore`: Qdrant server through qdrant-client
(the production path) and Qdrant Edge in-process (the embedded default). Both
receive already-trimmed requests: a payload include-list, never vectors, a
bounded limit; the store's job is to pass them on faithfully.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

#: Payload keys the service keeps for itself on every point.
DOC_ID_KEY = "doc_id"
TEXT_KEY = "text"


_ID_NAMESPACE = uuid.UUID("6f1f3a8e-2d55-4c1e-9a3b-4e8f0c7d2b10")


def point_id(doc_id: str) -> str:
    """The store's id for a document: Qdrant takes integers or UUIDs, callers use any string."""
    return str(uuid.uuid5(_ID_NAMESPACE, doc_id))


#: Qdrant's own default: below this many KB of vectors a segment is scanned, not indexed.
FULL_SCAN_THRESHOLD_KB = 10_000


@dataclass(frozen=True)
class CollectionSpec:
    """A collection's configuration and our metadata about it."""

    name: str
    vector_size: int
    distance: str = "cosine"  # cosine | dot | euclid
    hnsw_m: int = 16
    hnsw_ef_construct: int = 100
    default_payload_fields: tuple[str, ...] = (TEXT_KEY,)
    tenant: str = ""
    tuned_ef: int = 0
    tuned_recall: float = 0.0

    def metadata(self) -> dict[str, Any]:
        """What is stored beside the vectors so any replica can read it back."""
        return {
            "agw_default_payload_fields": list(self.default_payload_fields),
            "agw_tenant": self.tenant,
            "agw_tuned_ef": self.tuned_ef,
            "agw_tuned_recall": self.tuned_recall,
        }

    @classmethod
    def from_metadata(cls, name: str, vector_size: int, distance: str, hnsw_m: int, hnsw_ef_construct: int,
                      metadata: dict[str, Any] | None) -> CollectionSpec:
        metadata = metadata or {}
        return cls(
            name=name, vector_size=vector_size, distance=distance, hnsw_m=hnsw_m, hnsw_ef_construct=hnsw_ef_construct,
            default_payload_fields=tuple(metadata.get("agw_default_payload_fields", (TEXT_KEY,))),
            tenant=metadata.get("agw_tenant", ""),
            tuned_ef=int(metadata.get("agw_tuned_ef", 0)),
            tuned_recall=float(metadata.get("agw_tuned_recall", 0.0)),
        )


@dataclass(frozen=True)
class Condition:
    """One payload test: exactly one of the value fields is set."""

    key: str
    keyword: str | None = None
    integer: int | None = None
    boolean: bool | None = None
    gt: float | None = None
    gte: float | None = None
    lt: float | None = None
    lte: float | None = None

    @property
    def is_range(self) -> bool:
        return any(v is not None for v in (self.gt, self.gte, self.lt, self.lte))

    @property
    def value(self) -> str | int | bool | None:
        return next((v for v in (self.keyword, self.integer, self.boolean) if v is not None), None)


@dataclass(frozen=True)
class PayloadFilter:
    must: tuple[Condition, ...] = ()
    must_not: tuple[Condition, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.must or self.must_not)


def translate_filter(payload_filter: PayloadFilter, *, make_filter, make_match, make_range):
    """Build a store's own filter object; each store passes its constructors."""
    if not payload_filter:
        return None

    def condition(c: Condition):
        return make_range(c.key, c.gt, c.gte, c.lt, c.lte) if c.is_range else make_match(c.key, c.value)

    return make_filter(
        [condition(c) for c in payload_filter.must] or None,
        [condition(c) for c in payload_filter.must_not] or None,
    )


@dataclass(frozen=True)
class StoredPoint:
    point_id: str  # the store's id (a UUID derived from the document id)
    vector: Sequence[float]
    payload: dict[str, Any]


@dataclass(frozen=True)
class SearchQuery:
    vector: Sequence[float]
    limit: int
    payload_fields: tuple[str, ...] | None  # None: the whole payload
    filter: PayloadFilter = field(default_factory=PayloadFilter)
    score_threshold: float | None = None
    hnsw_ef: int | None = None
    exact: bool = False


@dataclass(frozen=True)
class Hit:
    doc_id: str
    score: float
    payload: dict[str, Any]


class VectorStore(Protocol):
    """A vector store; every method may raise :class:`StoreUnavailable`."""

    async def create_collection(self, spec: CollectionSpec) -> None:
        """Create an empty collection; raise AlreadyExists if it exists."""

    async def get_collection(self, name: str) -> tuple[CollectionSpec, int]:
        """The collection's spec and point count; raise NotFound if missing."""

    async def collection_spec(self, name: str) -> CollectionSpec:
        """The collection's spec alone, what a search needs; raise NotFound if missing. A store answers it
        with as little work as it can: the point count is a call into the store that a search has no use for."""

    async def list_collections(self) -> list[str]:
        """Every collection's name."""

    async def update_metadata(self, spec: CollectionSpec) -> None:
        """Store ``spec``'s metadata (tuned ef, default fields) with the collection."""

    async def delete_collection(self, name: str) -> bool:
        """Remove the collection; return whether it existed."""

    async def upsert(self, name: str, points: Sequence[StoredPoint]) -> None:
        """Write points; one call is all or nothing."""

    async def delete(self, name: str, point_ids: Sequence[str]) -> None:
        """Remove points by store id; unknown ids are ignored."""

    async def search(self, name: str, query: SearchQuery) -> list[Hit]:
        """Nearest points, best first, with only ``query.payload_fields``."""

    async def sample_points(self, name: str, limit: int) -> list[StoredPoint]:
        """Up to ``limit`` stored points with their vectors (payload: doc id only), for tuning."""

    async def prepare_for_search(self, name: str) -> None:
        """Bring the index up to date (Edge builds HNSW on demand; the server does it itself)."""

    async def close(self) -> None:
        """Release the store."""


class StoreUnavailable(ConnectionError):
    """The store cannot be reached or answered too late."""
