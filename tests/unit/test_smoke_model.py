"""The offline smoke model builder."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from inference.smoke_model import MARKER, build_smoke_model, is_built

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def built(smoke_model):
    return smoke_model


def test_builds_a_small_hugging_face_folder(built):
    names = {p.name for p in built.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= names
    config = json.loads((built / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    size_mb = sum(p.stat().st_size for p in built.iterdir()) / 1e6
    assert size_mb < 20, f"{size_mb:.1f} MB is not a smoke model"


def test_tokenizer_round_trips_and_has_a_chat_template(built):
    tokenizer = AutoTokenizer.from_pretrained(built)
    text = "def handler(request): return None"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<s><|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\n"


def test_second_build_reuses_the_first(built):
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert is_built(built)
    build_smoke_model(built)
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp
