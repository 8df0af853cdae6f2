"""Choosing vLLM's engine arguments for this machine, with the reason for each.

Pure functions of the settings, the platform and the model's shape, so the
choices are unit-tested without starting an engine, and logged at start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from inference.settings import InferenceSettings

#: vLLM's CPU attention kernels need a block size that is a multiple of this.
CPU_BLOCK_MULTIPLE = 32
#: The analysis's rule of thumb on GPUs: a dozen sequences per GiB of VRAM.
GPU_SEQS_PER_GIB = 12
MAX_AUTO_SEQS = 256


@dataclass(frozen=True)
class Platform:
    """The facts about this machine that the plan depends on."""

    device: str  # "cpu" or "cuda"
    total_memory_gib: float  # RAM on CPU, VRAM of one device on CUDA


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs from the model's config.json."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_config(cls, config: dict, dtype: str = "auto") -> ModelShape:
        text = config.get("text_config", config)
        heads = text["num_attention_heads"]
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        chosen = text.get("torch_dtype") or text.get("dtype") or "bfloat16" if dtype == "auto" else dtype
        return cls(
            num_layers=text["num_hidden_layers"],
            num_kv_heads=text.get("num_key_value_heads", heads),
            head_dim=head_dim,
            max_position_embeddings=text.get("max_position_embeddings", 2048),
            dtype_bytes=4 if str(chosen) in ("float32", "torch.float32") else 2,
        )

    @classmethod
    def from_folder(cls, folder: Path, dtype: str = "auto") -> ModelShape | None:
        """The shape of a local model; None for a hub id (sizing then uses vLLM's defaults)."""
        config = folder / "config.json"
        if not config.exists():
            return None
        return cls.from_config(json.loads(config.read_text()), dtype)


@dataclass
class EnginePlan:
    """The engine arguments to use, and why each non-default one was chosen."""

    engine_args: dict
    reasons: dict[str, str] = field(default_factory=dict)

    def describe(self) -> list[str]:
        """One line per choice, for the start-up log."""
        return [f"{key}={value!r} ({self.reasons.get(key, 'setting')})" for key, value in self.engine_args.items()]


def default_kv_cache_gib(total_memory_gib: float) -> float:
    """A tenth of RAM, between 0.5 and 8 GiB: room for the model and the OS on a small box."""
    return round(min(8.0, max(0.5, total_memory_gib * 0.10)), 2)


def plan_engine(settings: InferenceSettings, platform: Platform, model_path: str, shape: ModelShape | None) -> EnginePlan:
    """Decide the engine arguments for ``model_path`` on ``platform``."""
    on_cpu = platform.device == "cpu"
    args: dict = {"model": model_path, "tokenizer": model_path, "dtype": settings.dtype, "seed": settings.seed}
    reasons: dict[str, str] = {}

    args["enable_prefix_caching"] = settings.enable_prefix_caching
    reasons["enable_prefix_caching"] = "reuse KV of shared prefixes (system prompt, history): first token 186 -> 47 ms"
    args["enable_chunked_prefill"] = settings.enable_chunked_prefill
    reasons["enable_chunked_prefill"] = "long prefills share steps with decodes instead of stalling them"

    if settings.block_size is not None:
        if on_cpu and settings.block_size % CPU_BLOCK_MULTIPLE:
            raise ValueError(
                f"AGW_INFERENCE_BLOCK_SIZE={settings.block_size}: vLLM's CPU attention needs a multiple of "
                f"{CPU_BLOCK_MULTIPLE}"
            )
        args["block_size"] = settings.block_size
    else:
        args["block_size"] = CPU_BLOCK_MULTIPLE if on_cpu else 16
        reasons["block_size"] = (
            "smallest block vLLM's CPU attention accepts (multiple of 32)" if on_cpu
            else "small blocks share more prefix (the analysis recommends 16)"
        )

    max_len = settings.max_model_len or (shape.max_position_embeddings if shape else None)
    if max_len:
        args["max_model_len"] = max_len
        reasons.setdefault("max_model_len", "setting" if settings.max_model_len else "the model's context")

    if on_cpu:
        kv_gib = settings.kv_cache_gib or default_kv_cache_gib(platform.total_memory_gib)
        # An engine argument, not VLLM_CPU_KVCACHE_SPACE: vLLM reads that
        # (legacy) variable as whole GiB and fails on "2.35".
        args["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
        reasons["kv_cache_memory_bytes"] = (
            f"{kv_gib:g} GiB: " + ("setting" if settings.kv_cache_gib
                                  else f"10% of {platform.total_memory_gib:.0f} GiB RAM, 0.5-8 GiB")
        )
        args["enforce_eager"] = True if settings.enforce_eager is None else settings.enforce_eager
        reasons["enforce_eager"] = "no CUDA graphs on CPU; compilation only slows start-up"
    else:
        args["gpu_memory_utilization"] = settings.gpu_memory_utilization
        if settings.enforce_eager is not None:
            args["enforce_eager"] = settings.enforce_eager

    if settings.max_num_seqs is not None:
        args["max_num_seqs"] = settings.max_num_seqs
    elif on_cpu and shape is not None:
        kv_tokens = args["kv_cache_memory_bytes"] // shape.kv_bytes_per_token
        per_seq = min(settings.expected_seq_tokens, max_len or settings.expected_seq_tokens)
        args["max_num_seqs"] = max(1, min(MAX_AUTO_SEQS, kv_tokens // per_seq))
        reasons["max_num_seqs"] = (
            f"{kv_tokens} KV tokens fit in {kv_gib:g} GiB at {shape.kv_bytes_per_token} B/token, "
            f"/ {per_seq} tokens per sequence (cap {MAX_AUTO_SEQS})"
        )
    elif not on_cpu:
        args["max_num_seqs"] = max(1, int(platform.total_memory_gib * GPU_SEQS_PER_GIB))
        reasons["max_num_seqs"] = f"int({platform.total_memory_gib:.0f} GiB VRAM x {GPU_SEQS_PER_GIB}), so batches fit memory"

    if settings.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = settings.max_num_batched_tokens
    if settings.stream_interval > 1:
        args["stream_interval"] = settings.stream_interval
    if settings.quantization:
        args["quantization"] = settings.quantization
        reasons["quantization"] = "fewer bytes per weight for bandwidth-bound decoding"
    args["structured_outputs_config"] = {"backend": settings.structured_output_backend,
                                         "disable_any_whitespace": True}
    reasons["structured_outputs_config"] = ("strict, compact JSON: llguidance escapes control characters in "
                                            "strings (xgrammar lets them through); no whitespace runs")
    return EnginePlan(engine_args=args, reasons=reasons)
