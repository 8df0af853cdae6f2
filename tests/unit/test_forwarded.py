"""Reading the client certificate an edge forwards (x-forwarded-client-cert), and the edge's Envoy config."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote

import pytest

from agentgw.edge import PASSTHROUGH_ROUTES, edge_config
from servicekit.errors import Unauthenticated
from servicekit.forwarded import forwarded_certificate, parse_xfcc

pytestmark = pytest.mark.unit


def test_quoted_values_keep_their_separators():
    fields = parse_xfcc('By=spiffe://d/service/edge;Hash=ab;Subject="CN=a,O=b;c";URI=spiffe://d/tenant/x')
    assert fields == {"by": ["spiffe://d/service/edge"], "hash": ["ab"], "subject": ["CN=a,O=b;c"],
                      "uri": ["spiffe://d/tenant/x"]}


@pytest.mark.parametrize("value,reason", [
    ("URI=a,URI=b", "2 elements"),
    ('Cert="unterminated', "unterminated"),
    ("just-a-token", "is not key=value"),
    ("URI=" + "a" * 9000, "over 8192"),
])
def test_a_header_an_edge_would_not_set_is_refused(value, reason):
    with pytest.raises(ValueError, match=reason):
        parse_xfcc(value)


def test_the_forwarded_certificate_must_name_the_header_uri(pki):
    cert = quote(pki.identity("tenant/dev").cert.read_text(), safe="")
    certificate, spiffe = forwarded_certificate(f'Hash=1;Cert="{cert}";URI=spiffe://agentgw.local/tenant/dev')
    assert spiffe == "spiffe://agentgw.local/tenant/dev" and certificate.serial_number
    with pytest.raises(Unauthenticated, match="do not match the edge's URI"):
        forwarded_certificate(f'Cert="{cert}";URI=spiffe://agentgw.local/tenant/other')
    with pytest.raises(Unauthenticated, match="one Cert and one URI"):
        forwarded_certificate("URI=spiffe://agentgw.local/tenant/dev")
    with pytest.raises(Unauthenticated, match="not a PEM certificate"):
        forwarded_certificate('Cert="nonsense";URI=spiffe://agentgw.local/tenant/dev')


def test_the_edge_config_sanitises_the_header_and_pins_each_backends_identity(tmp_path):
    edge = edge_config(tmp_path, tmp_path / "run" / "envoy.json", listen="0.0.0.0:50051", gateway="gateway:50054",
                       inference=["10.0.0.1:50053", "10.0.0.2:50053"], retrieval="retrieval:50052")
    config = edge.bootstrap
    [listener] = config["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert manager["forward_client_cert_details"] == "SANITIZE_SET"
    assert manager["set_current_client_cert_details"] == {"uri": True, "cert": True}
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert {r["match"].get("path"): r["route"]["cluster"] for r in routes[:-1]} == PASSTHROUGH_ROUTES
    assert routes[-1]["route"]["cluster"] == "gateway"
    # The passthroughs' requests are bounded before a backend reads them; the gateway bounds its own.
    [buffer, _router] = manager["http_filters"]
    assert buffer["typed_config"]["max_request_bytes"] == 4 * 1024 * 1024 + 5
    assert routes[-1]["typed_per_filter_config"]["envoy.filters.http.buffer"]["disabled"] is True
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    inference = clusters["inference"]
    assert inference["type"] == "STATIC" and len(inference["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
    assert clusters["retrieval"]["type"] == "STRICT_DNS"
    tls = inference["transport_socket"]["typed_config"]["common_tls_context"]
    validation = tls["combined_validation_context"]
    assert validation["default_validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "URI", "matcher": {"exact": "spiffe://agentgw.local/service/inference"}}]
    # The certificate, key and CA come from secret files that Envoy re-reads when the identity folder changes.
    [certificate] = tls["tls_certificate_sds_secret_configs"]
    source = certificate["sds_config"]["path_config_source"]
    assert source["watched_directory"]["path"] == str(tmp_path / "service" / "edge")
    written = edge.write()
    assert written == tmp_path / "run" / "envoy.json" and json.loads(written.read_text()) == config
    [secret] = json.loads(Path(source["path"]).read_text())["resources"]
    assert secret["tls_certificate"]["certificate_chain"]["filename"] == str(tmp_path / "service/edge/cert.pem")
    trust_source = validation["validation_context_sds_secret_config"]["sds_config"]["path_config_source"]
    [trust] = json.loads(Path(trust_source["path"]).read_text())["resources"]
    assert trust["validation_context"]["trusted_ca"]["filename"] == str(tmp_path / "service/edge/ca.pem")
    with pytest.raises(ValueError, match="is not host:port"):
        edge_config(tmp_path, tmp_path / "envoy.json", listen="nowhere", gateway="g:1", inference=["i:2"],
                    retrieval="r:3")


def test_the_edges_admin_interface_listens_on_loopback_only(tmp_path):
    """It has no authentication and can stop Envoy: it is there for a drain before a stop (deploy/k8s's preStop)."""
    bootstrap = edge_config(tmp_path, tmp_path / "envoy.json", listen="0.0.0.0:50051", gateway="g:1", inference=["i:2"],
                            retrieval="r:3", admin="127.0.0.1:9901").bootstrap
    assert bootstrap["admin"] == {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9901}}}
    assert "admin" not in edge_config(tmp_path, tmp_path / "envoy.json", listen="0.0.0.0:50051", gateway="g:1",
                                      inference=["i:2"], retrieval="r:3").bootstrap
    for exposed in ("0.0.0.0:9901", "10.0.0.7:9901", "edge:9901"):
        with pytest.raises(ValueError, match="has no authentication; give it a loopback address"):
            edge_config(tmp_path, tmp_path / "envoy.json", listen="0.0.0.0:50051", gateway="g:1", inference=["i:2"],
                        retrieval="r:3", admin=exposed)


def test_the_edge_bounds_its_connections_and_slow_clients(tmp_path):
    bootstrap = edge_config(tmp_path, tmp_path / "envoy.json", listen="0.0.0.0:50051", gateway="g:1", inference=["i:2"],
                            retrieval="r:3", max_connections=100).bootstrap
    overload = bootstrap["overload_manager"]
    connections, heap = overload["resource_monitors"]
    assert connections["name"] == "envoy.resource_monitors.global_downstream_max_connections"
    assert connections["typed_config"]["max_active_downstream_connections"] == 100
    assert heap["typed_config"]["max_heap_size_bytes"] == 384 * 2**20  # three quarters of deploy/k8s's 512 MiB
    assert {a["name"]: a["triggers"][0]["threshold"]["value"] for a in overload["actions"]} == {
        "envoy.overload_actions.shrink_heap": 0.95, "envoy.overload_actions.stop_accepting_requests": 0.98}
    [listener] = bootstrap["static_resources"]["listeners"]
    assert listener["filter_chains"][0]["transport_socket_connect_timeout"] == "10s"  # the handshake
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert manager["request_headers_timeout"] == "10s"
    assert manager["http2_protocol_options"]["max_concurrent_streams"] == 100
    assert manager["stream_idle_timeout"] == "60s"  # the gateway's AGW_GATEWAY_STREAM_SEND_TIMEOUT_S
    with pytest.raises(ValueError, match="--max-connections must be at least 1"):
        edge_config(tmp_path, tmp_path / "envoy.json", listen="0.0.0.0:50051", gateway="g:1", inference=["i:2"],
                    retrieval="r:3", max_connections=0)
    with pytest.raises(ValueError, match="--max-heap-mib must be at least 1 \\(got 0\\)"):
        edge_config(tmp_path, tmp_path / "envoy.json", listen="0.0.0.0:50051", gateway="g:1", inference=["i:2"],
                    retrieval="r:3", max_heap_mib=0)
    with pytest.raises(ValueError, match="--stream-idle-s must be above 0 \\(got 0\\): every stream needs a bound"):
        edge_config(tmp_path, tmp_path / "envoy.json", listen="0.0.0.0:50051", gateway="g:1", inference=["i:2"],
                    retrieval="r:3", stream_idle_s=0)


def test_the_edge_sends_calls_to_healthy_backends_only(tmp_path):
    clusters = {c["name"]: c for c in edge_config(
        tmp_path, tmp_path / "envoy.json", listen="0.0.0.0:50051", gateway="g:1", inference=["i:2", "j:2"],
        retrieval="r:3", max_connections=10).bootstrap["static_resources"]["clusters"]}
    for cluster in clusters.values():
        [check] = cluster["health_checks"]
        assert "grpc_health_check" in check and check["interval"] == "2s"  # grpc.health.v1, over the cluster's mTLS
        assert cluster["common_lb_config"]["healthy_panic_threshold"]["value"] == 0  # none healthy: UNAVAILABLE
        assert cluster["outlier_detection"]["consecutive_local_origin_failure"] == 2
        [limits] = cluster["circuit_breakers"]["thresholds"]
        assert limits["max_requests"] == 10 * 100  # what the listener can carry: connections times streams
        assert limits["retry_budget"]["budget_percent"]["value"] == 100
    no_checks = edge_config(tmp_path, tmp_path / "envoy.json", listen="0.0.0.0:50051", gateway="g:1",
                            inference=["i:2"], retrieval="r:3", health_check_s=0).bootstrap
    assert all("health_checks" not in c and "outlier_detection" in c for c in no_checks["static_resources"]["clusters"])


def test_the_edges_metrics_need_its_admin_interface(tmp_path):
    with pytest.raises(ValueError, match="--metrics needs --admin"):
        edge_config(tmp_path, tmp_path / "envoy.json", listen="0.0.0.0:50051", gateway="g:1", inference=["i:2"],
                    retrieval="r:3", metrics="0.0.0.0:9467")


def _inference_routing(tmp_path, **options) -> tuple[dict, list[dict]]:
    """An edge's inference clusters by name, and its Generate routes in order."""
    bootstrap = edge_config(tmp_path, tmp_path / "envoy.json", listen="0.0.0.0:50051", gateway="g:1",
                            inference=["i:2", "j:2"], retrieval="r:3", **options).bootstrap["static_resources"]
    clusters = {c["name"]: c for c in bootstrap["clusters"] if c["name"].startswith("inference")}
    manager = bootstrap["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = [r for r in manager["route_config"]["virtual_hosts"][0]["routes"]
              if r["match"].get("path", "").endswith("/Generate")]
    return clusters, routes


def test_a_generate_with_a_key_is_cache_affine_at_the_edge_and_one_without_goes_by_load(tmp_path):
    clusters, [keyed, unkeyed] = _inference_routing(tmp_path)
    assert keyed["match"]["headers"] == [{"name": "x-agw-affinity", "present_match": True}]  # first: it must match
    assert keyed["route"]["cluster"] == "inference_affine" and unkeyed["route"]["cluster"] == "inference"
    assert [p["header"]["header_name"] for p in keyed["route"]["hash_policy"]] == [
        "x-forwarded-client-cert", "x-agw-affinity"]
    assert keyed["route"]["retry_policy"] == unkeyed["route"]["retry_policy"]  # a retry goes to another replica
    affine, plain = clusters["inference_affine"], clusters["inference"]
    assert affine["lb_policy"] == "MAGLEV" and plain["lb_policy"] == "LEAST_REQUEST"
    assert affine["common_lb_config"] == {"healthy_panic_threshold": {"value": 0.0},  # the health settings stay
                                          "consistent_hashing_lb_config": {"hash_balance_factor": 150}}
    assert affine["load_assignment"]["endpoints"] == plain["load_assignment"]["endpoints"]  # the same replicas
    assert affine["transport_socket"] == plain["transport_socket"]  # each must present service/inference
    clusters, [only] = _inference_routing(tmp_path, inference_routing="least_request")
    assert set(clusters) == {"inference"} and "headers" not in only["match"]
    clusters, _ = _inference_routing(tmp_path, affinity_balance=300)
    assert clusters["inference_affine"]["common_lb_config"]["consistent_hashing_lb_config"]["hash_balance_factor"] == 300
    with pytest.raises(ValueError, match="--inference-routing must be one of affinity, least_request"):
        _inference_routing(tmp_path, inference_routing="round_robin")
    with pytest.raises(ValueError, match="--affinity-balance is a percent of the average load, at least 100"):
        _inference_routing(tmp_path, affinity_balance=90)
