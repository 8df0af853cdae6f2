"""TuneCollection on 20,000 vectors: the chosen ef meets the recall target, and no smaller one did."""

from __future__ import annotations

import numpy as np
import pytest

from agent.retrieval.v1 import retrieval_pb2 as pb
from tests.support.retrieval_service import retrieval_server, retrieval_stub

pytestmark = pytest.mark.integration

COUNT = 20_000
DIM = 384  # the embedder's dimension, so text queries would work too
TARGET = 0.98
K = 10


def clustered_vectors(count: int, seed: int = 0) -> np.ndarray:
    """Unit vectors around 200 centres: close neighbours exist, as with real embeddings."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(200, DIM))
    vectors = centres[rng.integers(0, 200, count)] + rng.normal(scale=0.9, size=(count, DIM))
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def _recall(found, expected) -> float:
    return len(set(found) & set(expected)) / len(expected)


async def test_tune_picks_the_smallest_ef_meeting_the_target(tmp_path, pki):
    vectors = clustered_vectors(COUNT)
    async with retrieval_server(tmp_path, pki.root) as (running, _):
        async with retrieval_stub(running.port, pki.root) as stub:
            await stub.CreateCollection(pb.CreateCollectionRequest(collection=pb.Collection(name="synthetic")), timeout=10)
            for start in range(0, COUNT, 2000):
                documents = [
                    pb.Document(id=f"v{i}", vector=pb.Vector(values=vectors[i].tolist()))
                    for i in range(start, min(COUNT, start + 2000))
                ]
                await stub.Upsert(pb.UpsertRequest(collection="synthetic", documents=documents), timeout=120)

            report = await stub.TuneCollection(pb.TuneCollectionRequest(
                collection="synthetic", target_recall=TARGET, k=K, sample_size=100
            ), timeout=300)
            assert report.target_met and report.recall >= TARGET
            efs = [m.ef for m in report.measurements]
            assert efs[0] == 16 and efs == sorted(efs) and efs[-1] == report.chosen_ef
            below = [m for m in report.measurements if m.ef < report.chosen_ef]
            assert all(m.recall < TARGET for m in below)
            assert below or report.chosen_ef == 16, "either a lower ef missed the target or the sweep began at its floor"
            assert all(m.p50_ms > 0 for m in report.measurements)

            collection = (await stub.GetCollection(pb.GetCollectionRequest(name="synthetic"), timeout=10)).collection
            assert (collection.tuned_ef, collection.tuned_recall) == (report.chosen_ef, pytest.approx(report.recall))

            # Check the choice independently, on queries the tuner never saw.
            rng = np.random.default_rng(42)
            recalls = []
            for index in rng.choice(COUNT, 50, replace=False):
                query = vectors[index] + rng.normal(scale=0.3 / np.sqrt(DIM), size=DIM).astype(np.float32)
                request = dict(collection="synthetic", vector=pb.Vector(values=query.tolist()), top_k=K, payload_fields=["doc_id"])
                tuned = await stub.Search(pb.SearchRequest(**request), timeout=10)
                exact = await stub.Search(pb.SearchRequest(**request, exact=True), timeout=10)
                assert tuned.hnsw_ef == report.chosen_ef  # Search uses the tuned ef by default
                recalls.append(_recall([r.id for r in tuned.results], [r.id for r in exact.results]))
            assert np.mean(recalls) >= TARGET - 0.02, f"held-out recall {np.mean(recalls):.3f}"
