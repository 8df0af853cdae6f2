"""The retrieval service (``agent.retrieval.v1.Retrieval``): embeddings and Qdrant search.

It owns the embedding model, the two Qdrant stores (server and Edge) and the
hnsw_ef tuning that trims search cost to a recall target.
"""
