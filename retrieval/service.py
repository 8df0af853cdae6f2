"""The ``agent.retrieval.v1.Retrieval`` servicer and the app the bootstrap runs."""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack, asynccontextmanager

from agent.retrieval.v1 import retrieval_pb2 as pb
from agent.retrieval.v1 import retrieval_pb2_grpc
from servicekit.errors import InvalidArgument, Unavailable
from servicekit.server import Health

from retrieval.convert import (
    collection_to_proto,
    documents_from_proto,
    search_from_proto,
    search_to_proto,
    spec_from_proto,
    tune_to_proto,
)
from retrieval.core import RetrievalCore, check_collection_name
from retrieval.embedder import Embedder
from retrieval.settings import RetrievalSettings
from retrieval.stores.edge import EdgeStore
from retrieval.stores.server import ServerStore
from retrieval.tuning import tune_collection
from retrieval.public_retrieve import PublicRetrieve

log = logging.getLogger(__name__)

RETRIEVAL_SERVICE = pb.DESCRIPTOR.services_by_name["Retrieval"]
MAX_TUNE_QUERIES = 1000


class RetrievalServicer(retrieval_pb2_grpc.RetrievalServicer):
    def __init__(self, settings: RetrievalSettings) -> None:
        self.settings = settings
        self.core: RetrievalCore | None = None

    def _core(self) -> RetrievalCore:
        if self.core is None:
            raise Unavailable("retrieval store is not open")
        return self.core

    async def CreateCollection(self, request, context):
        spec, count = await self._core().create_collection(spec_from_proto(request.collection))
        return pb.CreateCollectionResponse(collection=collection_to_proto(spec, count))

    async def GetCollection(self, request, context):
        spec, count = await self._core().get_collection(request.name)
        return pb.GetCollectionResponse(collection=collection_to_proto(spec, count))

    async def DeleteCollection(self, request, context):
        return pb.DeleteCollectionResponse(existed=await self._core().delete_collection(request.name))

    async def Upsert(self, request, context):
        stored = await self._core().upsert(request.collection, documents_from_proto(request.documents))
        return pb.UpsertResponse(upserted=stored)

    async def Delete(self, request, context):
        await self._core().delete(request.collection, list(request.ids))
        return pb.DeleteResponse()

    async def Search(self, request, context):
        output = await self._core().search(search_from_proto(request))
        return search_to_proto(output, self.settings.max_response_bytes)

    async def TuneCollection(self, request, context):
        core = self._core()
        check_collection_name(request.collection)
        target = request.target_recall or self.settings.default_recall_target
        if not 0 < target <= 1:
            raise InvalidArgument("target_recall", f"must be in (0, 1] (got {target})")
        k = request.k or 10
        core.check_top_k(k)
        sample_size = request.sample_size or 100
        if sample_size > MAX_TUNE_QUERIES or len(request.queries) > MAX_TUNE_QUERIES:
            raise InvalidArgument("sample_size", f"at most {MAX_TUNE_QUERIES} queries")
        max_ef = request.max_ef or 512
        spec, count = await core.get_collection(request.collection)
        if count <= k:
            raise InvalidArgument("collection", f"{request.collection!r} holds {count} documents; tuning needs more than k={k}")
        if request.queries:
            vectors = await core.embedder.embed(list(request.queries))
            queries = [(vector, None) for vector in vectors]
        else:
            sample = await core.store.sample_points(request.collection, sample_size)
            queries = [(point.vector, point.payload.get("doc_id")) for point in sample]
        report = await tune_collection(core.store, spec, queries, target=target, k=k, max_ef=max_ef)
        log.info("tuned %s: ef=%d recall@%d=%.3f over %d queries (target %.2f %s)", spec.name, report.chosen_ef, k,
                 report.recall, report.queries, target, "met" if report.target_met else "NOT met")
        return tune_to_proto(report)


class RetrievalApp:
    """The retrieval service, as the servicekit bootstrap runs it."""

    name = "retrieval"
    services = (RETRIEVAL_SERVICE,)

    def __init__(self, settings: RetrievalSettings) -> None:
        self.settings = settings
        self.servicer = RetrievalServicer(settings)
        # With an edge (AGW_RETRIEVAL_EDGE_CLIENTS), the public Retrieve too: for tenants, through the edge only.
        self.public = PublicRetrieve(settings, self.servicer) if settings.edge_client_patterns else None
        if self.public is not None:
            self.public.declare_on(self)

    def register(self, server) -> None:
        retrieval_pb2_grpc.add_RetrievalServicer_to_server(self.servicer, server)
        if self.public is not None:
            self.public.register(server)

    @asynccontextmanager
    async def lifespan(self, health: Health):
        settings = self.settings
        async with AsyncExitStack() as stack:
            if settings.qdrant_url:
                store = ServerStore.connect(settings.qdrant_url, api_key=settings.qdrant_key(),
                                            timeout_s=settings.qdrant_timeout_s,
                                            spec_ttl_s=settings.qdrant_spec_ttl_s)
                log.info("store: Qdrant server at %s (gRPC preferred)", settings.qdrant_url)
            else:
                store = await EdgeStore.open(settings.edge_dir, settings.store_threads,
                                             settings.search_threads or None, settings.inline_search_us)
                log.info("store: Qdrant Edge in-process at %s", settings.edge_dir)
            stack.push_async_callback(store.close)
            embedder = await Embedder.load(settings.embed_model, settings.embed_threads, settings.embed_torch_threads,
                                           settings.embed_query_batch, settings.embed_cache_entries,
                                           bf16=settings.embed_bf16, fused=settings.embed_fused)
            stack.push_async_callback(embedder.close)
            log.info("start-up: embedder warm-up took %.0f ms", await embedder.warm_up())
            self.servicer.core = RetrievalCore(store, embedder, settings)
            try:
                yield
            finally:
                self.servicer.core = None
