"""The embedder's passes call the model's modules directly: its vectors must be ``encode()``'s, to the bit.

``retrieval.embedder.Embedder._encode`` skips ``SentenceTransformer.encode``'s
per-call bookkeeping; what it computes must not change: the same vectors for a
lone query, a pass of queries, passages of mixed lengths, and more texts than
one pass holds (in their order), on the bundled all-MiniLM-L6-v2 in fp32, its
forward pass through the model's own modules (``AGW_RETRIEVAL_EMBED_FUSED``
off; the fused pass is tests/integration/test_embedder_fused.py's).
"""

from __future__ import annotations

import asyncio

import pytest

from retrieval.embedder import Embedder

pytestmark = pytest.mark.integration

PASSAGES = [
    "The gateway keeps long-lived mTLS channels to every backend.",
    "Refunds are issued within five business days of the return, " * 12,
    "vLLM's prefix cache reuses the KV blocks of a shared system prompt.",
    "ok",
    "Postgres stores each turn in one transaction, both messages or neither. " * 5,
]


@pytest.fixture(scope="module")
async def embedder():
    loaded = await Embedder.load(None, bf16="off", fused=False)
    yield loaded
    await loaded.close()


async def _encoded(embedder: Embedder, texts: list[str]) -> list[list[float]]:
    """``encode()``'s vectors, computed on the embedder's own thread: PyTorch's intra-op thread count is a
    thread's own setting (the embedder's is set when it loads), and on some CPUs (a Xeon with AVX512_BF16 and no
    AMX) a pass split over another number of threads differs in the last bits."""
    def encode() -> list[list[float]]:
        return embedder._model.encode(texts, normalize_embeddings=True, convert_to_numpy=True,
                                      show_progress_bar=False).tolist()

    return await asyncio.get_running_loop().run_in_executor(embedder._executor, encode)


@pytest.mark.parametrize("texts", [
    ["how long does a refund take?"],
    [f"question {i}: how do I rotate the certificates of service {i}?" for i in range(32)],
    PASSAGES,
], ids=["lone query", "a pass of 32 queries", "passages of mixed lengths"])
async def test_the_vectors_are_encodes_to_the_bit(embedder, texts):
    assert await embedder.embed(texts) == await _encoded(embedder, texts)


async def test_more_texts_than_a_pass_holds_come_back_in_order(embedder):
    before = embedder.texts_embedded
    vectors = await embedder.embed(PASSAGES, batch_size=2)  # three passes: 2, 2 and 1
    # Each pass's vectors, as encode() gives them for the same texts together (a text's batch-mates set the
    # padding, and with it the last bits).
    assert vectors == [*await _encoded(embedder, PASSAGES[0:2]), *await _encoded(embedder, PASSAGES[2:4]),
                       *await _encoded(embedder, PASSAGES[4:5])]
    assert embedder.texts_embedded - before == len(PASSAGES)
