"""Settings of the retrieval service (``AGW_RETRIEVAL_*``, plus ``AGW_QDRANT_URL`` and ``AGW_EMBED_MODEL``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from servicekit.settings import Port, ServiceSettings, deployment_field, prefixed_config


class RetrievalSettings(ServiceSettings):
    """Store, embedder and trimming limits."""

    model_config = prefixed_config("retrieval")

    port: Port = 50052
    identity: str = Field("retrieval", description="The service identity this process presents; its files are in $AGW_TLS_DIR/service/<name>/.")
    qdrant_url: str | None = deployment_field(
        None, "qdrant_url", description="Qdrant server (gRPC preferred); unset means Qdrant Edge in-process."
    )
    qdrant_api_key: str | None = deployment_field(None, "qdrant_api_key", description="API key for the Qdrant server.")
    qdrant_timeout_s: float = Field(5.0, gt=0, description="Deadline for each call to the Qdrant server.")
    embed_model: str | None = deployment_field(
        None, "embed_model", description="Local sentence-transformers model folder; default all-MiniLM-L6-v2 (bundled)."
    )
    embed_threads: int = Field(1, gt=0, description="Threads that run the embedder off the event loop.")
    embed_torch_threads: int = Field(1, gt=0, description="PyTorch intra-op threads for the embedder.")
    embed_batch: int = Field(64, gt=0, description="Texts embedded per batch on upsert.")
    embed_query_batch: int = Field(
        16, gt=0, description="Most concurrent search queries embedded in one forward pass (1: one pass each).")
    store_threads: int = Field(2, gt=0, description="Threads that run Qdrant Edge calls off the event loop.")
    upsert_chunk: int = Field(256, gt=0, description="Documents written per store call on upsert.")
    max_upsert_documents: int = Field(10_000, gt=0, description="Most documents in one Upsert request.")
    trim_payloads: bool = Field(
        True, description="A Search naming no payload fields gets the collection's defaults; false: whole payloads "
        "(for debugging only: bytes and latency grow with the payload).")
    top_k_cap: int = Field(100, gt=0, description="Largest top_k a Search may ask for.")
    max_response_bytes: int = Field(
        1 << 20, ge=1024, description="Serialized Search response bound; results past it are cut and flagged."
    )
    default_recall_target: float = Field(0.98, gt=0, le=1, description="Recall@k TuneCollection aims for.")

    @property
    def edge_dir(self) -> Path:
        return self.home / "qdrant-edge"
