"""How the public API is bounded and scoped, wherever a public method is served.

The gateway serves every public method. With an edge proxy in front
(docs/architecture.md, "The edge"), the inference and retrieval services also
serve ``Generate`` and ``Retrieve`` in the public API's shapes, for the calls
the edge forwards to them. Each checks the same bounds (:mod:`servicekit.bounds`)
and scopes to the same tenant partitions (:mod:`servicekit.tenancy`), so these
settings keep their one ``AGW_GATEWAY_*`` name whichever service reads them: a
deployment sets them once, for every process that answers the public API.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from servicekit.admission import Admission

#: Where the public API's settings are read from, whatever the reading service's own prefix.
PUBLIC_PREFIX = "AGW_GATEWAY_"
#: The request header a client sets to keep its ``Generate`` calls on one inference replica (a session or
#: conversation id; the prefix cache it built is there). The gateway routes on it as on a session
#: (gateway.routing.session_key); the edge hashes it with the tenant's certificate (agentgw.edge).
AFFINITY_HEADER = "x-agw-affinity"


def public_field(name: str, default: Any, **constraints: Any) -> Any:
    """A field read from ``AGW_GATEWAY_<NAME>`` in every service (a setting of the public API, not of one process)."""
    return Field(default, validation_alias=f"{PUBLIC_PREFIX}{name.upper()}", **constraints)


class PublicApiSettings(BaseModel):
    """The public API's bounds and tenant scoping: mixed into the settings of each service that serves it."""

    max_message_chars: int = public_field(
        "max_message_chars", 16_000, gt=0, description="Longest user message (Chat), prompt or chat message content "
        "(Generate), or query text (Retrieve), in characters.")
    max_system_prompt_chars: int = public_field(
        "max_system_prompt_chars", 16_000, gt=0, description="Longest Chat system_prompt, in characters.")
    max_key_chars: int = public_field(
        "max_key_chars", 128, gt=0, le=128, description="Longest identifier: idempotency keys, session ids, collection "
        "and payload field names, filter keys and keywords, document ids, request ids, cache salts, metadata keys.")
    max_chat_messages: int = public_field(
        "max_chat_messages", 256, gt=0, description="Most chat messages in one Generate request.")
    max_token_ids: int = public_field(
        "max_token_ids", 32_768, gt=0, description="Most token ids in one Generate request.")
    max_stop_strings: int = public_field(
        "max_stop_strings", 16, gt=0, description="Most stop strings in sampling parameters.")
    max_stop_chars: int = public_field("max_stop_chars", 256, gt=0, description="Longest stop string, in characters.")
    max_filter_conditions: int = public_field(
        "max_filter_conditions", 32, gt=0, description="Most conditions in one search filter (must and must_not).")
    max_payload_fields: int = public_field(
        "max_payload_fields", 32, gt=0, description="Most payload field names in one request.")
    max_vector_dims: int = public_field(
        "max_vector_dims", 4096, gt=0, description="Most values in one query or document vector.")
    max_ingest_documents: int = public_field(
        "max_ingest_documents", 1000, gt=0, description="Most documents in one IngestDocuments request.")
    max_document_chars: int = public_field(
        "max_document_chars", 32_000, gt=0, description="Longest document text, in characters.")
    max_document_payload_bytes: int = public_field(
        "max_document_payload_bytes", 16_384, gt=0, description="Largest document payload, serialised.")
    max_metadata_entries: int = public_field(
        "max_metadata_entries", 32, gt=0, description="Most session metadata entries.")
    max_metadata_bytes: int = public_field(
        "max_metadata_bytes", 8192, gt=0, description="Largest session metadata (keys and values, UTF-8).")
    max_tools: int = public_field("max_tools", 32, gt=0, description="Most tools in one Chat request.")
    max_tool_description_chars: int = public_field(
        "max_tool_description_chars", 2048, gt=0, description="Longest tool description, in characters.")
    max_schema_bytes: int = public_field(
        "max_schema_bytes", 16_384, gt=0, description="Largest JSON Schema (a tool's parameters, a response "
        "format), in bytes of JSON text.")
    max_schema_depth: int = public_field(
        "max_schema_depth", 16, gt=0, description="Deepest nesting of objects and arrays in a JSON Schema.")
    max_tool_results: int = public_field(
        "max_tool_results", 32, gt=0, description="Most tool results in one Chat request.")
    max_choice_values: int = public_field(
        "max_choice_values", 64, gt=0, description="Most strings in a structured-output choice.")
    max_hnsw_ef: int = public_field(
        "max_hnsw_ef", 512, gt=0, description="A tenant's Retrieve hnsw_ef is capped here (exact search is "
        "turned off for tenants: an operator's tool).")
    prefix_cache: Literal["tenant", "shared"] = public_field(
        "prefix_cache", "tenant", description="tenant: each tenant's prompts reuse only its own cached prefixes "
        "(no cross-tenant timing signal); shared: all tenants share one prefix cache (a single-tenant deployment).")
    max_in_flight: int = public_field(
        "max_in_flight", 64, gt=0, description="Public calls in flight per process before RESOURCE_EXHAUSTED.")
    max_in_flight_per_tenant: int | None = public_field(
        "max_in_flight_per_tenant", None, ge=0, description="Public calls one tenant may hold per process (times its "
        "weight) before RESOURCE_EXHAUSTED; default half of max_in_flight; 0: no per-tenant bound.")
    tenant_weights: str = public_field(
        "tenant_weights", "", description="Per-tenant weights for the bound above, as name=weight pairs "
        "(acme=4,beta=1); unlisted tenants weigh 1.")

    @model_validator(mode="after")
    def _derive_tenant_bound(self) -> PublicApiSettings:
        if self.max_in_flight_per_tenant is None:
            object.__setattr__(self, "max_in_flight_per_tenant", max(1, self.max_in_flight // 2))
        self.tenant_weight_map  # parse now: a bad value fails at start, naming the variable
        return self

    @property
    def tenant_weight_map(self) -> dict[str, float]:
        weights = {}
        for pair in filter(None, (p.strip() for p in self.tenant_weights.split(","))):
            name, sep, value = pair.partition("=")
            try:
                weight = float(value)
            except ValueError:
                weight = -1.0
            if not sep or not name.strip() or not weight > 0:
                raise ValueError(f"{PUBLIC_PREFIX}TENANT_WEIGHTS: {pair!r} is not tenant=weight with a weight above 0")
            weights[name.strip()] = weight
        return weights

    def admission(self, holder: str) -> Admission:
        """The public calls' admission in this process (``holder`` names it in refusals: "this gateway process")."""
        return Admission(self.max_in_flight, per_tenant=self.max_in_flight_per_tenant or 0,
                         weights=self.tenant_weight_map, holder=holder)
