"""The embedder's bfloat16 passes (AGW_RETRIEVAL_EMBED_BF16), on the bundled model.

A pass of several texts may run its matrix products in bfloat16 where the
CPU has AMX; its vectors must stay where fp32 puts them (ranking unchanged),
a single query must not go through it (the casts cost more than they save),
and ``auto`` must follow the CPU.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from retrieval.embedder import Embedder, bf16_pays, cpu_has_amx, use_bf16
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
    assert bf16_pays(TEXTS)
    assert approx != exact, "the pass did not run in bfloat16"
    cosines = [_dot(a, b) for a, b in zip(exact, approx)]  # normalised vectors: the dot is the cosine
    assert min(cosines) >= 0.9999, cosines
    query = (await fp32.embed([QUERY]))[0]
    ranking = lambda vectors: sorted(range(len(TEXTS)), key=lambda i: -_dot(query, vectors[i]))  # noqa: E731
    assert ranking(approx) == ranking(exact)
    assert ranking(exact)[0] == 1  # the refund text: the model itself still answers


async def test_a_pass_under_the_threshold_stays_fp32(embedders):
    fp32, half = embedders
    few = TEXTS[:3]
    assert not bf16_pays(few) and not bf16_pays([QUERY])
    assert await half.embed(few) == await fp32.embed(few)
    assert await half.embed_query(QUERY) == (await fp32.embed([QUERY]))[0]


def test_auto_follows_the_cpu_and_bad_values_are_refused(monkeypatch):
    assert use_bf16("auto") is cpu_has_amx()
    assert use_bf16("on") is True and use_bf16("off") is False
    with pytest.raises(ValueError, match="auto, on or off"):
        use_bf16("yes")
    monkeypatch.setenv("AGW_RETRIEVAL_EMBED_BF16", "fast")
    with pytest.raises(ValidationError, match="embed_bf16"):
        RetrievalSettings()
    monkeypatch.setenv("AGW_RETRIEVAL_EMBED_BF16", "off")
    assert RetrievalSettings().embed_bf16 == "off"
