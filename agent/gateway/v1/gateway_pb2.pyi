import datetime

from agent.inference.v1 import inference_pb2 as _inference_pb2
from agent.retrieval.v1 import retrieval_pb2 as _retrieval_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RetrievalOptions(_message.Message):
    __slots__ = ("enabled", "collection", "top_k", "filter", "payload_fields")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELDS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    collection: str
    top_k: int
    filter: _retrieval_pb2.Filter
    payload_fields: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, enabled: _Optional[bool] = ..., collection: _Optional[str] = ..., top_k: _Optional[int] = ..., filter: _Optional[_Union[_retrieval_pb2.Filter, _Mapping]] = ..., payload_fields: _Optional[_Iterable[str]] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("text", "json_schema")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    text: TextFormat
    json_schema: JsonSchemaFormat
    def __init__(self, text: _Optional[_Union[TextFormat, _Mapping]] = ..., json_schema: _Optional[_Union[JsonSchemaFormat, _Mapping]] = ...) -> None: ...

class TextFormat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JsonSchemaFormat(_message.Message):
    __slots__ = ("name", "schema", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    schema: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., schema: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ToolResult(_message.Message):
    __slots__ = ("tool_call_id", "content")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    content: str
    def __init__(self, tool_call_id: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("session_id", "message", "retrieval", "generation", "system_prompt", "idempotency_key", "tools", "tool_choice", "response_format", "tool_results")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    message: str
    retrieval: RetrievalOptions
    generation: _inference_pb2.SamplingParams
    system_prompt: str
    idempotency_key: str
    tools: _containers.RepeatedCompositeFieldContainer[_inference_pb2.Tool]
    tool_choice: _inference_pb2.ToolChoice
    response_format: ResponseFormat
    tool_results: _containers.RepeatedCompositeFieldContainer[ToolResult]
    def __init__(self, session_id: _Optional[str] = ..., message: _Optional[str] = ..., retrieval: _Optional[_Union[RetrievalOptions, _Mapping]] = ..., generation: _Optional[_Union[_inference_pb2.SamplingParams, _Mapping]] = ..., system_prompt: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[_inference_pb2.Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[_inference_pb2.ToolChoice, _Mapping]] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., tool_results: _Optional[_Iterable[_Union[ToolResult, _Mapping]]] = ...) -> None: ...

class ToolCallEvent(_message.Message):
    __slots__ = ("call",)
    CALL_FIELD_NUMBER: _ClassVar[int]
    call: _inference_pb2.ToolCall
    def __init__(self, call: _Optional[_Union[_inference_pb2.ToolCall, _Mapping]] = ...) -> None: ...

class ContextEvent(_message.Message):
    __slots__ = ("documents",)
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    documents: _containers.RepeatedCompositeFieldContainer[_retrieval_pb2.ScoredDocument]
    def __init__(self, documents: _Optional[_Iterable[_Union[_retrieval_pb2.ScoredDocument, _Mapping]]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("admission_ms", "history_ms", "retrieval_ms", "first_token_ms", "generation_ms", "persist_ms", "total_ms")
    ADMISSION_MS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_MS_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_MS_FIELD_NUMBER: _ClassVar[int]
    PERSIST_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    admission_ms: float
    history_ms: float
    retrieval_ms: float
    first_token_ms: float
    generation_ms: float
    persist_ms: float
    total_ms: float
    def __init__(self, admission_ms: _Optional[float] = ..., history_ms: _Optional[float] = ..., retrieval_ms: _Optional[float] = ..., first_token_ms: _Optional[float] = ..., generation_ms: _Optional[float] = ..., persist_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class TurnSummary(_message.Message):
    __slots__ = ("finish_reason", "usage", "timings", "degraded", "degraded_reason", "trace_id", "session_id", "replayed", "engine_timings")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _inference_pb2.FinishReason
    usage: _inference_pb2.Usage
    timings: StageTimings
    degraded: bool
    degraded_reason: str
    trace_id: str
    session_id: str
    replayed: bool
    engine_timings: _inference_pb2.GenerationTimings
    def __init__(self, finish_reason: _Optional[_Union[_inference_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_inference_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., degraded: _Optional[bool] = ..., degraded_reason: _Optional[str] = ..., trace_id: _Optional[str] = ..., session_id: _Optional[str] = ..., replayed: _Optional[bool] = ..., engine_timings: _Optional[_Union[_inference_pb2.GenerationTimings, _Mapping]] = ...) -> None: ...

class ChatResponse(_message.Message):
    __slots__ = ("context", "delta", "final", "tool_call")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    context: ContextEvent
    delta: TokenDelta
    final: TurnSummary
    tool_call: ToolCallEvent
    def __init__(self, context: _Optional[_Union[ContextEvent, _Mapping]] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., final: _Optional[_Union[TurnSummary, _Mapping]] = ..., tool_call: _Optional[_Union[ToolCallEvent, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: _inference_pb2.GenerateRequest
    def __init__(self, request: _Optional[_Union[_inference_pb2.GenerateRequest, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("response",)
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    response: _inference_pb2.GenerateResponse
    def __init__(self, response: _Optional[_Union[_inference_pb2.GenerateResponse, _Mapping]] = ...) -> None: ...

class RetrieveRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: _retrieval_pb2.SearchRequest
    def __init__(self, request: _Optional[_Union[_retrieval_pb2.SearchRequest, _Mapping]] = ...) -> None: ...

class RetrieveResponse(_message.Message):
    __slots__ = ("response",)
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    response: _retrieval_pb2.SearchResponse
    def __init__(self, response: _Optional[_Union[_retrieval_pb2.SearchResponse, _Mapping]] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("id", "create_time", "metadata", "message_count")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_COUNT_FIELD_NUMBER: _ClassVar[int]
    id: str
    create_time: _timestamp_pb2.Timestamp
    metadata: _containers.ScalarMap[str, str]
    message_count: int
    def __init__(self, id: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., message_count: _Optional[int] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("ordinal", "role", "content", "token_count", "trace_id", "create_time", "tool_calls", "tool_call_id")
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ordinal: int
    role: _inference_pb2.Role
    content: str
    token_count: int
    trace_id: str
    create_time: _timestamp_pb2.Timestamp
    tool_calls: _containers.RepeatedCompositeFieldContainer[_inference_pb2.ToolCall]
    tool_call_id: str
    def __init__(self, ordinal: _Optional[int] = ..., role: _Optional[_Union[_inference_pb2.Role, str]] = ..., content: _Optional[str] = ..., token_count: _Optional[int] = ..., trace_id: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[_inference_pb2.ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("metadata",)
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    METADATA_FIELD_NUMBER: _ClassVar[int]
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: Session
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class GetSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: Session
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class ListMessagesRequest(_message.Message):
    __slots__ = ("session_id", "page_size", "page_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    page_size: int
    page_token: str
    def __init__(self, session_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListMessagesResponse(_message.Message):
    __slots__ = ("messages", "next_page_token")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    next_page_token: str
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IngestDocumentsRequest(_message.Message):
    __slots__ = ("collection", "documents", "default_payload_fields")
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PAYLOAD_FIELDS_FIELD_NUMBER: _ClassVar[int]
    collection: str
    documents: _containers.RepeatedCompositeFieldContainer[_retrieval_pb2.Document]
    default_payload_fields: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, collection: _Optional[str] = ..., documents: _Optional[_Iterable[_Union[_retrieval_pb2.Document, _Mapping]]] = ..., default_payload_fields: _Optional[_Iterable[str]] = ...) -> None: ...

class IngestDocumentsResponse(_message.Message):
    __slots__ = ("ingested", "created_collection")
    INGESTED_FIELD_NUMBER: _ClassVar[int]
    CREATED_COLLECTION_FIELD_NUMBER: _ClassVar[int]
    ingested: int
    created_collection: bool
    def __init__(self, ingested: _Optional[int] = ..., created_collection: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChannelStats(_message.Message):
    __slots__ = ("index", "state", "calls", "in_flight", "connection_attempts", "connections_ready")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CONNECTION_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_READY_FIELD_NUMBER: _ClassVar[int]
    index: int
    state: str
    calls: int
    in_flight: int
    connection_attempts: int
    connections_ready: int
    def __init__(self, index: _Optional[int] = ..., state: _Optional[str] = ..., calls: _Optional[int] = ..., in_flight: _Optional[int] = ..., connection_attempts: _Optional[int] = ..., connections_ready: _Optional[int] = ...) -> None: ...

class BackendStats(_message.Message):
    __slots__ = ("name", "target", "serving", "channels", "replica")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    name: str
    target: str
    serving: bool
    channels: _containers.RepeatedCompositeFieldContainer[ChannelStats]
    replica: ReplicaStats
    def __init__(self, name: _Optional[str] = ..., target: _Optional[str] = ..., serving: _Optional[bool] = ..., channels: _Optional[_Iterable[_Union[ChannelStats, _Mapping]]] = ..., replica: _Optional[_Union[ReplicaStats, _Mapping]] = ...) -> None: ...

class ReplicaStats(_message.Message):
    __slots__ = ("name", "routable", "running_requests", "waiting_requests", "kv_cache_usage", "routed_affinity", "routed_spill", "routed_retry", "routed_balanced", "prompt_tokens", "cached_prompt_tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROUTABLE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    ROUTED_AFFINITY_FIELD_NUMBER: _ClassVar[int]
    ROUTED_SPILL_FIELD_NUMBER: _ClassVar[int]
    ROUTED_RETRY_FIELD_NUMBER: _ClassVar[int]
    ROUTED_BALANCED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    routable: bool
    running_requests: int
    waiting_requests: int
    kv_cache_usage: float
    routed_affinity: int
    routed_spill: int
    routed_retry: int
    routed_balanced: int
    prompt_tokens: int
    cached_prompt_tokens: int
    def __init__(self, name: _Optional[str] = ..., routable: _Optional[bool] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., routed_affinity: _Optional[int] = ..., routed_spill: _Optional[int] = ..., routed_retry: _Optional[int] = ..., routed_balanced: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("backends", "in_flight", "admitted", "rejected", "worker_pid", "database", "event_loop", "workers", "cpu_count", "limits", "asyncio_tasks", "open_fds", "inference_routing")
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    WORKER_PID_FIELD_NUMBER: _ClassVar[int]
    DATABASE_FIELD_NUMBER: _ClassVar[int]
    EVENT_LOOP_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    ASYNCIO_TASKS_FIELD_NUMBER: _ClassVar[int]
    OPEN_FDS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_ROUTING_FIELD_NUMBER: _ClassVar[int]
    backends: _containers.RepeatedCompositeFieldContainer[BackendStats]
    in_flight: int
    admitted: int
    rejected: int
    worker_pid: int
    database: DatabaseStats
    event_loop: str
    workers: int
    cpu_count: int
    limits: PublicLimits
    asyncio_tasks: int
    open_fds: int
    inference_routing: str
    def __init__(self, backends: _Optional[_Iterable[_Union[BackendStats, _Mapping]]] = ..., in_flight: _Optional[int] = ..., admitted: _Optional[int] = ..., rejected: _Optional[int] = ..., worker_pid: _Optional[int] = ..., database: _Optional[_Union[DatabaseStats, _Mapping]] = ..., event_loop: _Optional[str] = ..., workers: _Optional[int] = ..., cpu_count: _Optional[int] = ..., limits: _Optional[_Union[PublicLimits, _Mapping]] = ..., asyncio_tasks: _Optional[int] = ..., open_fds: _Optional[int] = ..., inference_routing: _Optional[str] = ...) -> None: ...

class PublicLimits(_message.Message):
    __slots__ = ("max_concurrent_streams", "max_connection_idle_ms", "max_connection_age_ms", "max_receive_bytes", "max_in_flight", "max_in_flight_per_tenant", "max_connections")
    MAX_CONCURRENT_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONNECTION_IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONNECTION_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_RECEIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_PER_TENANT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    max_concurrent_streams: int
    max_connection_idle_ms: int
    max_connection_age_ms: int
    max_receive_bytes: int
    max_in_flight: int
    max_in_flight_per_tenant: int
    max_connections: int
    def __init__(self, max_concurrent_streams: _Optional[int] = ..., max_connection_idle_ms: _Optional[int] = ..., max_connection_age_ms: _Optional[int] = ..., max_receive_bytes: _Optional[int] = ..., max_in_flight: _Optional[int] = ..., max_in_flight_per_tenant: _Optional[int] = ..., max_connections: _Optional[int] = ...) -> None: ...

class DatabaseStats(_message.Message):
    __slots__ = ("min_size", "max_size", "open", "idle", "acquire_timeout_ms")
    MIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    min_size: int
    max_size: int
    open: int
    idle: int
    acquire_timeout_ms: int
    def __init__(self, min_size: _Optional[int] = ..., max_size: _Optional[int] = ..., open: _Optional[int] = ..., idle: _Optional[int] = ..., acquire_timeout_ms: _Optional[int] = ...) -> None: ...
