"""A bound on every string, list and map of every public request, checked at the gateway's edge.

Each check names the field (as the proto spells its path), its size, the
limit and the setting that changes it, as ``INVALID_ARGUMENT``: a client
learns what to fix without reading our code. Checks run before admission and
before any backend call, so an oversized request costs the gateway a length
check, not a backend's CPU. The limits themselves are GatewaySettings fields
(``AGW_GATEWAY_MAX_*``), listed in the README and in docs/architecture.md's
security model; the public port also refuses any message over
``AGW_GATEWAY_MAX_RECEIVE_BYTES`` before it is decoded.
"""

from __future__ import annotations

from collections.abc import Sized

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from agent.retrieval.v1 import retrieval_pb2
from servicekit.errors import InvalidArgument

from gateway.settings import GatewaySettings


MAX_SESSION_ID_CHARS = 64


def _setting(name: str) -> str:
    return f"AGW_GATEWAY_{name.upper()}"


class Bounds:
    """The public API's limits, from the gateway's settings."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings

    # -- primitives ------------------------------------------------------------------

    def _limit(self, field: str, size: int, setting: str, unit: str) -> None:
        limit = getattr(self.settings, setting)
        if size > limit:
            raise InvalidArgument(field, f"is {size} {unit}; the limit is {limit} ({_setting(setting)})")

    def chars(self, field: str, value: str, setting: str) -> None:
        self._limit(field, len(value), setting, "characters")

    def count(self, field: str, items: Sized, setting: str, unit: str = "entries") -> None:
        self._limit(field, len(items), setting, unit)

    def key(self, field: str, value: str) -> None:
        self.chars(field, value, "max_key_chars")

    @staticmethod
    def session_id(field: str, value: str) -> None:
        # Fixed, not a setting: the gateway issues session ids, UUIDs of 36 characters.
        if len(value) > MAX_SESSION_ID_CHARS:
            raise InvalidArgument(field, f"is {len(value)} characters; the limit is {MAX_SESSION_ID_CHARS} "
                                         "(a session id is the UUID CreateSession returned)")

    # -- shared parts ----------------------------------------------------------------

    def sampling(self, field: str, sampling: inference_pb2.SamplingParams) -> None:
        self.count(f"{field}.stop", sampling.stop, "max_stop_strings", "strings")
        for index, stop in enumerate(sampling.stop):
            self.chars(f"{field}.stop[{index}]", stop, "max_stop_chars")

    def search_filter(self, field: str, payload_filter: retrieval_pb2.Filter) -> None:
        conditions = [*payload_filter.must, *payload_filter.must_not]
        self.count(field, conditions, "max_filter_conditions", "conditions (must and must_not together)")
        for group, items in (("must", payload_filter.must), ("must_not", payload_filter.must_not)):
            for index, condition in enumerate(items):
                self.key(f"{field}.{group}[{index}].key", condition.key)
                self.key(f"{field}.{group}[{index}].keyword", condition.keyword)

    def payload_fields(self, field: str, fields) -> None:
        self.count(field, fields, "max_payload_fields", "fields")
        for index, name in enumerate(fields):
            self.key(f"{field}[{index}]", name)

    # -- requests --------------------------------------------------------------------

    def chat(self, request: pb.ChatRequest) -> None:
        self.chars("message", request.message, "max_message_chars")
        self.chars("system_prompt", request.system_prompt, "max_system_prompt_chars")
        self.session_id("session_id", request.session_id)
        self.key("idempotency_key", request.idempotency_key)
        self.key("retrieval.collection", request.retrieval.collection)
        self.search_filter("retrieval.filter", request.retrieval.filter)
        self.payload_fields("retrieval.payload_fields", request.retrieval.payload_fields)
        self.sampling("generation", request.generation)

    def generate(self, request: pb.GenerateRequest) -> None:
        inner = request.request
        self.key("request.request_id", inner.request_id)
        self.key("request.cache_salt", inner.cache_salt)
        self.chars("request.prompt", inner.prompt, "max_message_chars")
        self.count("request.chat.messages", inner.chat.messages, "max_chat_messages", "messages")
        for index, message in enumerate(inner.chat.messages):
            self.chars(f"request.chat.messages[{index}].content", message.content, "max_message_chars")
        self.count("request.token_ids.ids", inner.token_ids.ids, "max_token_ids", "token ids")
        self.sampling("request.sampling", inner.sampling)

    def retrieve(self, request: pb.RetrieveRequest) -> None:
        search = request.request
        self.key("request.collection", search.collection)
        self.chars("request.text", search.text, "max_message_chars")
        self.count("request.vector.values", search.vector.values, "max_vector_dims", "values")
        self.search_filter("request.filter", search.filter)
        self.payload_fields("request.payload_fields", search.payload_fields)

    def ingest(self, request: pb.IngestDocumentsRequest) -> None:
        self.key("collection", request.collection)
        self.payload_fields("default_payload_fields", request.default_payload_fields)
        self.count("documents", request.documents, "max_ingest_documents", "documents")
        for index, document in enumerate(request.documents):
            where = f"documents[{index}]"
            self.key(f"{where}.id", document.id)
            self.chars(f"{where}.text", document.text, "max_document_chars")
            self.count(f"{where}.vector.values", document.vector.values, "max_vector_dims", "values")
            self._limit(f"{where}.payload", document.payload.ByteSize(), "max_document_payload_bytes", "bytes")

    def create_session(self, request: pb.CreateSessionRequest) -> None:
        self.count("metadata", request.metadata, "max_metadata_entries", "entries")
        size = 0
        for key, value in request.metadata.items():
            self.key(f"metadata[{key[:32]!r}]", key)
            size += len(key.encode()) + len(value.encode())
        self._limit("metadata", size, "max_metadata_bytes", "bytes (keys and values, UTF-8)")

    def session(self, request) -> None:
        """GetSession, DeleteSession and ListMessages: a session id, and ListMessages' page token."""
        self.session_id("session_id", request.session_id)
        if isinstance(request, pb.ListMessagesRequest):
            self.key("page_token", request.page_token)
