"""A bound on every string, list and map of every public request, checked where the request is served.

Each check names the field (as the proto spells its path), its size, the
limit and the setting that changes it, as ``INVALID_ARGUMENT``: a client
learns what to fix without reading our code. Checks run before admission and
before any backend call, so an oversized request costs the server a length
check, not a backend's CPU. The limits themselves are PublicApiSettings
fields (``AGW_GATEWAY_MAX_*``, read by every service that serves a public
method), listed in the README and in docs/architecture.md's security model;
the gateway's public port also refuses any message over
``AGW_GATEWAY_MAX_RECEIVE_BYTES`` before it is decoded.
"""

from __future__ import annotations

import re
from collections.abc import Sized

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from agent.retrieval.v1 import retrieval_pb2
from servicekit.call_metadata import call_metadata
from servicekit.errors import InvalidArgument
from servicekit.json_schema import parse_schema
from servicekit.public_api import AFFINITY_HEADER, PublicApiSettings


MAX_SESSION_ID_CHARS = 64
#: OpenAI's rule for function names, which chat templates and tool parsers assume.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _setting(name: str) -> str:
    return f"AGW_GATEWAY_{name.upper()}"


class Bounds:
    """The public API's limits, from the gateway's settings."""

    def __init__(self, settings: PublicApiSettings) -> None:
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
    def storable(field: str, value: str) -> None:
        """Text that is stored in Postgres, whose text and jsonb types cannot hold U+0000."""
        if "\x00" in value:
            raise InvalidArgument(field, "contains a NUL character (U+0000), which session storage cannot hold; "
                                  "remove it or escape it")

    def affinity(self, context) -> str:
        """The call's ``x-agw-affinity`` key (servicekit.public_api.AFFINITY_HEADER), bounded like an identifier;
        empty without one."""
        for key, value in call_metadata(context):
            if key == AFFINITY_HEADER:
                self._limit(f"{AFFINITY_HEADER} header", len(value), "max_key_chars", "characters")
                return value
        return ""

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
        structured = sampling.structured_output
        self.schema(f"{field}.structured_output.json_schema", structured.json_schema)
        for name in ("regex", "grammar"):
            self._limit(f"{field}.structured_output.{name}", len(getattr(structured, name).encode()),
                        "max_schema_bytes", "bytes")
        self.count(f"{field}.structured_output.choice.values", structured.choice.values, "max_choice_values", "values")
        for index, value in enumerate(structured.choice.values):
            self.chars(f"{field}.structured_output.choice.values[{index}]", value, "max_stop_chars")

    def search_filter(self, field: str, payload_filter: retrieval_pb2.Filter) -> None:
        must, must_not = payload_filter.must, payload_filter.must_not
        if not must and not must_not:  # most searches: nothing to walk (3.9 µs a call for the empty walk)
            return
        self._limit(field, len(must) + len(must_not), "max_filter_conditions",
                    "conditions (must and must_not together)")
        for group, items in (("must", must), ("must_not", must_not)):
            for index, condition in enumerate(items):
                self.key(f"{field}.{group}[{index}].key", condition.key)
                self.key(f"{field}.{group}[{index}].keyword", condition.keyword)

    def schema(self, field: str, text: str) -> None:
        """Size, then JSON and depth (cheap, on the loop); the meta-schema check is the servicer's, off it."""
        self._limit(field, len(text.encode()), "max_schema_bytes", "bytes")
        if text:
            parse_schema(field, text, max_depth=self.settings.max_schema_depth)

    def tools(self, request: pb.ChatRequest) -> None:
        self.count("tools", request.tools, "max_tools", "tools")
        names = set()
        for index, tool in enumerate(request.tools):
            if not TOOL_NAME.fullmatch(tool.name):
                raise InvalidArgument(f"tools[{index}].name", f"{tool.name[:80]!r} is not a tool name: 1 to 64 of "
                                      "a-z, A-Z, 0-9, '_' and '-'")
            if tool.name in names:
                raise InvalidArgument(f"tools[{index}].name", f"{tool.name!r} is given twice; names are unique")
            names.add(tool.name)
            self.chars(f"tools[{index}].description", tool.description, "max_tool_description_chars")
            self.schema(f"tools[{index}].parameters", tool.parameters)
        self.key("tool_choice.tool_name", request.tool_choice.tool_name)
        self.count("tool_results", request.tool_results, "max_tool_results", "results")
        for index, result in enumerate(request.tool_results):
            self.key(f"tool_results[{index}].tool_call_id", result.tool_call_id)
            self.chars(f"tool_results[{index}].content", result.content, "max_message_chars")
            self.storable(f"tool_results[{index}].tool_call_id", result.tool_call_id)
            self.storable(f"tool_results[{index}].content", result.content)
        self.key("response_format.json_schema.name", request.response_format.json_schema.name)
        self.schema("response_format.json_schema.schema", request.response_format.json_schema.schema)

    def payload_fields(self, field: str, fields) -> None:
        self.count(field, fields, "max_payload_fields", "fields")
        longest = self.settings.max_key_chars
        for index, name in enumerate(fields):
            if len(name) > longest:  # the field's name is formatted only for the refusal
                self.key(f"{field}[{index}]", name)

    # -- requests --------------------------------------------------------------------

    def chat(self, request: pb.ChatRequest) -> None:
        self.chars("message", request.message, "max_message_chars")
        self.storable("message", request.message)
        self.storable("idempotency_key", request.idempotency_key)
        self.chars("system_prompt", request.system_prompt, "max_system_prompt_chars")
        self.session_id("session_id", request.session_id)
        self.key("idempotency_key", request.idempotency_key)
        self.key("retrieval.collection", request.retrieval.collection)
        self.search_filter("retrieval.filter", request.retrieval.filter)
        self.payload_fields("retrieval.payload_fields", request.retrieval.payload_fields)
        self.sampling("generation", request.generation)
        self.tools(request)

    def generate(self, request: pb.GenerateRequest) -> None:
        inner = request.request
        self.key("request.request_id", inner.request_id)
        self.key("request.cache_salt", inner.cache_salt)
        self.chars("request.prompt", inner.prompt, "max_message_chars")
        self.count("request.chat.messages", inner.chat.messages, "max_chat_messages", "messages")
        for index, message in enumerate(inner.chat.messages):
            self.chars(f"request.chat.messages[{index}].content", message.content, "max_message_chars")
            self.count(f"request.chat.messages[{index}].tool_calls", message.tool_calls, "max_tools", "calls")
            for number, call in enumerate(message.tool_calls):
                self.chars(f"request.chat.messages[{index}].tool_calls[{number}].arguments", call.arguments,
                           "max_message_chars")
        self.count("request.chat.tools", inner.chat.tools, "max_tools", "tools")
        for index, tool in enumerate(inner.chat.tools):
            self.chars(f"request.chat.tools[{index}].description", tool.description, "max_tool_description_chars")
            self.schema(f"request.chat.tools[{index}].parameters", tool.parameters)
        self.count("request.token_ids.ids", inner.token_ids.ids, "max_token_ids", "token ids")
        self.sampling("request.sampling", inner.sampling)

    def retrieve(self, request: pb.RetrieveRequest) -> None:
        # Every call of every Retrieve path (the gateway's, and the retrieval service's behind an edge) passes
        # here. The sizes are compared inline, and the helpers, which name the field, run only for a request that
        # might break a bound or carries a filter to walk (4.1 µs a call through the helpers; bench/edge_costs.py).
        search = request.request
        limits = self.settings
        fields, payload_filter = search.payload_fields, search.filter
        if (len(search.collection) > limits.max_key_chars or len(search.text) > limits.max_message_chars
                or len(search.vector.values) > limits.max_vector_dims or payload_filter.must
                or payload_filter.must_not or len(fields) > limits.max_payload_fields
                or (fields and max(map(len, fields)) > limits.max_key_chars)):
            self.key("request.collection", search.collection)
            self.chars("request.text", search.text, "max_message_chars")
            self.count("request.vector.values", search.vector.values, "max_vector_dims", "values")
            self.search_filter("request.filter", payload_filter)
            self.payload_fields("request.payload_fields", fields)

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
            self.storable(f"metadata[{key[:32]!r}]", key + value)
            size += len(key.encode()) + len(value.encode())
        self._limit("metadata", size, "max_metadata_bytes", "bytes (keys and values, UTF-8)")

    def session(self, request) -> None:
        """GetSession, DeleteSession and ListMessages: a session id, and ListMessages' page token."""
        self.session_id("session_id", request.session_id)
        if isinstance(request, pb.ListMessagesRequest):
            self.key("page_token", request.page_token)
