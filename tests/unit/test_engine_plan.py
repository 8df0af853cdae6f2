"""Engine arguments chosen per platform, each with its reason."""

from __future__ import annotations

import pytest

from inference.engine_plan import ModelShape, Platform, default_kv_cache_gib, plan_engine
from inference.settings import InferenceSettings

pytestmark = pytest.mark.unit

CPU = Platform(device="cpu", total_memory_gib=24)
H200 = Platform(device="cuda", total_memory_gib=139.8)
SMOKE = ModelShape(num_layers=2, num_kv_heads=2, head_dim=64, max_position_embeddings=4096, dtype_bytes=2)


def test_cpu_defaults_block_32_eager_and_kv_space():
    plan = plan_engine(InferenceSettings(), CPU, "/m", SMOKE)
    args = plan.engine_args
    assert args["block_size"] == 32
    assert args["enable_prefix_caching"] and args["enable_chunked_prefill"]
    assert args["enforce_eager"] is True
    # Bytes as an engine argument: vLLM reads VLLM_CPU_KVCACHE_SPACE as whole
    # GiB and refused the 2.4 GiB this default used to put there.
    assert args["kv_cache_memory_bytes"] == int(2.4 * 2**30)
    assert "gpu_memory_utilization" not in args
    assert all(key in plan.reasons for key in ("block_size", "enable_prefix_caching", "max_num_seqs"))


def test_cpu_max_num_seqs_follows_the_kv_space():
    shape = ModelShape(num_layers=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192)  # 128 KiB/token
    plan = plan_engine(InferenceSettings(kv_cache_gib=4), CPU, "/m", shape)
    # 4 GiB / 128 KiB = 32768 tokens; / 2048 tokens per sequence = 16.
    assert plan.engine_args["max_num_seqs"] == 16
    small = plan_engine(InferenceSettings(kv_cache_gib=0.1), CPU, "/m", shape)
    assert small.engine_args["max_num_seqs"] == 1


def test_gpu_defaults_block_16_and_twelve_seqs_per_gib():
    plan = plan_engine(InferenceSettings(quantization="fp8"), H200, "org/model", None)
    assert plan.engine_args["block_size"] == 16
    assert plan.engine_args["max_num_seqs"] == int(139.8 * 12)
    assert plan.engine_args["gpu_memory_utilization"] == 0.90
    assert plan.engine_args["quantization"] == "fp8"
    assert "kv_cache_memory_bytes" not in plan.engine_args


def test_settings_override_every_default():
    settings = InferenceSettings(
        block_size=64, max_num_seqs=3, max_num_batched_tokens=512, max_model_len=1024, stream_interval=4,
        enable_prefix_caching=False, enable_chunked_prefill=False, enforce_eager=False,
    )
    args = plan_engine(settings, CPU, "/m", SMOKE).engine_args
    assert (args["block_size"], args["max_num_seqs"], args["max_num_batched_tokens"], args["max_model_len"]) == (64, 3, 512, 1024)
    assert args["stream_interval"] == 4
    assert not args["enable_prefix_caching"] and not args["enable_chunked_prefill"] and not args["enforce_eager"]


def test_cpu_block_size_must_be_a_multiple_of_32():
    with pytest.raises(ValueError, match="AGW_INFERENCE_BLOCK_SIZE=16: .*multiple of 32"):
        plan_engine(InferenceSettings(block_size=16), CPU, "/m", SMOKE)
    plan_engine(InferenceSettings(block_size=16), H200, "/m", SMOKE)  # fine on CUDA


@pytest.mark.parametrize(("ram", "expected"), [(2, 0.5), (24, 2.4), (512, 8.0)])
def test_default_kv_space_fits_small_and_large_boxes(ram, expected):
    assert default_kv_cache_gib(ram) == expected


def test_model_shape_from_config():
    shape = ModelShape.from_config({
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 256, "max_position_embeddings": 4096, "dtype": "float32",
    })
    assert (shape.head_dim, shape.kv_bytes_per_token) == (64, 2 * 2 * 2 * 64 * 4)


def test_describe_lists_every_choice():
    lines = plan_engine(InferenceSettings(), CPU, "/m", SMOKE).describe()
    assert any(line.startswith("block_size=32 (") for line in lines)
    assert any(line.startswith(f"kv_cache_memory_bytes={int(2.4 * 2**30)} (2.4 GiB: 10% of 24 GiB RAM") for line in lines)
