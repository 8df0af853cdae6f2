"""A Search request as the core receives it: the query vector and the filter, converted once."""

from __future__ import annotations

from agent.retrieval.v1 import retrieval_pb2 as pb
from retrieval.convert import search_from_proto
from retrieval.core import Document


def _parsed(**fields) -> pb.SearchRequest:
    # Parsed from the wire, as the service receives it: a repeated field of a parsed message, not the list it was
    # built from.
    return pb.SearchRequest.FromString(pb.SearchRequest(collection="docs", top_k=3, **fields).SerializeToString())


def test_the_query_vector_arrives_whole_and_in_order_as_float32_values():
    values = [0.1, -2.5, 3.0e-8, 1 / 3]
    search = search_from_proto(_parsed(vector=pb.Vector(values=values)))
    assert isinstance(search.vector, list)
    assert search.vector == list(pb.Vector(values=values).values)  # the float32 values the wire carries
    assert search.vector[1] == -2.5 and len(search.vector) == 4
    assert search.text is None


def test_a_text_query_has_no_vector():
    search = search_from_proto(_parsed(text="what is a lambda?"))
    assert search.vector is None and search.text == "what is a lambda?"


def test_a_search_without_conditions_has_an_empty_filter_and_one_with_them_keeps_them():
    assert not search_from_proto(_parsed(text="q")).filter
    kept = search_from_proto(_parsed(text="q", filter=pb.Filter(
        must=[pb.FieldCondition(key="lang", keyword="en")],
        must_not=[pb.FieldCondition(key="draft", boolean=True)])))
    assert [(c.key, c.keyword) for c in kept.filter.must] == [("lang", "en")]
    assert [(c.key, c.boolean) for c in kept.filter.must_not] == [("draft", True)]


def test_a_document_needs_no_vector_to_be_embedded():
    assert Document(id="d1", text="a passage to embed", payload={}).vector is None
