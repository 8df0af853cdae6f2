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


def test_a_build_that_finishes_second_keeps_the_first_in_place(tmp_path, monkeypatch):
    """Two replicas on one AGW_HOME build at once; the one that finishes second must not delete the folder the
    first is already loading from (it once did: a replica's tokenizer load failed with the files gone)."""
    import inference.smoke_model as smoke_model

    folder = tmp_path / "smoke"
    real_train = smoke_model._train_tokenizer
    first_build = {}

    def train_while_another_builder_finishes(spec):
        if not first_build:  # the other replica completes its whole build while ours trains
            first_build["started"] = True
            first_build["folder"] = build_smoke_model(folder)
            (folder / "in-use").write_text("a replica is loading from here")
        return real_train(spec)

    monkeypatch.setattr(smoke_model, "_train_tokenizer", train_while_another_builder_finishes)
    assert build_smoke_model(folder) == first_build["folder"]
    assert (folder / "in-use").exists(), "the second builder replaced the folder the first had put in place"
    assert is_built(folder)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a staging folder was left behind"


def test_a_stale_build_is_replaced(tmp_path):
    folder = tmp_path / "smoke"
    build_smoke_model(folder)
    marker = json.loads((folder / MARKER).read_text())
    (folder / MARKER).write_text(json.dumps({**marker, "build_version": -1}))
    assert not is_built(folder)
    build_smoke_model(folder)
    assert is_built(folder)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
