"""Settings of the inference service (``AGW_INFERENCE_*``, plus ``AGW_MODEL``)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import Field

from servicekit.public_api import PublicApiSettings
from servicekit.settings import Port, ServiceSettings, deployment_field, prefixed_config


#: The longest WatchLoad interval, configured or asked for: a stream that never speaks is not a load signal.
MAX_LOAD_WATCH_INTERVAL_MS = 60_000


class InferenceSettings(ServiceSettings, PublicApiSettings):
    """Engine and service options. ``None`` means "chosen for this machine at start".

    The public API's settings (PublicApiSettings, ``AGW_GATEWAY_MAX_*``) bound
    the public ``Generate`` this service serves to an edge (AGW_INFERENCE_EDGE_CLIENTS).
    """

    model_config = prefixed_config("inference")

    port: Port = 50053
    identity: str = Field("inference", description="The service identity this process presents; its files are in $AGW_TLS_DIR/service/<name>/.")
    model: str | None = deployment_field(
        None, "model", description="Hugging Face id or local path; unset means the offline smoke model."
    )
    dtype: str = Field("auto", description="Weights' dtype: auto, float32, bfloat16 or float16.")
    quantization: str | None = Field(None, description="Passed to vLLM, e.g. fp8 for bandwidth-bound GPUs.")
    block_size: int | None = Field(None, gt=0, description="KV block size; default 16 on CUDA, 32 on CPU.")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV cache of shared prompt prefixes (system prompt, history).")
    enable_chunked_prefill: bool = Field(True, description="Split long prefills so they share engine steps with decodes.")
    max_model_len: int | None = Field(None, gt=0, description="Context length; default the model's own.")
    max_num_seqs: int | None = Field(None, gt=0, description="Batch limit; default from memory.")
    max_num_batched_tokens: int | None = Field(None, gt=0, description="Tokens per step; default vLLM's.")
    stream_interval: int = Field(
        1, ge=1, le=64, description="The engine sends a stream's tokens every N steps (the first at once, the last "
        "with the finish); fewer, larger messages on every hop for N-1 steps of added inter-token delay. A stream "
        "whose reader lags is merged anyway (vLLM's output collector), so 1 costs only when every hop keeps up.")
    kv_cache_gib: float | None = Field(
        None, gt=0, description="CPU: KV-cache space in GiB (vLLM's kv_cache_memory_bytes); default from RAM."
    )
    gpu_memory_utilization: float = Field(0.90, gt=0, le=1, description="CUDA: fraction of VRAM vLLM may take.")
    expected_seq_tokens: int = Field(
        2048, gt=0, description="Typical prompt+completion length, for sizing max_num_seqs on CPU."
    )
    enforce_eager: bool | None = Field(
        None, description="Skip graph capture/compilation; default true on CPU, where it only slows start-up."
    )
    prefill_prefixes: bool = Field(
        True, description="Prefill an OpenGenerate prefix whose caller asks (prefill_cache_salt) while the engine has "
        "room, so the request finds it in the prefix cache.")
    prefill_max_running: int = Field(
        8, gt=0, description="Prefill prefixes only while fewer requests than this run (and none waits): in a busy "
        "engine a prefill slows every running request's step and is often stopped before it finishes "
        "(docs/benchmarks.md).")
    max_waiting: int = Field(64, ge=0, description="Requests queued beyond max_num_seqs before RESOURCE_EXHAUSTED.")
    default_max_tokens: int = Field(256, gt=0, description="max_tokens when a request sets none.")
    tokenizer_threads: int = Field(2, gt=0, description="Threads for tokenizing and chat templating off the loop.")
    seed: int = Field(0, description="The engine's random seed (requests may set their own).")
    warmup: bool = Field(True, description="Warm tokenizer and engine before SERVING (off only to measure it).")
    structured_output_backend: Literal["guidance", "xgrammar"] = Field(
        "guidance", description="vLLM's structured-output backend: guidance (llguidance) guarantees strict JSON; "
        "xgrammar lets raw control characters into JSON strings.")
    tool_parser: str = Field(
        "auto", description="vLLM tool parser for tool_choice AUTO (e.g. hermes, llama3_json, mistral); auto reads "
        "the chat template, none disables parsing.")
    constraint_cache_size: int = Field(256, gt=0, description="Compiled structured-output constraints kept, by text.")
    replica_name: str = Field(
        default_factory=socket.gethostname, description="A stable name for this replica, sent on WatchLoad: "
        "gateways that find replicas through DNS rank them by it (default the host name, a StatefulSet pod's name).")
    load_watch_interval_ms: int = Field(
        100, ge=100, le=MAX_LOAD_WATCH_INTERVAL_MS,
        description="Least time between two WatchLoad messages (a caller may ask for longer, up to 60 s).")
    engine_spin_ms: float | None = Field(
        None, gt=0, le=1000, description="How long vLLM's engine processes spin on their shared-memory queues after a "
        "message before they sleep (inference/engine_waits.py); unset: 2 on CPU, vLLM's own 1000 elsewhere.")
    warm_schemas_file: Path | None = Field(
        None, description="A JSON file holding a list of JSON Schemas compiled into the cache at start.")

    @property
    def smoke_model_dir(self) -> Path:
        return self.home / "models" / "smoke"
