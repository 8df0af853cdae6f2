"""Settings of the retrieval service (``AGW_RETRIEVAL_*``, plus ``AGW_QDRANT_URL`` and ``AGW_EMBED_MODEL``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from servicekit.public_api import PublicApiSettings
from servicekit.settings import Port, ServiceSettings, deployment_field, prefixed_config, read_secret


class RetrievalSettings(ServiceSettings, PublicApiSettings):
    """Store, embedder and trimming limits.

    The public API's settings (PublicApiSettings, ``AGW_GATEWAY_MAX_*``) bound
    the public ``Retrieve`` this service serves to an edge (AGW_RETRIEVAL_EDGE_CLIENTS).
    """

    model_config = prefixed_config("retrieval")

    port: Port = 50052
    identity: str = Field("retrieval", description="The service identity this process presents; its files are in $AGW_TLS_DIR/service/<name>/.")
    qdrant_url: str | None = deployment_field(
        None, "qdrant_url", description="Qdrant server (gRPC preferred); unset means Qdrant Edge in-process."
    )
    qdrant_api_key: str | None = deployment_field(None, "qdrant_api_key", description="API key for the Qdrant server.")
    qdrant_api_key_file: Path | None = deployment_field(
        None, "qdrant_api_key_file", description="File holding the Qdrant API key (a Docker or Kubernetes secret); "
        "instead of AGW_QDRANT_API_KEY.")
    qdrant_timeout_s: float = Field(5.0, gt=0, description="Deadline for each call to the Qdrant server.")
    qdrant_spec_ttl_s: float = Field(
        1.0, ge=0, description="How long a collection's spec (dimensions, tuned ef, default payload fields) read "
        "from the Qdrant server answers searches without asking again: reading it is two round trips before each "
        "search's own. This process's own changes apply at once; another replica's within this time. 0: read it "
        "for every search.")
    embed_model: str | None = deployment_field(
        None, "embed_model", description="Local sentence-transformers model folder; default all-MiniLM-L6-v2 (bundled)."
    )
    embed_threads: int = Field(1, gt=0, description="Threads that run the embedder off the event loop.")
    embed_torch_threads: int = Field(1, gt=0, description="PyTorch intra-op threads for the embedder.")
    embed_batch: int = Field(
        64, gt=0, description="Texts embedded per pass on upsert: a query waits behind at most one such pass, and a "
        "cancelled upsert stops after the one under way.")
    embed_cache_entries: int = Field(
        20_000, ge=0, description="Document vectors kept by the hash of their text (1.5 KiB each at 384 dimensions), "
        "so a retried upsert embeds nothing twice.")
    embed_query_batch: int = Field(
        32, gt=0, description="Most concurrent search queries embedded in one forward pass (1: one pass each); "
        "32 takes a burst of 32 searches in one pass, whose cost per query is lower than two of 16.")
    embed_fused: bool = Field(
        True, description="Run a BERT model with mean pooling (all-MiniLM-L6-v2) as one function over its weights, "
        "the attention's query, key and value products fused into one (retrieval/fused_bert.py), once it agrees "
        "with the model's own pass on probes at load; a lone query's pass 0.63-0.8x as long. false: the model's "
        "modules, as sentence-transformers runs them.")
    embed_bf16: Literal["auto", "on", "off"] = Field(
        "auto", description="Embedding passes' matrix products in bfloat16, the model's linear weights cast once at "
        "load, vectors within cosine 0.9999 of fp32's. auto: where the CPU runs bfloat16 natively (AMX tiles, or "
        "AVX512_BF16 as on AMD Zen 4/5), every pass (on an AMX core a lone query 0.85x fp32's time, a pass of 32 "
        "0.5x); elsewhere bfloat16 is emulated and slower, so fp32. on: also where emulated. off: fp32 always.")
    store_threads: int = Field(2, gt=0, description="Threads that run Qdrant Edge calls off the event loop.")
    search_threads: int = Field(
        1, ge=0, description="Threads in each Qdrant Edge collection's search pool; 0: Qdrant's default, from the "
        "CPU count (on 2 cores it doubled a search's CPU; docs/benchmarks.md).")
    inline_search_us: int = Field(
        100, ge=0, description="A Qdrant Edge search whose recent cost (a decaying maximum, per collection and "
        "query shape) is under this many microseconds runs on the event loop instead of the store's threads: the "
        "hand-off costs more than such a search (docs/benchmarks.md). 0: every search on the threads.")
    upsert_chunk: int = Field(256, gt=0, description="Documents written per store call on upsert.")
    max_upsert_documents: int = Field(10_000, gt=0, description="Most documents in one Upsert request.")
    max_collections_per_tenant: int = Field(
        100, gt=0, description="Collections one tenant (Collection.tenant) may hold; past it RESOURCE_EXHAUSTED.")
    max_documents_per_tenant: int = Field(
        1_000_000, gt=0, description="Documents one tenant may hold across its collections; an Upsert past it is "
        "refused with RESOURCE_EXHAUSTED.")
    trim_payloads: bool = Field(
        True, description="A Search naming no payload fields gets the collection's defaults; false: whole payloads "
        "(for debugging only: bytes and latency grow with the payload).")
    top_k_cap: int = Field(100, gt=0, description="Largest top_k a Search may ask for.")
    max_response_bytes: int = Field(
        1 << 20, ge=1024, description="Serialized Search response bound; results past it are cut and flagged."
    )
    default_recall_target: float = Field(0.98, gt=0, le=1, description="Recall@k TuneCollection aims for.")

    def qdrant_key(self) -> str | None:
        """The Qdrant API key: from AGW_QDRANT_API_KEY_FILE when set, else AGW_QDRANT_API_KEY."""
        if self.qdrant_api_key_file is not None:
            return read_secret(self.qdrant_api_key_file, "AGW_QDRANT_API_KEY_FILE")
        return self.qdrant_api_key

    @model_validator(mode="after")
    def _check_qdrant_key(self) -> RetrievalSettings:
        if self.qdrant_api_key_file is not None and self.qdrant_api_key:
            raise ValueError("set AGW_QDRANT_API_KEY_FILE or AGW_QDRANT_API_KEY, not both")
        self.qdrant_key()  # a key file must be readable and real at start
        return self

    @property
    def edge_dir(self) -> Path:
        return self.home / "qdrant-edge"
