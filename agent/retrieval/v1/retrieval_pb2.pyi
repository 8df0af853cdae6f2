from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Distance(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DISTANCE_UNSPECIFIED: _ClassVar[Distance]
    DISTANCE_COSINE: _ClassVar[Distance]
    DISTANCE_DOT: _ClassVar[Distance]
    DISTANCE_EUCLID: _ClassVar[Distance]
DISTANCE_UNSPECIFIED: Distance
DISTANCE_COSINE: Distance
DISTANCE_DOT: Distance
DISTANCE_EUCLID: Distance

class HnswParams(_message.Message):
    __slots__ = ("m", "ef_construct")
    M_FIELD_NUMBER: _ClassVar[int]
    EF_CONSTRUCT_FIELD_NUMBER: _ClassVar[int]
    m: int
    ef_construct: int
    def __init__(self, m: _Optional[int] = ..., ef_construct: _Optional[int] = ...) -> None: ...

class Collection(_message.Message):
    __slots__ = ("name", "vector_size", "distance", "hnsw", "tuned_ef", "tuned_recall", "point_count", "default_payload_fields", "tenant")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VECTOR_SIZE_FIELD_NUMBER: _ClassVar[int]
    DISTANCE_FIELD_NUMBER: _ClassVar[int]
    HNSW_FIELD_NUMBER: _ClassVar[int]
    TUNED_EF_FIELD_NUMBER: _ClassVar[int]
    TUNED_RECALL_FIELD_NUMBER: _ClassVar[int]
    POINT_COUNT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PAYLOAD_FIELDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    name: str
    vector_size: int
    distance: Distance
    hnsw: HnswParams
    tuned_ef: int
    tuned_recall: float
    point_count: int
    default_payload_fields: _containers.RepeatedScalarFieldContainer[str]
    tenant: str
    def __init__(self, name: _Optional[str] = ..., vector_size: _Optional[int] = ..., distance: _Optional[_Union[Distance, str]] = ..., hnsw: _Optional[_Union[HnswParams, _Mapping]] = ..., tuned_ef: _Optional[int] = ..., tuned_recall: _Optional[float] = ..., point_count: _Optional[int] = ..., default_payload_fields: _Optional[_Iterable[str]] = ..., tenant: _Optional[str] = ...) -> None: ...

class CreateCollectionRequest(_message.Message):
    __slots__ = ("collection",)
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    collection: Collection
    def __init__(self, collection: _Optional[_Union[Collection, _Mapping]] = ...) -> None: ...

class CreateCollectionResponse(_message.Message):
    __slots__ = ("collection",)
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    collection: Collection
    def __init__(self, collection: _Optional[_Union[Collection, _Mapping]] = ...) -> None: ...

class GetCollectionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetCollectionResponse(_message.Message):
    __slots__ = ("collection",)
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    collection: Collection
    def __init__(self, collection: _Optional[_Union[Collection, _Mapping]] = ...) -> None: ...

class DeleteCollectionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteCollectionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class Document(_message.Message):
    __slots__ = ("id", "text", "payload", "vector")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    id: str
    text: str
    payload: _struct_pb2.Struct
    vector: Vector
    def __init__(self, id: _Optional[str] = ..., text: _Optional[str] = ..., payload: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., vector: _Optional[_Union[Vector, _Mapping]] = ...) -> None: ...

class UpsertRequest(_message.Message):
    __slots__ = ("collection", "documents")
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    collection: str
    documents: _containers.RepeatedCompositeFieldContainer[Document]
    def __init__(self, collection: _Optional[str] = ..., documents: _Optional[_Iterable[_Union[Document, _Mapping]]] = ...) -> None: ...

class UpsertResponse(_message.Message):
    __slots__ = ("upserted",)
    UPSERTED_FIELD_NUMBER: _ClassVar[int]
    upserted: int
    def __init__(self, upserted: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("collection", "ids")
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    collection: str
    ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, collection: _Optional[str] = ..., ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Vector(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class Range(_message.Message):
    __slots__ = ("gt", "gte", "lt", "lte")
    GT_FIELD_NUMBER: _ClassVar[int]
    GTE_FIELD_NUMBER: _ClassVar[int]
    LT_FIELD_NUMBER: _ClassVar[int]
    LTE_FIELD_NUMBER: _ClassVar[int]
    gt: float
    gte: float
    lt: float
    lte: float
    def __init__(self, gt: _Optional[float] = ..., gte: _Optional[float] = ..., lt: _Optional[float] = ..., lte: _Optional[float] = ...) -> None: ...

class FieldCondition(_message.Message):
    __slots__ = ("key", "keyword", "integer", "boolean", "range")
    KEY_FIELD_NUMBER: _ClassVar[int]
    KEYWORD_FIELD_NUMBER: _ClassVar[int]
    INTEGER_FIELD_NUMBER: _ClassVar[int]
    BOOLEAN_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    key: str
    keyword: str
    integer: int
    boolean: bool
    range: Range
    def __init__(self, key: _Optional[str] = ..., keyword: _Optional[str] = ..., integer: _Optional[int] = ..., boolean: _Optional[bool] = ..., range: _Optional[_Union[Range, _Mapping]] = ...) -> None: ...

class Filter(_message.Message):
    __slots__ = ("must", "must_not")
    MUST_FIELD_NUMBER: _ClassVar[int]
    MUST_NOT_FIELD_NUMBER: _ClassVar[int]
    must: _containers.RepeatedCompositeFieldContainer[FieldCondition]
    must_not: _containers.RepeatedCompositeFieldContainer[FieldCondition]
    def __init__(self, must: _Optional[_Iterable[_Union[FieldCondition, _Mapping]]] = ..., must_not: _Optional[_Iterable[_Union[FieldCondition, _Mapping]]] = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("collection", "text", "vector", "top_k", "filter", "payload_fields", "score_threshold", "hnsw_ef", "exact")
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELDS_FIELD_NUMBER: _ClassVar[int]
    SCORE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    HNSW_EF_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    collection: str
    text: str
    vector: Vector
    top_k: int
    filter: Filter
    payload_fields: _containers.RepeatedScalarFieldContainer[str]
    score_threshold: float
    hnsw_ef: int
    exact: bool
    def __init__(self, collection: _Optional[str] = ..., text: _Optional[str] = ..., vector: _Optional[_Union[Vector, _Mapping]] = ..., top_k: _Optional[int] = ..., filter: _Optional[_Union[Filter, _Mapping]] = ..., payload_fields: _Optional[_Iterable[str]] = ..., score_threshold: _Optional[float] = ..., hnsw_ef: _Optional[int] = ..., exact: _Optional[bool] = ...) -> None: ...

class ScoredDocument(_message.Message):
    __slots__ = ("id", "score", "payload")
    ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    id: str
    score: float
    payload: _struct_pb2.Struct
    def __init__(self, id: _Optional[str] = ..., score: _Optional[float] = ..., payload: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("results", "truncated", "hnsw_ef")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    HNSW_EF_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoredDocument]
    truncated: bool
    hnsw_ef: int
    def __init__(self, results: _Optional[_Iterable[_Union[ScoredDocument, _Mapping]]] = ..., truncated: _Optional[bool] = ..., hnsw_ef: _Optional[int] = ...) -> None: ...

class TuneCollectionRequest(_message.Message):
    __slots__ = ("collection", "target_recall", "k", "sample_size", "queries", "max_ef")
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_RECALL_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    MAX_EF_FIELD_NUMBER: _ClassVar[int]
    collection: str
    target_recall: float
    k: int
    sample_size: int
    queries: _containers.RepeatedScalarFieldContainer[str]
    max_ef: int
    def __init__(self, collection: _Optional[str] = ..., target_recall: _Optional[float] = ..., k: _Optional[int] = ..., sample_size: _Optional[int] = ..., queries: _Optional[_Iterable[str]] = ..., max_ef: _Optional[int] = ...) -> None: ...

class EfMeasurement(_message.Message):
    __slots__ = ("ef", "recall", "p50_ms", "p95_ms")
    EF_FIELD_NUMBER: _ClassVar[int]
    RECALL_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P95_MS_FIELD_NUMBER: _ClassVar[int]
    ef: int
    recall: float
    p50_ms: float
    p95_ms: float
    def __init__(self, ef: _Optional[int] = ..., recall: _Optional[float] = ..., p50_ms: _Optional[float] = ..., p95_ms: _Optional[float] = ...) -> None: ...

class TuneCollectionResponse(_message.Message):
    __slots__ = ("chosen_ef", "recall", "target_met", "measurements")
    CHOSEN_EF_FIELD_NUMBER: _ClassVar[int]
    RECALL_FIELD_NUMBER: _ClassVar[int]
    TARGET_MET_FIELD_NUMBER: _ClassVar[int]
    MEASUREMENTS_FIELD_NUMBER: _ClassVar[int]
    chosen_ef: int
    recall: float
    target_met: bool
    measurements: _containers.RepeatedCompositeFieldContainer[EfMeasurement]
    def __init__(self, chosen_ef: _Optional[int] = ..., recall: _Optional[float] = ..., target_met: _Optional[bool] = ..., measurements: _Optional[_Iterable[_Union[EfMeasurement, _Mapping]]] = ...) -> None: ...
