"""Conversion between ``agent.retrieval.v1`` messages and the retrieval domain types."""

from __future__ import annotations

from google.protobuf import json_format, struct_pb2

from agent.retrieval.v1 import retrieval_pb2 as pb
from servicekit.errors import InvalidArgument

from retrieval.core import Document, SearchInput, SearchOutput
from retrieval.ingest import Passage
from retrieval.stores.base import CollectionSpec, Condition, PayloadFilter
from retrieval.tuning import TuneReport

_DISTANCE_NAME = {
    pb.DISTANCE_UNSPECIFIED: "cosine",
    pb.DISTANCE_COSINE: "cosine",
    pb.DISTANCE_DOT: "dot",
    pb.DISTANCE_EUCLID: "euclid",
}
_DISTANCE_ENUM = {"cosine": pb.DISTANCE_COSINE, "dot": pb.DISTANCE_DOT, "euclid": pb.DISTANCE_EUCLID}


def spec_from_proto(collection: pb.Collection) -> CollectionSpec:
    if collection.distance not in _DISTANCE_NAME:
        raise InvalidArgument("collection.distance", f"unknown value {collection.distance}")
    return CollectionSpec(
        name=collection.name,
        vector_size=collection.vector_size,
        distance=_DISTANCE_NAME[collection.distance],
        hnsw_m=collection.hnsw.m or 16,
        hnsw_ef_construct=collection.hnsw.ef_construct or 100,
        default_payload_fields=tuple(collection.default_payload_fields) or ("text",),
        tenant=collection.tenant,
    )


def collection_to_proto(spec: CollectionSpec, point_count: int) -> pb.Collection:
    return pb.Collection(
        name=spec.name,
        vector_size=spec.vector_size,
        distance=_DISTANCE_ENUM[spec.distance],
        hnsw=pb.HnswParams(m=spec.hnsw_m, ef_construct=spec.hnsw_ef_construct),
        tuned_ef=spec.tuned_ef,
        tuned_recall=spec.tuned_recall,
        point_count=point_count,
        default_payload_fields=list(spec.default_payload_fields),
        tenant=spec.tenant,
    )


def passage_to_proto(passage: Passage, **extra_payload) -> pb.Document:
    """A passage as a Document to upsert; the retrieval service embeds its text."""
    payload = struct_pb2.Struct()
    payload.update({**passage.payload, **extra_payload})
    return pb.Document(id=passage.id, text=passage.text, payload=payload)


def documents_from_proto(documents) -> list[Document]:
    return [
        Document(
            id=d.id,
            text=d.text,
            payload=json_format.MessageToDict(d.payload) if d.HasField("payload") else {},
            vector=tuple(d.vector.values) if d.HasField("vector") else None,
        )
        for d in documents
    ]


def _condition(c: pb.FieldCondition) -> Condition:
    kind = c.WhichOneof("match")
    if kind == "range":
        r = c.range
        return Condition(
            key=c.key,
            gt=r.gt if r.HasField("gt") else None, gte=r.gte if r.HasField("gte") else None,
            lt=r.lt if r.HasField("lt") else None, lte=r.lte if r.HasField("lte") else None,
        )
    return Condition(
        key=c.key,
        keyword=c.keyword if kind == "keyword" else None,
        integer=c.integer if kind == "integer" else None,
        boolean=c.boolean if kind == "boolean" else None,
    )


#: A search without a filter (most of them) shares this one.
_NO_FILTER = PayloadFilter()


def filter_from_proto(payload_filter: pb.Filter) -> PayloadFilter:
    if not (payload_filter.must or payload_filter.must_not):
        return _NO_FILTER
    return PayloadFilter(
        must=tuple(_condition(c) for c in payload_filter.must),
        must_not=tuple(_condition(c) for c in payload_filter.must_not),
    )


def search_from_proto(request: pb.SearchRequest) -> SearchInput:
    kind = request.WhichOneof("query")
    return SearchInput(
        collection=request.collection,
        text=request.text if kind == "text" else None,
        # A slice of the repeated field is a list built in one pass: tuple() over it took 10-11 µs for 384
        # values against 6.3, and the core and the store then copied it twice more (docs/benchmarks.md,
        # "A search's own Python").
        vector=request.vector.values[:] if kind == "vector" else None,
        top_k=request.top_k,
        filter=filter_from_proto(request.filter),
        payload_fields=tuple(request.payload_fields),
        score_threshold=request.score_threshold if request.HasField("score_threshold") else None,
        hnsw_ef=request.hnsw_ef if request.HasField("hnsw_ef") else None,
        exact=request.exact,
    )


def search_to_proto(output: SearchOutput, max_bytes: int) -> pb.SearchResponse:
    """Results best first, cut (and flagged) where the response would pass ``max_bytes``."""
    response = pb.SearchResponse(hnsw_ef=output.hnsw_ef)
    for hit in output.hits:
        payload = struct_pb2.Struct()
        payload.update(hit.payload)
        response.results.append(pb.ScoredDocument(id=hit.doc_id, score=hit.score, payload=payload))
        if response.ByteSize() > max_bytes:
            del response.results[-1]
            response.truncated = True
            break
    return response


def tune_to_proto(report: TuneReport) -> pb.TuneCollectionResponse:
    return pb.TuneCollectionResponse(
        chosen_ef=report.chosen_ef,
        recall=report.recall,
        target_met=report.target_met,
        measurements=[
            pb.EfMeasurement(ef=m.ef, recall=m.recall, p50_ms=m.p50_ms, p95_ms=m.p95_ms) for m in report.measurements
        ],
    )
