"""The embedder's bfloat16 passes (AGW_RETRIEVAL_EMBED_BF16), on the bundled model.

A pass may run its matrix products in bfloat16 where the CPU does so
natively; its vectors must stay where fp32 puts them (ranking unchanged). On
an AMX CPU a pass under the threshold, such as a single query, must not go
through it (the casts cost more than they save); with AVX512_BF16 and no AMX
every pass does. ``auto`` must follow the CPU.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from retrieval.embedder import (AMX_MIN_PADDED_CHARS, AVX512_BF16_MIN_PADDED_CHARS, Embedder, bf16_min_padded_chars,
                                cpu_bf16_kind, padded_chars)
from retrieval.settings import RetrievalSettings

pytestmark = pytest.mark.integration

TEXTS = [
    "The gateway keeps long-lived mTLS channels to every backend.",
    "Refunds are issued within five business days of the return.",
    "vLLM's prefix cache reuses the KV blocks of a shared system prompt.",
    "Qdrant's hnsw_ef trades recall for search latency.",
    "An invoice lists the order, its taxes and the payment terms.",
    "Postgres stores each turn in one transaction, both messages or neither.",
    "Keepalive pings find a silent connection before a call does.",
    "The tenant's certificate names its SPIFFE identity.",
]
QUERY = "how long does a refund take?"


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


@pytest.fixture(scope="module")
async def embedders():
    fp32 = await Embedder.load(None, bf16="off")
    half = await Embedder.load(None, bf16="on")
    yield fp32, half
    await fp32.close()
    await half.close()


async def test_a_bf16_pass_keeps_fp32s_vectors_and_ranking(embedders):
    fp32, half = embedders
    assert not fp32.bf16 and half.bf16
    exact, approx = await fp32.embed(TEXTS), await half.embed(TEXTS)
    assert half.runs_in_bf16(TEXTS) and not fp32.runs_in_bf16(TEXTS)
    assert approx != exact, "the pass did not run in bfloat16"
    cosines = [_dot(a, b) for a, b in zip(exact, approx)]  # normalised vectors: the dot is the cosine
    assert min(cosines) >= 0.9999, cosines
    query = (await fp32.embed([QUERY]))[0]
    ranking = lambda vectors: sorted(range(len(TEXTS)), key=lambda i: -_dot(query, vectors[i]))  # noqa: E731
    assert ranking(approx) == ranking(exact)
    assert ranking(exact)[0] == 1  # the refund text: the model itself still answers


async def test_a_pass_under_the_threshold_stays_fp32(embedders, monkeypatch):
    fp32, half = embedders
    monkeypatch.setattr(half, "bf16_min_chars", AMX_MIN_PADDED_CHARS)  # what an AMX CPU gets, whatever this one is
    few = TEXTS[:3]
    assert padded_chars(few) < AMX_MIN_PADDED_CHARS <= padded_chars(TEXTS)
    assert not half.runs_in_bf16(few) and not half.runs_in_bf16([QUERY])
    assert await half.embed(few) == await fp32.embed(few)
    assert await half.embed_query(QUERY) == (await fp32.embed([QUERY]))[0]
    assert await half.embed(TEXTS) != await fp32.embed(TEXTS)  # and over it, not


async def test_with_no_threshold_a_lone_query_runs_in_bf16(embedders, monkeypatch):
    fp32, half = embedders
    monkeypatch.setattr(half, "bf16_min_chars", AVX512_BF16_MIN_PADDED_CHARS)  # an AVX512_BF16 CPU without AMX
    assert half.runs_in_bf16([QUERY])
    exact, approx = (await fp32.embed([QUERY]))[0], await half.embed_query(QUERY)
    assert approx != exact, "the lone query did not run in bfloat16"
    assert _dot(exact, approx) >= 0.9999


@pytest.mark.parametrize(("mode", "cpu", "threshold"), [
    ("auto", "amx", AMX_MIN_PADDED_CHARS),
    ("auto", "avx512_bf16", AVX512_BF16_MIN_PADDED_CHARS),
    ("auto", "emulated", None),
    ("on", "amx", AMX_MIN_PADDED_CHARS),
    ("on", "avx512_bf16", AVX512_BF16_MIN_PADDED_CHARS),
    ("on", "emulated", AMX_MIN_PADDED_CHARS),
    ("off", "amx", None),
    ("off", "avx512_bf16", None),
])
def test_the_threshold_follows_the_mode_and_the_cpu(mode, cpu, threshold):
    assert bf16_min_padded_chars(mode, cpu) == threshold


async def test_auto_follows_this_cpu_and_bad_values_are_refused(monkeypatch):
    kind = cpu_bf16_kind()
    assert kind in ("amx", "avx512_bf16", "emulated")
    auto = await Embedder.load(None, bf16="auto")
    try:
        assert auto.bf16_min_chars == bf16_min_padded_chars("auto", kind)
    finally:
        await auto.close()
    with pytest.raises(ValueError, match="auto, on or off"):
        bf16_min_padded_chars("yes", kind)
    with pytest.raises(ValueError, match="unknown CPU bfloat16 kind"):
        bf16_min_padded_chars("auto", "avx2")
    monkeypatch.setenv("AGW_RETRIEVAL_EMBED_BF16", "fast")
    with pytest.raises(ValidationError, match="embed_bf16"):
        RetrievalSettings()
    monkeypatch.setenv("AGW_RETRIEVAL_EMBED_BF16", "off")
    assert RetrievalSettings().embed_bf16 == "off"
