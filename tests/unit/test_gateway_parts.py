"""Tenancy names, admission, deadlines and backend errors: the gateway's parts that need no server."""

from __future__ import annotations

from contextlib import ExitStack

import grpc
import pytest

from agent.inference.v1 import inference_pb2
from servicekit.admission import Admission
from gateway.backends import Deadlines, StartedStream
from servicekit.tenancy import cache_salt_for, physical_collection, tenant_cache_salt, tenant_collection
from servicekit.channels import ChannelSpec
from servicekit.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, ServiceError
from servicekit.pool import ChannelPool
from tests.support.ended_call import EndedCall

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("tenant", "collection"), [("dev", "docs"), ("a_b", "c"), ("a", "b_c"), ("x.y-z", "t3-dev-docs")])
def test_physical_names_round_trip_and_never_collide(tenant, collection):
    name = physical_collection(tenant, collection)
    assert tenant_collection(name) == collection
    assert name.startswith(f"t{len(tenant)}-{tenant}-")


def test_tenant_prefixes_are_injective():
    pairs = [("a_b", "c"), ("a", "b_c"), ("a", "b-c"), ("a-b", "c")]
    assert len({physical_collection(t, c) for t, c in pairs}) == len(pairs)


def test_cache_salts_are_per_tenant_and_never_collide():
    salts = [tenant_cache_salt("a", "b/c"), tenant_cache_salt("a/b", "c"), tenant_cache_salt("a"),
             tenant_cache_salt("other"), tenant_cache_salt("other", "t1-a")]
    assert len(set(salts)) == len(salts)
    assert tenant_cache_salt("dev", "x").startswith("t3-dev/")
    with pytest.raises(InvalidArgument, match="request.cache_salt"):
        tenant_cache_salt("dev", "x" * 129)


def test_the_prefix_cache_setting_picks_the_salt():
    assert cache_salt_for("tenant", "dev") == "t3-dev"
    assert cache_salt_for("tenant", "dev", "x") == "t3-dev/x"
    assert cache_salt_for("shared", "dev") == ""
    assert cache_salt_for("shared", "dev", "x") == "x"


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "x" * 65, "-x"])
def test_bad_collection_names(bad):
    with pytest.raises(InvalidArgument):
        physical_collection("dev", bad)


def test_admission_bounds_in_flight_and_counts():
    admission = Admission(max_in_flight=2, retry_after_s=0.1)
    with admission.admit(), admission.admit():
        with pytest.raises(ResourceExhausted) as caught:
            with admission.admit():
                pass
        assert caught.value.retry_after_s == 0.1
        assert admission.in_flight == 2
    assert (admission.in_flight, admission.admitted, admission.rejected) == (0, 2, 1)


class _Context:
    def __init__(self, remaining):
        self.remaining = remaining

    def time_remaining(self):
        return self.remaining


def test_deadlines_take_the_callers_remaining_time_less_a_margin():
    deadlines = Deadlines(default_s=30, margin_ms=20)
    assert deadlines.for_call(_Context(None)) == 30
    assert deadlines.for_call(_Context(0.3)) == pytest.approx(0.28)
    with pytest.raises(DeadlineExceeded):
        deadlines.for_call(_Context(0.01))


def test_a_tenant_past_its_share_is_refused_while_others_are_admitted():
    admission = Admission(max_in_flight=10, retry_after_s=0.1, per_tenant=2, weights={"acme": 2.0, "tiny": 0.1})
    assert (admission.tenant_bound("beta"), admission.tenant_bound("acme"), admission.tenant_bound("tiny")) == (2, 4, 1)
    with admission.admit("beta"), admission.admit("beta"):
        with pytest.raises(ResourceExhausted) as caught:
            with admission.admit("beta"):
                pass
        assert "tenant beta has 2 calls in flight" in caught.value.message
        assert "AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT=2 x weight 1" in caught.value.message
        assert caught.value.retry_after_s == 0.1
        with admission.admit("acme"), admission.admit("acme"), admission.admit("acme"):  # weight 2: four slots
            assert admission.tenants == {"beta": 2, "acme": 3}
    assert admission.tenants == {} and admission.in_flight == 0
    assert (admission.admitted, admission.rejected) == (5, 1)


def test_a_slot_taken_without_a_block_is_freed_once_and_recorded_on_the_span():
    """acquire/release: for a stream handed to gRPC as it is (a backend's public Generate frees it when the call
    ends); a second release must not free another call's slot."""
    from opentelemetry.sdk.trace import TracerProvider

    admission = Admission(max_in_flight=4, per_tenant=1, holder="this retrieval service process")
    span = TracerProvider().get_tracer("test").start_span("call")
    release = admission.acquire("acme", span)
    assert dict(span.attributes) == {"agw.admission.in_flight": 0, "agw.admission.max_in_flight": 4,
                                     "agw.admission.tenant_in_flight": 0, "agw.admission.tenant_bound": 1}
    with pytest.raises(ResourceExhausted) as caught:
        admission.acquire("acme", span)
    assert "its share of this retrieval service process" in caught.value.message
    assert [(event.name, dict(event.attributes)) for event in span.events] == [
        ("agw.admission.refused", {"agw.admission.reason": caught.value.message})]
    with admission.admit("beta"):
        release()
        release()
        assert (admission.in_flight, admission.tenants) == (1, {"beta": 1})
    assert (admission.in_flight, admission.tenants) == (0, {})
    admission.acquire("acme")()  # free again


def test_a_span_that_records_nothing_does_not_stop_admission_deciding():
    """Without a collector the services record no span (servicekit.telemetry): admission still counts, refuses
    and frees on such a span, and only skips building attributes no one will read."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    span = TracerProvider(sampler=ALWAYS_OFF).get_tracer("test").start_span("call")
    assert not span.is_recording()
    admission = Admission(max_in_flight=1, holder="this retrieval service process")
    release = admission.acquire("acme", span)
    with pytest.raises(ResourceExhausted, match="at capacity: 1 calls in flight"):
        admission.acquire("beta", span)
    release()
    admission.acquire("beta", span)()
    assert (admission.admitted, admission.rejected, admission.in_flight) == (2, 1, 0)


def test_tenant_weights_are_parsed_and_checked():
    from gateway.settings import GatewaySettings
    from servicekit.settings import SettingsError, load_settings

    settings = load_settings(GatewaySettings, tenant_weights="acme=4, beta=0.5", max_in_flight=10)
    assert settings.tenant_weight_map == {"acme": 4.0, "beta": 0.5}
    assert settings.max_in_flight_per_tenant == 5  # half the process's bound unless set
    for bad in ("acme", "acme=0", "=2", "acme=four"):
        with pytest.raises(SettingsError, match="AGW_GATEWAY_TENANT_WEIGHTS"):
            load_settings(GatewaySettings, tenant_weights=bad)


@pytest.mark.parametrize("url,refused", [
    ("postgresql://agentgw:change-me@postgres:5432/agentgw", True),
    ("postgresql://agentgw:@db.example:5432/agentgw", True),
    ("postgresql://agentgw:s3cr3t-from-vault@postgres:5432/agentgw", False),
    ("postgresql://postgres@127.0.0.1:5432/test", False),
    ("postgresql://postgres:@/postgres?host=/tmp/pg", False),  # the embedded server's socket, trust auth
])
def test_placeholder_database_passwords_are_refused_at_start(url, refused):
    from gateway.settings import GatewaySettings
    from servicekit.settings import SettingsError, load_settings

    if refused:
        with pytest.raises(SettingsError, match="empty or placeholder password"):
            load_settings(GatewaySettings, database_url=url)
    else:
        assert load_settings(GatewaySettings, database_url=url).database_url == url


def test_a_password_file_must_hold_a_real_secret(tmp_path):
    from gateway.settings import GatewaySettings
    from servicekit.settings import SettingsError, load_settings

    secret = tmp_path / "postgres_password"
    for placeholder in ("", "change-me\n"):
        secret.write_text(placeholder)
        with pytest.raises(SettingsError, match="AGW_DATABASE_PASSWORD_FILE: .* holds an empty or placeholder secret"):
            load_settings(GatewaySettings, database_password_file=secret)
    secret.write_text("a1b2c3d4e5f6\n")
    assert load_settings(GatewaySettings, database_password_file=secret).database_password() == "a1b2c3d4e5f6"


@pytest.mark.parametrize(("placeholder_reads", "expected"), [
    # The backend's status replaced the placeholder: it keeps its code.
    (2, grpc.StatusCode.PERMISSION_DENIED),
    # grpc.aio overwrote the backend's status with the placeholder: nothing was generated, so it is
    # UNAVAILABLE, which Backends.reroute retries on another replica, not INTERNAL, which fails the turn.
    (None, grpc.StatusCode.UNAVAILABLE),
])
async def test_a_stream_ended_as_its_request_was_written_reports_the_backends_status_or_unavailable(
        placeholder_reads, expected):
    pool = ChannelPool("inference", ChannelSpec(target="127.0.0.1:9", tls=None), 1)
    call = EndedCall(grpc.StatusCode.PERMISSION_DENIED, "service/gateway may not call it", placeholder_reads)
    try:
        stream = StartedStream(call, ExitStack(), pool, pool.channels[0])
        with pytest.raises(ServiceError) as refused:
            await stream.send(inference_pb2.GenerateRequest())
        assert refused.value.code == expected
        if expected == grpc.StatusCode.UNAVAILABLE:
            assert "inference service ended the call as its request was sent; retry shortly" in refused.value.message
    finally:
        await pool.channels[0].channel.close()


def test_a_policy_decides_each_identity_and_method_once_and_keeps_them_apart():
    from servicekit.authz import Policy
    from servicekit.identity import Identity

    retrieve = "/agent.gateway.v1.AgentGateway/Retrieve"
    policy = Policy(["service/*"], {retrieve: ["tenant/*"]})
    tenant, gateway = Identity.tenant("dev"), Identity.service("gateway")
    for _ in range(3):  # the second and third answers come from the cache, and must be the first's
        assert policy.allows(tenant, retrieve) and not policy.allows(tenant, "/agent.retrieval.v1.Retrieval/Search")
        assert policy.allows(gateway, "/agent.retrieval.v1.Retrieval/Search") and not policy.allows(gateway, retrieve)
    for index in range(5000):  # bounded: a flood of new identities does not grow it without end
        policy.allows(Identity.tenant(f"t{index}"), retrieve)
    assert len(policy._decided) <= 4096
    assert policy.allows(tenant, retrieve) and not policy.allows(gateway, retrieve)


def test_scoping_takes_the_requests_own_search_over_and_clamps_it():
    from agent.gateway.v1 import gateway_pb2
    from agent.retrieval.v1 import retrieval_pb2
    from servicekit.public_api import PublicApiSettings
    from servicekit.tenancy import scoped_search

    request = gateway_pb2.RetrieveRequest(request=retrieval_pb2.SearchRequest(
        collection="docs", vector=retrieval_pb2.Vector(values=[0.5] * 4), top_k=3, exact=True, hnsw_ef=10_000))
    search = scoped_search(PublicApiSettings(), "dev", request)
    assert search is request.request  # no copy of the query vector
    assert (search.collection, search.exact, search.hnsw_ef) == ("t3-dev-docs", False, 512)
    assert list(search.vector.values) == [0.5] * 4 and search.top_k == 3
