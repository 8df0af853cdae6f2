"""The embedder's fused forward pass (AGW_RETRIEVAL_EMBED_FUSED, retrieval/fused_bert.py), on the bundled model.

The bundled all-MiniLM-L6-v2 is a BERT with mean pooling, so it runs fused by
default. Its vectors must be the model's own: in fp32 to rounding, in
bfloat16 within the cosine that bfloat16 itself allows, padded passes
included, with the same ranking. A model of another shape is not fused, and a
fused pass that disagrees with the model's on the probes is refused at load.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from pydantic import ValidationError

from retrieval import embedder as embedder_module
from retrieval.embedder import Embedder, fused_forward, stacked_linear
from retrieval.fused_bert import FusedBertEncoder
from retrieval.settings import RetrievalSettings
from tests.integration.test_embedder_passes import PASSAGES

pytestmark = pytest.mark.integration

QUERY = "how long does a refund take?"
PASSES = [[QUERY], [f"question {i}: how do I rotate the certificates of service {i}?" for i in range(32)], PASSAGES]
PASS_IDS = ["lone query", "a pass of 32 queries", "passages of mixed lengths (padded)"]


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


@pytest.fixture(scope="module")
async def fp32_pair():
    fused, modules = await Embedder.load(None, bf16="off"), await Embedder.load(None, bf16="off", fused=False)
    yield fused, modules
    await fused.close()
    await modules.close()


async def test_the_bundled_model_runs_fused_unless_turned_off(fp32_pair):
    fused, modules = fp32_pair
    assert isinstance(fused.fused, FusedBertEncoder)
    assert modules.fused is None


@pytest.mark.parametrize("texts", PASSES, ids=PASS_IDS)
async def test_fp32_fused_vectors_are_the_models_to_rounding(fp32_pair, texts):
    fused, modules = fp32_pair
    got, expected = await fused.embed(texts), await modules.embed(texts)
    assert len(got) == len(expected) == len(texts)
    worst = max(abs(x - y) for a, b in zip(got, expected) for x, y in zip(a, b))
    assert worst < 1e-5, worst


@pytest.mark.parametrize("texts", PASSES, ids=PASS_IDS)
async def test_bf16_fused_vectors_keep_the_models_and_its_ranking(texts):
    fused, modules = await Embedder.load(None, bf16="on"), await Embedder.load(None, bf16="on", fused=False)
    try:
        assert fused.fused is not None and fused.bf16
        got, expected = await fused.embed(texts), await modules.embed(texts)
        assert min(_dot(a, b) for a, b in zip(got, expected)) >= 0.9999
        # The passages ranked for the query: distinct texts (the 32 queries differ by a digit, and their
        # scores tie within bfloat16's own rounding).
        query, kept, ranked = (await modules.embed([QUERY]))[0], await modules.embed(PASSAGES), await fused.embed(PASSAGES)
        ranking = lambda vectors: sorted(range(len(PASSAGES)), key=lambda i: -_dot(query, vectors[i]))  # noqa: E731
        assert ranking(ranked) == ranking(kept)
        assert ranking(kept)[0] == 1  # the refund passage
    finally:
        await fused.close()
        await modules.close()


async def test_a_model_of_another_shape_is_not_fused(fp32_pair):
    _, modules = fp32_pair
    model = modules._model
    assert FusedBertEncoder.of(model, stacked_linear) is not None
    cls_pooled = copy.deepcopy(model)
    cls_pooled[1].pooling_mode = "cls"  # the first token's vector, not the mean: another function
    assert FusedBertEncoder.of(cls_pooled, stacked_linear) is None
    decoder = copy.deepcopy(model)
    decoder[0].auto_model.config.is_decoder = True
    assert FusedBertEncoder.of(decoder, stacked_linear) is None
    unbiased = copy.deepcopy(model)
    unbiased[0].auto_model.encoder.layer[3].attention.self.key.bias = None
    assert FusedBertEncoder.of(unbiased, stacked_linear) is None
    assert FusedBertEncoder.of(torch.nn.Sequential(torch.nn.Linear(2, 2)), stacked_linear) is None


async def test_a_fused_pass_that_disagrees_at_load_is_refused(fp32_pair, monkeypatch, caplog):
    _, modules = fp32_pair
    truthful = FusedBertEncoder.__call__
    monkeypatch.setattr(FusedBertEncoder, "__call__", lambda self, features: truthful(self, features).flip(-1))
    with caplog.at_level(logging.WARNING, logger=embedder_module.__name__):
        assert fused_forward(modules._model) is None
    assert "disagrees with the model's own" in caplog.text


def test_the_setting_defaults_on_and_takes_false(monkeypatch):
    assert RetrievalSettings().embed_fused is True
    monkeypatch.setenv("AGW_RETRIEVAL_EMBED_FUSED", "false")
    assert RetrievalSettings().embed_fused is False
    monkeypatch.setenv("AGW_RETRIEVAL_EMBED_FUSED", "sometimes")
    with pytest.raises(ValidationError, match="embed_fused"):
        RetrievalSettings()
