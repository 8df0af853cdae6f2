"""``agentgw edge-config``: Envoy's config for the edge (agentgw.edge): the bootstrap, and the secret files beside it
that Envoy watches for renewed certificates."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servicekit.identity import DEFAULT_TRUST_DOMAIN
from servicekit.public_api import AFFINITY_HEADER

from agentgw.edge import (
    DEFAULT_AFFINITY_BALANCE,
    DEFAULT_HEALTH_CHECK_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEAP_MIB,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_STREAM_IDLE_S,
    EDGE,
    INFERENCE_ROUTING,
    edge_config,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-dir", type=Path, default=Path(".agentgw/tls"),
                        help=f"TLS folder holding {EDGE.kind}/{EDGE.name}/ (agentgw certs issues it; "
                             "default .agentgw/tls)")
    parser.add_argument("--listen", default="127.0.0.1:50051", help="the public address (default 127.0.0.1:50051)")
    parser.add_argument("--gateway", default="127.0.0.1:50054",
                        help="the Python gateway, for every method but Generate and Retrieve (default 127.0.0.1:50054)")
    parser.add_argument("--inference", default="127.0.0.1:50053",
                        help="inference replicas, comma-separated host:port (default 127.0.0.1:50053)")
    parser.add_argument("--retrieval", default="127.0.0.1:50052",
                        help="the retrieval service (default 127.0.0.1:50052)")
    parser.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN,
                        help=f"SPIFFE trust domain (default {DEFAULT_TRUST_DOMAIN})")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="largest Generate or Retrieve request the edge passes on (default "
                             f"{DEFAULT_MAX_REQUEST_BYTES}, the gateway's AGW_GATEWAY_MAX_RECEIVE_BYTES)")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help="client connections the edge holds at once; newer ones are closed as they arrive "
                             f"(default {DEFAULT_MAX_CONNECTIONS})")
    parser.add_argument("--health-check-s", type=float, default=DEFAULT_HEALTH_CHECK_S,
                        help="how often each backend host's gRPC health is checked; a host not SERVING gets no calls "
                             f"(default {DEFAULT_HEALTH_CHECK_S:g}; 0: never)")
    parser.add_argument("--max-heap-mib", type=int, default=DEFAULT_MAX_HEAP_MIB,
                        help="Envoy's heap bound: at 95%% it returns free memory to the system, at 98%% it refuses new "
                             "calls UNAVAILABLE, naming this bound, while the streams it holds go on; keep it about "
                             f"three quarters of the container's memory limit (default {DEFAULT_MAX_HEAP_MIB})")
    parser.add_argument("--stream-idle-s", type=float, default=DEFAULT_STREAM_IDLE_S,
                        help="a stream on which nothing moved either way for this long is reset, and its backend call "
                             "ended: a client that stopped reading frees its generation (default "
                             f"{DEFAULT_STREAM_IDLE_S:g}, the gateway's AGW_GATEWAY_STREAM_SEND_TIMEOUT_S)")
    parser.add_argument("--inference-routing", choices=INFERENCE_ROUTING, default="affinity",
                        help="how Generate is spread over the inference replicas: affinity hashes a call that "
                             f"carries an {AFFINITY_HEADER} header (a session id) on it and the tenant's certificate, "
                             "so a session's prompts find their cached prefix, and sends the rest by load; "
                             "least_request sends all by load (default affinity)")
    parser.add_argument("--affinity-balance", type=int, default=DEFAULT_AFFINITY_BALANCE,
                        help="affinity: a replica takes up to this percent of the replicas' average calls in flight "
                             f"before its keys spill to their next replica (default {DEFAULT_AFFINITY_BALANCE})")
    parser.add_argument("--admin", help="a loopback host:port for Envoy's admin interface (default: none), so that a "
                                        "stop can drain first: POST /drain_listeners?graceful (deploy/k8s does)")
    parser.add_argument("--metrics", help="host:port serving Envoy's Prometheus stats at /metrics, plain HTTP, for a "
                                          "private network's scraper (default: none; needs --admin)")
    parser.add_argument("--out", type=Path, required=True,
                        help="the bootstrap's path, as Envoy will see it; the two secret files (*.sds.json) go beside "
                             "it, and Envoy re-reads them when the edge's certificate is renewed")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = edge_config(args.tls_dir, args.out, listen=args.listen, gateway=args.gateway,
                             inference=[t.strip() for t in args.inference.split(",") if t.strip()],
                             retrieval=args.retrieval, trust_domain=args.trust_domain,
                             max_request_bytes=args.max_request_bytes, max_connections=args.max_connections,
                             health_check_s=args.health_check_s, admin=args.admin,
                             metrics=args.metrics, inference_routing=args.inference_routing,
                             affinity_balance=args.affinity_balance, stream_idle_s=args.stream_idle_s,
                             max_heap_mib=args.max_heap_mib)
    except ValueError as exc:
        print(f"agentgw edge-config: {exc}", file=sys.stderr)
        return 2
    path = config.write()
    print(f"wrote {path} and {', '.join(p.name for p in config.secrets)} beside it; run it with: envoy -c {path}",
          file=sys.stderr)
    return 0
