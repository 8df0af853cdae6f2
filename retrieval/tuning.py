"""Tuning hnsw_ef to a recall target: the smallest ef whose recall@k against exact search meets it.

Ground truth is the store's own exact search (``exact=True``). Queries are
held-out stored points (their own vectors, with the point itself excluded
from both result lists, so a point never counts as finding itself) or texts
the caller gives. The sweep doubles ef from 16 and stops at the first that
meets the target, so the chosen ef is the smallest tried that does.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from servicekit.stats import percentile

from retrieval.stores.base import CollectionSpec, SearchQuery, VectorStore

EF_FLOOR = 16


@dataclass(frozen=True)
class EfMeasurement:
    ef: int
    recall: float
    p50_ms: float
    p95_ms: float


@dataclass(frozen=True)
class TuneReport:
    chosen_ef: int
    recall: float
    target_met: bool
    measurements: tuple[EfMeasurement, ...]
    queries: int


def ef_schedule(max_ef: int, k: int) -> list[int]:
    """16, 32, 64, ... up to max_ef (at least k: HNSW cannot return more than ef)."""
    efs, ef = [], EF_FLOOR
    while ef < max_ef:
        if ef >= k:
            efs.append(ef)
        ef *= 2
    efs.append(max(max_ef, k))
    return sorted(set(efs))


async def _top(store: VectorStore, name: str, vector, k: int, exclude: str | None, **params) -> tuple[list[str], float]:
    started = time.perf_counter()
    hits = await store.search(name, SearchQuery(vector=vector, limit=k + (exclude is not None), payload_fields=(), **params))
    elapsed = (time.perf_counter() - started) * 1000
    return [h.doc_id for h in hits if h.doc_id != exclude][:k], elapsed


async def tune_collection(
    store: VectorStore,
    spec: CollectionSpec,
    query_vectors: Sequence[tuple[Sequence[float], str | None]],
    *,
    target: float,
    k: int,
    max_ef: int,
) -> TuneReport:
    """Sweep ef over ``query_vectors`` (vector, held-out doc id) and store the choice with the collection."""
    await store.prepare_for_search(spec.name)
    truth = [
        (await _top(store, spec.name, vector, k, exclude, exact=True))[0] for vector, exclude in query_vectors
    ]
    measurements: list[EfMeasurement] = []
    chosen = None
    for ef in ef_schedule(max_ef, k):
        recalls, latencies = [], []
        for (vector, exclude), expected in zip(query_vectors, truth, strict=True):
            found, elapsed = await _top(store, spec.name, vector, k, exclude, hnsw_ef=ef)
            latencies.append(elapsed)
            recalls.append(len(set(found) & set(expected)) / max(1, len(expected)))
        measurement = EfMeasurement(ef, statistics.fmean(recalls), percentile(latencies, 50), percentile(latencies, 95))
        measurements.append(measurement)
        if measurement.recall >= target:
            chosen = measurement
            break
    target_met = chosen is not None
    chosen = chosen or measurements[-1]
    await store.update_metadata(replace(spec, tuned_ef=chosen.ef, tuned_recall=chosen.recall))
    return TuneReport(chosen.ef, chosen.recall, target_met, tuple(measurements), len(query_vectors))
