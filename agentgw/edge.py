"""The edge: Envoy on the public port, forwarding the passthrough methods' frames straight to the backends.

``agentgw edge-config`` writes Envoy's bootstrap (JSON) for the design in
docs/architecture.md, "The edge":

- Envoy terminates the client's mTLS. A certificate must chain to our CA and
  carry a SPIFFE ID of our trust domain, or the handshake fails.
- ``Generate`` goes to the inference service and ``Retrieve`` to the
  retrieval service, as frames, with no Python hop. Every other method goes
  to the Python gateway. Upstream, every hop is mTLS with the edge's own
  identity (``service/edge``), and each backend's certificate must name its
  service.
- Envoy drops any ``x-forwarded-client-cert`` a client sent, and sets its
  own: the verified certificate and its SPIFFE ID. A service believes it only
  from the edge's identity (``AGW_<SERVICE>_EDGE_CLIENTS=service/edge``), so
  each service authorizes and scopes to the tenant itself (``servicekit.authz``).
  A tenant's trace headers are dropped on the passthrough routes; the
  gateway applies its own ``AGW_GATEWAY_CLIENT_TRACE`` to the rest.
- A passthrough request over the public port's bound (``--max-request-bytes``,
  the gateway's ``AGW_GATEWAY_MAX_RECEIVE_BYTES``) is refused by Envoy,
  ``RESOURCE_EXHAUSTED``, before a backend decodes it. The connection limits
  are the gateway's public-port defaults; Envoy also holds the client
  connections to ``--max-connections`` and gives each 10 s to finish its
  handshake and to send a request's headers.

- ``Generate`` is cache-affine where the client names its cache
  (``--inference-routing affinity``, the default): Envoy cannot read the
  prompt, which the gateway hashes, so a call carrying an ``x-agw-affinity``
  header (a session or conversation id) is hashed on that key and the
  tenant's verified certificate, by Maglev with bounded load: a key stays on
  its replica until that replica holds ``--affinity-balance`` percent of the
  replicas' average calls in flight, then spills to the key's next replica.
  A call without the header goes by load (least requests), as with
  ``least_request`` for all.
- Admission: the backends admit the calls the edge sends them, per tenant,
  with the gateway's settings (``servicekit.public_methods``). Like the
  gateway, the edge retries a ``Generate`` that failed before its first
  message, once, on another replica.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.gateway.v1 import gateway_pb2
from servicekit.identity import DEFAULT_TRUST_DOMAIN, Identity, IdentityFiles
from servicekit.public_api import AFFINITY_HEADER

EDGE = Identity.service("edge")
_PUBLIC = gateway_pb2.DESCRIPTOR.services_by_name["AgentGateway"].full_name
#: The public methods the edge sends straight to a backend, and which backend.
PASSTHROUGH_ROUTES = {f"/{_PUBLIC}/Generate": "inference", f"/{_PUBLIC}/Retrieve": "retrieval"}
#: A tenant's trace context does not reach a backend unfiltered (the gateway links it instead).
_CLIENT_TRACE_HEADERS = ["traceparent", "tracestate", "baggage"]
_TYPES = "type.googleapis.com/envoy.extensions"
_BUFFER = "envoy.filters.http.buffer"
#: The gateway's own default bound on a public request (AGW_GATEWAY_MAX_RECEIVE_BYTES).
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
#: Client connections the edge holds at once; past it Envoy closes new ones as they arrive. An idle mTLS
#: connection costs Envoy tens of KB, so the default fits the Kubernetes component's 512 MiB limit.
DEFAULT_MAX_CONNECTIONS = 4096
#: A client has this long to finish its TLS handshake, and then to send a request's headers, or is closed.
HANDSHAKE_TIMEOUT_S = 10
#: Streams one client connection may hold (the gateway's AGW_GATEWAY_MAX_CONCURRENT_STREAMS default).
MAX_STREAMS_PER_CONNECTION = 100
#: What Envoy holds for one stream and one connection whose reader has stopped (Envoy's edge best practices; its
#: defaults, 256 MiB windows and 1 MiB buffers, are a service mesh's). A Chat client that stopped reading left
#: 37 MiB in the edge with the defaults (docs/benchmarks.md, "A stalled client's stream, pinned").
STREAM_WINDOW_BYTES = 64 * 1024
CONNECTION_WINDOW_BYTES = 1024 * 1024
CONNECTION_BUFFER_BYTES = 32 * 1024
#: A backend's stream window at the edge: the gateway's own for its backends (AGW_GATEWAY_BACKEND_STREAM_WINDOW_BYTES).
UPSTREAM_STREAM_WINDOW_BYTES = 256 * 1024
#: How often the edge checks each backend host's gRPC health, seconds.
DEFAULT_HEALTH_CHECK_S = 2.0
#: Envoy's heap bound, MiB: three quarters of the Kubernetes component's 512 MiB limit, leaving room for what is
#: not heap (code, stacks, what the allocator holds free). Near it the edge refuses new calls rather than be killed
#: with every stream it holds (Envoy's edge best practices: the overload manager's heap actions). Envoy's own heap,
#: idle, is about 7 MiB.
DEFAULT_MAX_HEAP_MIB = 384
#: A stream on which no frame has moved either way for this long is reset, and its backend call with it: a client
#: that stopped reading frees its generation (the gateway's AGW_GATEWAY_STREAM_SEND_TIMEOUT_S for its own streams;
#: Envoy's default, 5 minutes, held a stalled Generate's engine slot that long).
DEFAULT_STREAM_IDLE_S = 60.0
#: How the edge spreads Generate over inference replicas.
INFERENCE_ROUTING = ("affinity", "least_request")
#: A replica takes up to this percent of the replicas' average calls in flight before its keys spill (Envoy's
#: hash_balance_factor). 150 keeps a key in place through a burst and still spreads one heavy tenant.
DEFAULT_AFFINITY_BALANCE = 150


def _host_port(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{target!r} is not host:port")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


#: The edge's two secrets, each in its own file beside the bootstrap (file-based SDS).
CERTIFICATE_SECRET = "edge-certificate"
TRUST_SECRET = "edge-trust"


def _secret_file(bootstrap: Path, name: str) -> Path:
    return bootstrap.with_name(f"{name}.sds.json")


def _secrets(files: IdentityFiles, bootstrap: Path) -> dict[Path, dict]:
    """The SDS documents: the edge's certificate and key, and the CA it trusts. Envoy re-reads them when a file of
    the identity folder is moved into place (agentgw certs --renew, cert-manager's Secret volume swapping ..data),
    so a renewed certificate or CA takes effect on the next handshake, as in our services, without a restart."""
    watched = {"watched_directory": {"path": str(files.cert.parent)}}
    secret = f"{_TYPES}.transport_sockets.tls.v3.Secret"
    return {
        _secret_file(bootstrap, CERTIFICATE_SECRET): {"resources": [{
            "@type": secret, "name": CERTIFICATE_SECRET,
            "tls_certificate": {"certificate_chain": {"filename": str(files.cert)},
                                "private_key": {"filename": str(files.key)}, **watched}}]},
        _secret_file(bootstrap, TRUST_SECRET): {"resources": [{
            "@type": secret, "name": TRUST_SECRET,
            "validation_context": {"trusted_ca": {"filename": str(files.ca)}, **watched}}]},
    }


def _sds(name: str, files: IdentityFiles, bootstrap: Path) -> dict:
    return {"name": name, "sds_config": {"resource_api_version": "V3", "path_config_source": {
        "path": str(_secret_file(bootstrap, name)), "watched_directory": {"path": str(files.cert.parent)}}}}


def _tls_context(files: IdentityFiles, bootstrap: Path, **validation) -> dict:
    return {
        "alpn_protocols": ["h2"],
        "tls_certificate_sds_secret_configs": [_sds(CERTIFICATE_SECRET, files, bootstrap)],
        "combined_validation_context": {"default_validation_context": validation,
                                        "validation_context_sds_secret_config": _sds(TRUST_SECRET, files, bootstrap)},
    }


def _spiffe_match(kind: str, value: str) -> dict:
    return {"match_typed_subject_alt_names": [{"san_type": "URI", "matcher": {kind: value}}]}


def _health(health_check_s: float, max_requests: int) -> dict:
    """Which of a cluster's hosts get calls, and how many.

    - Active gRPC health checks (grpc.health.v1, over the cluster's mTLS, every ``health_check_s``; 0: none): a
      host NOT_SERVING (warming up, draining) or not answering gets no calls, as the gateway routes only to a
      SERVING replica; with none healthy the call fails UNAVAILABLE rather than going to them anyway (no panic
      routing).
    - Outlier detection: two failures of the edge's own making in a row (connection refused, reset, timeout)
      eject a host for 10 s. Without it a dead host, with no requests in flight, is what least-requests picks
      first, retries included.
    - Circuit breakers no lower than what the listener can carry (connections times streams), so the backends'
      own bounds refuse with their RESOURCE_EXHAUSTED and not Envoy's opaque overflow; a retry budget of every
      request, so each call that needs its one retry gets it (Envoy's default allows 3 retries in flight).
    """
    config = {
        "outlier_detection": {"split_external_local_origin_errors": True, "consecutive_local_origin_failure": 2,
                              "enforcing_consecutive_local_origin_failure": 100, "interval": "1s",
                              "base_ejection_time": "10s", "max_ejection_percent": 50},
        "circuit_breakers": {"thresholds": [{
            "max_requests": max_requests, "max_pending_requests": max_requests,
            "retry_budget": {"budget_percent": {"value": 100.0}, "min_retry_concurrency": 16}}]},
    }
    if health_check_s > 0:
        interval = f"{health_check_s:g}s"
        config["health_checks"] = [{"timeout": "1s", "interval": interval, "no_traffic_interval": interval,
                                    "unhealthy_threshold": 2, "healthy_threshold": 1, "grpc_health_check": {}}]
        config["common_lb_config"] = {"healthy_panic_threshold": {"value": 0.0}}
    return config


def _affine_balance(routing: str, affinity_balance: int) -> dict | None:
    """The keyed inference cluster's load balancing for ``affinity``: Maglev with bounded load; None without it."""
    if routing not in INFERENCE_ROUTING:
        raise ValueError(f"--inference-routing must be one of {', '.join(INFERENCE_ROUTING)} (got {routing!r})")
    if routing == "least_request":
        return None
    if affinity_balance < 100:
        raise ValueError(f"--affinity-balance is a percent of the average load, at least 100 (got {affinity_balance})")
    return {"lb_policy": "MAGLEV",
            "common_lb_config": {"consistent_hashing_lb_config": {"hash_balance_factor": affinity_balance}}}


def _cluster(name: str, targets: Sequence[str], files: IdentityFiles, bootstrap: Path, trust_domain: str,
             keepalive_s: float, health: dict, balance: dict | None = None, service: str | None = None) -> dict:
    """A backend over mTLS with the edge's identity; its certificate must be ``service/<service>``'s (default
    ``name``).

    ``balance``: how its hosts share calls (default least requests); merged with ``health``'s settings.
    """
    balance = balance or {"lb_policy": "LEAST_REQUEST"}
    common = {**health.get("common_lb_config", {}), **balance.get("common_lb_config", {})}
    endpoints = [_host_port(target) for target in targets]
    tls = {"common_tls_context": _tls_context(
        files, bootstrap, **_spiffe_match("exact", Identity.service(service or name).spiffe_id(trust_domain)))}
    if not _is_ip(endpoints[0][0]):
        tls["sni"] = endpoints[0][0]
    return {
        "name": name, "connect_timeout": "5s", "lb_policy": balance["lb_policy"],
        "type": "STATIC" if all(_is_ip(host) for host, _ in endpoints) else "STRICT_DNS",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": f"{_TYPES}.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {
                "connection_keepalive": {"interval": f"{keepalive_s:g}s",
                                         "timeout": f"{min(10.0, keepalive_s / 2):g}s"},
                "initial_stream_window_size": UPSTREAM_STREAM_WINDOW_BYTES,
                "initial_connection_window_size": CONNECTION_WINDOW_BYTES}}}},
        "per_connection_buffer_limit_bytes": CONNECTION_BUFFER_BYTES,
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
            for host, port in endpoints]}]},
        "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": f"{_TYPES}.transport_sockets.tls.v3.UpstreamTlsContext", **tls}},
        **health,
        **({"common_lb_config": common} if common else {}),
    }


#: As the gateway retries an inference call (gateway.backends.reroute): once, on another replica, when it failed
#: before its first message for a reason that means nothing was generated there: the replica refused the
#: connection or the stream, reset it, or answered UNAVAILABLE (not ready, draining). Envoy retries only until
#: response headers have gone to the client, which a gRPC server sends with its first message; the request is
#: whole in the buffer filter, so it can be sent again.
#:
#: "Another replica" is Envoy's previous-hosts predicate: a pick of a host already tried is thrown back and the
#: balancer picks again, up to ``host_selection_retry_max_attempts`` times, then the last pick stands. Least-requests
#: picks the lesser loaded of two random hosts, so of two replicas a dead one (nothing in flight) comes back on half
#: the picks while the other is idle and on 3 in 4 while it is busy. Five attempts left a retry on the dead host
#: one time in 32 to one in 4 (a CI run failed so, one call at a time, before outlier detection had ejected it);
#: 48 leave it under one in a million. A pick costs nanoseconds.
_RETRY_BEFORE_FIRST_MESSAGE = {
    "retry_on": "connect-failure,refused-stream,reset,unavailable",
    "num_retries": 1,
    "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
        "@type": f"{_TYPES}.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
    "host_selection_retry_max_attempts": 48,
    "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
}


#: The cluster of the inference replicas for Generate calls that carry a key (``affinity``): the same hosts.
AFFINE_INFERENCE = "inference_affine"
#: What a keyed Generate hashes: the client's key, and the certificate the edge verified (in the header it sets, one
#: per tenant client), so that two tenants' equal keys are two keys.
_AFFINITY_HASH = [{"header": {"header_name": "x-forwarded-client-cert"}}, {"header": {"header_name": AFFINITY_HEADER}}]


def _routes(inference_routing: str = "affinity") -> list[dict]:
    # timeout 0: streams live as long as they need; the client's grpc-timeout bounds each call.
    stream = {"timeout": "0s", "max_stream_duration": {"grpc_timeout_header_max": "0s"}}
    retry = {"retry_policy": _RETRY_BEFORE_FIRST_MESSAGE}
    routes = [{"match": {"path": path},
               "route": {"cluster": cluster, **stream, **(retry if cluster == "inference" else {})},
               "request_headers_to_remove": _CLIENT_TRACE_HEADERS}
              for path, cluster in PASSTHROUGH_ROUTES.items()]
    if inference_routing == "affinity":  # a Generate with a key: hashed; without one, by load (the route below)
        [generate] = [path for path, cluster in PASSTHROUGH_ROUTES.items() if cluster == "inference"]
        keyed = {"match": {"path": generate, "headers": [{"name": AFFINITY_HEADER, "present_match": True}]},
                 "route": {"cluster": AFFINE_INFERENCE, **stream, **retry, "hash_policy": _AFFINITY_HASH},
                 "request_headers_to_remove": _CLIENT_TRACE_HEADERS}
        routes.insert(0, keyed)
    # The gateway bounds its own requests before decoding them (AGW_GATEWAY_MAX_RECEIVE_BYTES): no buffering here.
    unbuffered = {_BUFFER: {"@type": f"{_TYPES}.filters.http.buffer.v3.BufferPerRoute", "disabled": True}}
    return [*routes, {"match": {"prefix": "/"}, "route": {"cluster": "gateway", **stream},
                      "typed_per_filter_config": unbuffered}]


def _grpc_refusal(code: int, message: str, **match: dict) -> dict:
    """A local reply mapper: an Envoy refusal matching ``match`` answers gRPC status ``code`` with ``message``
    (Envoy's own mapping of its HTTP codes says UNKNOWN for most)."""
    return {"filter": match,
            "headers_to_add": [{"header": {"key": "grpc-status", "value": str(code)},
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
            "body": {"inline_string": message}}


def _stream_idle_refusal(stream_idle_s: float) -> dict:
    """DEADLINE_EXCEEDED for a stream reset for its silence before its response began (a backend that sent
    nothing for ``stream_idle_s``); once the response began, the stream is reset, the only way left to end it."""
    return _grpc_refusal(4, f"nothing moved on this stream for {stream_idle_s:g} s, the public port's bound "
                            "(agentgw edge-config --stream-idle-s)",
                         response_flag_filter={"flags": ["SI"]})


#: Envoy's other refusals, each with its response flag (no healthy upstream, a failed connection, a circuit
#: breaker): answered as Envoy words them (UNAVAILABLE, its reason). A mapper that matches and sets nothing
#: ends the search for one.
_ENVOYS_OWN_REFUSALS = {"filter": {"response_flag_filter": {}}}
#: What is left of the 503s is the overload manager's refusal ("envoy overloaded", which sets no flag): UNAVAILABLE,
#: which clients retry, naming the bound.
_OVERLOAD_REFUSAL = _grpc_refusal(14, "the edge is near its memory bound (agentgw edge-config --max-heap-mib) and "
                                      "takes no new calls; retry with backoff, or on another edge",
                                  status_code_filter={"comparison": {"op": "EQ", "value": {
                                      "default_value": 503, "runtime_key": "agw.edge.overloaded"}}})


def _request_bound(max_request_bytes: int) -> tuple[dict, dict]:
    """The public port's bound on a request, for the methods the edge sends to a backend: the buffer filter and
    its refusal, RESOURCE_EXHAUSTED naming the bound (what gRPC answers on the gateway's own port).

    Every public method takes one request message, so holding it whole costs no latency: the client sends it
    with the end of its stream. The backends' own limit (AGW_MAX_MESSAGE_BYTES) is their internal hops'.
    """
    bound = max_request_bytes + 5  # the gRPC frame's header: compressed flag and length
    buffer = {"name": _BUFFER, "typed_config": {"@type": f"{_TYPES}.filters.http.buffer.v3.Buffer",
                                                "max_request_bytes": bound}}
    # RESOURCE_EXHAUSTED (8), as gRPC's own limit answers.
    refusal = _grpc_refusal(8, f"request: is over {max_request_bytes} bytes, the public port's bound (agentgw "
                               "edge-config --max-request-bytes; AGW_GATEWAY_MAX_RECEIVE_BYTES on the gateway)",
                            status_code_filter={"comparison": {"op": "EQ", "value": {
                                "default_value": 413, "runtime_key": "agw.edge.too_large"}}})
    return buffer, refusal


def _connection_manager(max_request_bytes: int, inference_routing: str, stream_idle_s: float) -> dict:
    buffer, too_large = _request_bound(max_request_bytes)
    if not stream_idle_s > 0:
        raise ValueError(f"--stream-idle-s must be above 0 (got {stream_idle_s:g}): every stream needs a bound")
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": f"{_TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "edge", "codec_type": "HTTP2",
        # The client's header is dropped and the verified certificate's set: the only way one reaches a service.
        "forward_client_cert_details": "SANITIZE_SET",
        "set_current_client_cert_details": {"uri": True, "cert": True},
        # The gateway's public-port bounds (AGW_GATEWAY_MAX_CONCURRENT_STREAMS, _IDLE_S, _AGE_S, metadata).
        "http2_protocol_options": {"max_concurrent_streams": MAX_STREAMS_PER_CONNECTION,
                                   "initial_stream_window_size": STREAM_WINDOW_BYTES,
                                   "initial_connection_window_size": CONNECTION_WINDOW_BYTES},
        "common_http_protocol_options": {"idle_timeout": "300s", "max_connection_duration": "1800s"},
        # A client that opens a stream and sends no headers holds nothing for long (slowloris).
        "request_headers_timeout": f"{HANDSHAKE_TIMEOUT_S}s",
        # A stream nobody moves is reset, both ways: its backend call ends, and with it a stalled client's generation.
        "stream_idle_timeout": f"{stream_idle_s:g}s",
        "max_request_headers_kb": 16,
        # Nothing of Envoy's own on the wire: no UUID generated per call for an x-request-id that no part of the
        # deployment reads (a fresh value every call, which each backend parsed), and no `server: envoy`.
        "generate_request_id": False,
        "server_header_transformation": "PASS_THROUGH",
        "route_config": {"virtual_hosts": [{"name": "public", "domains": ["*"], "routes": _routes(inference_routing)}]},
        "local_reply_config": {"mappers": [too_large, _stream_idle_refusal(stream_idle_s), _ENVOYS_OWN_REFUSALS,
                                            _OVERLOAD_REFUSAL]},
        # suppress_envoy_headers: no x-envoy-upstream-service-time (a backend's own time) in a client's answer.
        "http_filters": [buffer, {"name": "envoy.filters.http.router", "typed_config": {
            "@type": f"{_TYPES}.filters.http.router.v3.Router", "suppress_envoy_headers": True}}],
    }}


@dataclass(frozen=True)
class EdgeConfig:
    """Envoy's bootstrap, to be written at ``bootstrap_path``, and the secret files beside it that it watches."""

    bootstrap_path: Path
    bootstrap: dict
    secrets: dict[Path, dict]

    def write(self) -> Path:
        """Every file, each replaced whole (Envoy may be watching them); the bootstrap's path."""
        self.bootstrap_path.parent.mkdir(parents=True, exist_ok=True)
        for path, document in [*self.secrets.items(), (self.bootstrap_path, self.bootstrap)]:
            partial = path.with_name(f".{path.name}.partial")
            partial.write_text(json.dumps(document, indent=2) + "\n")
            partial.replace(path)
        return self.bootstrap_path


def _admin(address: str) -> dict:
    """Envoy's admin interface, for a drain before a stop (POST /drain_listeners?graceful). It has no
    authentication and can stop Envoy, so only a loopback address is taken: in a pod, the pod's own containers."""
    host, port = _host_port(address)
    if host != "localhost" and not (_is_ip(host) and ipaddress.ip_address(host).is_loopback):
        raise ValueError(f"--admin {address}: Envoy's admin interface has no authentication; give it a loopback "
                         "address (127.0.0.1:9901)")
    return {"address": {"socket_address": {"address": host, "port_value": port}}}


def _metrics_listener(address: str, admin: str) -> tuple[dict, dict]:
    """A plain-HTTP listener serving Envoy's Prometheus stats alone (``/metrics``, from the admin interface's
    ``/stats/prometheus``), so a scraper on a private network reads the edge's counters (requests, retries,
    ejections, health) without reaching the admin interface, which can stop Envoy. Every other path is 404."""
    host, port = _host_port(address)
    admin_host, admin_port = _host_port(admin)
    routes = [{"match": {"path": "/metrics"},
               "route": {"cluster": "admin", "prefix_rewrite": "/stats/prometheus", "timeout": "5s"}},
              {"match": {"prefix": "/"}, "direct_response": {"status": 404}}]
    listener = {
        "name": "metrics",
        "address": {"socket_address": {"address": host, "port_value": port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": f"{_TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "metrics", "codec_type": "AUTO",
            "route_config": {"virtual_hosts": [{"name": "metrics", "domains": ["*"], "routes": routes}]},
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                "@type": f"{_TYPES}.filters.http.router.v3.Router"}}],
        }}]}],
    }
    cluster = {"name": "admin", "type": "STATIC", "connect_timeout": "1s", "load_assignment": {
        "cluster_name": "admin", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
            "address": admin_host, "port_value": admin_port}}}}]}]}}
    return listener, cluster


_HEAP = "envoy.resource_monitors.fixed_heap"


def _overload_manager(max_connections: int, max_heap_mib: int) -> dict:
    """Envoy's overload manager: the client connections held to ``max_connections`` across its workers, and the
    heap to ``max_heap_mib``, with the heap actions of Envoy's edge best practices: at 95% Envoy returns free
    memory to the system, at 98% it refuses new requests UNAVAILABLE, naming the bound; the streams it holds go
    on. (No connection is refused at accept: a refused request says why, a closed socket does not.)"""
    if max_connections < 1:
        raise ValueError(f"--max-connections must be at least 1 (got {max_connections})")
    if max_heap_mib < 1:
        raise ValueError(f"--max-heap-mib must be at least 1 (got {max_heap_mib})")

    def at(fraction: float) -> list[dict]:
        return [{"name": _HEAP, "threshold": {"value": fraction}}]

    return {"refresh_interval": "0.25s", "resource_monitors": [
        {"name": "envoy.resource_monitors.global_downstream_max_connections",
         "typed_config": {"@type": f"{_TYPES}.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                          "max_active_downstream_connections": max_connections}},
        {"name": _HEAP, "typed_config": {"@type": f"{_TYPES}.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                                         "max_heap_size_bytes": max_heap_mib * 2**20}},
    ], "actions": [
        {"name": "envoy.overload_actions.shrink_heap", "triggers": at(0.95)},
        {"name": "envoy.overload_actions.stop_accepting_requests", "triggers": at(0.98)},
    ]}


def _listener(listen: str, downstream_tls: dict, connection_manager: dict) -> dict:
    """The public listener on ``listen`` (host:port): mTLS with ``downstream_tls``, then ``connection_manager``."""
    host, port = _host_port(listen)
    return {
        "name": "public",
        "address": {"socket_address": {"address": host, "port_value": port}},
        "per_connection_buffer_limit_bytes": CONNECTION_BUFFER_BYTES,
        "filter_chains": [{
            "filters": [connection_manager],
            "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                "@type": f"{_TYPES}.transport_sockets.tls.v3.DownstreamTlsContext", **downstream_tls}},
            # A connection that has not finished its handshake by then is closed.
            "transport_socket_connect_timeout": f"{HANDSHAKE_TIMEOUT_S}s",
        }],
    }


def edge_config(tls_dir: Path, bootstrap_path: Path, *, listen: str, gateway: str, inference: Sequence[str],
                retrieval: str, trust_domain: str = DEFAULT_TRUST_DOMAIN, keepalive_s: float = 20.0,
                max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                health_check_s: float = DEFAULT_HEALTH_CHECK_S, admin: str | None = None,
                metrics: str | None = None, inference_routing: str = "affinity",
                affinity_balance: int = DEFAULT_AFFINITY_BALANCE,
                stream_idle_s: float = DEFAULT_STREAM_IDLE_S, max_heap_mib: int = DEFAULT_MAX_HEAP_MIB) -> EdgeConfig:
    """Envoy's config for the edge: ``listen`` (host:port) public, the three services behind it.

    ``inference``: the replicas' host:port (several: least requests). The
    edge's certificate and key are ``<tls_dir>/service/edge/`` (``agentgw certs``).
    ``bootstrap_path``: where Envoy will read the bootstrap; the secret files go
    beside it. Both paths are as Envoy sees them, and made absolute.
    ``max_connections``: client connections held at once; newer ones are
    closed as they arrive. ``health_check_s``: how often each backend host's
    gRPC health is checked (0: never; outlier detection still ejects a host
    that fails). ``admin``: a loopback host:port for Envoy's admin interface
    (none by default), through which a stop drains first. ``metrics``: a
    host:port serving Envoy's Prometheus stats at ``/metrics`` (and nothing
    else; it needs ``admin``). ``inference_routing``: ``affinity`` (a
    Generate carrying ``x-agw-affinity`` goes to a second cluster of the same
    replicas, hashed on that key and the tenant's certificate by Maglev, with
    load bounded at ``affinity_balance`` percent of the average; one without
    goes by least requests) or ``least_request`` (all by load).
    ``stream_idle_s``: a stream with no frame either way for that long is
    reset, and its backend call cancelled (a client that stopped reading, a
    backend that sent nothing). ``max_heap_mib``: Envoy's heap bound, near
    which it refuses new calls (``_overload_manager``).
    """
    tls_dir, bootstrap_path = tls_dir.absolute(), bootstrap_path.absolute()
    files = IdentityFiles.of(tls_dir, EDGE)
    affine = _affine_balance(inference_routing, affinity_balance)
    downstream = {"require_client_certificate": True, "common_tls_context": _tls_context(
        files, bootstrap_path, **_spiffe_match("prefix", f"spiffe://{trust_domain}/"))}
    # File-based SDS needs the node named.
    bootstrap = {"node": {"id": "edge", "cluster": "agentgw-edge"}, "static_resources": {
        "listeners": [_listener(listen, downstream, _connection_manager(max_request_bytes, inference_routing,
                                                                          stream_idle_s))],
        "clusters": [_cluster(name, targets, files, bootstrap_path, trust_domain, keepalive_s,
                              _health(health_check_s, max_connections * MAX_STREAMS_PER_CONNECTION))
                     for name, targets in (("gateway", [gateway]), ("inference", inference), ("retrieval", [retrieval]))],
    }, "overload_manager": _overload_manager(max_connections, max_heap_mib)}
    if affine is not None:
        bootstrap["static_resources"]["clusters"].append(_cluster(
            AFFINE_INFERENCE, inference, files, bootstrap_path, trust_domain, keepalive_s,
            _health(health_check_s, max_connections * MAX_STREAMS_PER_CONNECTION), affine, service="inference"))
    if admin:
        bootstrap["admin"] = _admin(admin)
    if metrics:
        if not admin:
            raise ValueError("--metrics needs --admin: the stats it serves are the admin interface's")
        listener, cluster = _metrics_listener(metrics, admin)
        bootstrap["static_resources"]["listeners"].append(listener)
        bootstrap["static_resources"]["clusters"].append(cluster)
    return EdgeConfig(bootstrap_path, bootstrap, _secrets(files, bootstrap_path))
