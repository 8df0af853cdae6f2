"""``Bounds.retrieve``: its inline size checks refuse exactly the requests the per-field checks refuse, naming the
same field, and let every other request through."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from agent.gateway.v1 import gateway_pb2 as pb
from agent.retrieval.v1 import retrieval_pb2
from servicekit.bounds import Bounds
from servicekit.errors import InvalidArgument
from servicekit.public_api import PublicApiSettings

pytestmark = pytest.mark.unit

LIMITS = PublicApiSettings.model_validate({
    "AGW_GATEWAY_MAX_KEY_CHARS": 4, "AGW_GATEWAY_MAX_MESSAGE_CHARS": 6, "AGW_GATEWAY_MAX_VECTOR_DIMS": 3,
    "AGW_GATEWAY_MAX_FILTER_CONDITIONS": 2, "AGW_GATEWAY_MAX_PAYLOAD_FIELDS": 2})


def _one_by_one(bounds: Bounds, request: pb.RetrieveRequest) -> None:
    """The rule, field by field in the order the fields are checked: the first field past its bound is refused."""
    search = request.request
    bounds.key("request.collection", search.collection)
    bounds.chars("request.text", search.text, "max_message_chars")
    bounds.count("request.vector.values", search.vector.values, "max_vector_dims", "values")
    bounds.search_filter("request.filter", search.filter)
    bounds.payload_fields("request.payload_fields", search.payload_fields)


def _refusal(check, bounds: Bounds, request: pb.RetrieveRequest) -> tuple[str, str] | None:
    try:
        check(bounds, request)
    except InvalidArgument as refusal:
        return refusal.field, refusal.message
    return None


_NAMES = st.text(alphabet="ab", max_size=6)
_CONDITIONS = st.lists(st.builds(retrieval_pb2.FieldCondition, key=_NAMES, keyword=_NAMES), max_size=3)
_SEARCHES = st.builds(
    retrieval_pb2.SearchRequest,
    collection=_NAMES, text=st.text(alphabet="t", max_size=8),
    vector=st.builds(retrieval_pb2.Vector, values=st.lists(st.just(0.5), max_size=4)),
    filter=st.builds(retrieval_pb2.Filter, must=_CONDITIONS, must_not=_CONDITIONS),
    payload_fields=st.lists(_NAMES, max_size=3))


@settings(max_examples=400, deadline=None)
@given(_SEARCHES)
def test_the_inline_checks_refuse_what_the_field_checks_refuse(search):
    bounds = Bounds(LIMITS)
    request = pb.RetrieveRequest(request=search)
    assert _refusal(Bounds.retrieve, bounds, request) == _refusal(_one_by_one, bounds, request)


@pytest.mark.parametrize(("search", "field", "setting"), [
    (retrieval_pb2.SearchRequest(collection="docs", payload_fields=["a", "names"]), "request.payload_fields[1]",
     "AGW_GATEWAY_MAX_KEY_CHARS"),
    (retrieval_pb2.SearchRequest(collection="docs", text="t" * 7, payload_fields=["a"] * 3), "request.text",
     "AGW_GATEWAY_MAX_MESSAGE_CHARS"),
    (retrieval_pb2.SearchRequest(collection="docs", filter=retrieval_pb2.Filter(
        must=[retrieval_pb2.FieldCondition(key="k")] * 3)), "request.filter", "AGW_GATEWAY_MAX_FILTER_CONDITIONS"),
    (retrieval_pb2.SearchRequest(collection="docs", filter=retrieval_pb2.Filter(
        must_not=[retrieval_pb2.FieldCondition(key="kkkkk")])), "request.filter.must_not[0].key",
     "AGW_GATEWAY_MAX_KEY_CHARS"),
])
def test_a_refusal_names_the_first_field_past_its_bound(search, field, setting):
    with pytest.raises(InvalidArgument) as refused:
        Bounds(LIMITS).retrieve(pb.RetrieveRequest(request=search))
    assert refused.value.field == field and setting in refused.value.message


def test_a_request_within_every_bound_passes_filter_and_names_included():
    Bounds(LIMITS).retrieve(pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(
        collection="docs", text="query", vector=retrieval_pb2.Vector(values=[0.1] * 3), payload_fields=["a", "bb"],
        filter=retrieval_pb2.Filter(must=[retrieval_pb2.FieldCondition(key="k", keyword="v")]))))
