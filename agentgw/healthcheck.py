"""``python -m agentgw.healthcheck``: exit 0 when the local service's gRPC health says SERVING.

For container health checks and exec probes. It finds the service from the one
``AGW_<SERVICE>_PORT`` in the environment (or ``--port`` and ``--identity``),
connects over mTLS presenting that service's own certificate (from
``$AGW_TLS_DIR/service/<name>/``, the only folder a service is given; health
answers any verified certificate) and asks ``grpc.health.v1``.
Exit 1 (with the reason on stderr) for anything else, within ``--timeout``.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicekit.identity import Identity
from servicekit.settings import ServiceSettings, SettingsError, load_settings
from servicekit.tls import ClientTls, TlsConfigError

PORT_VARIABLES = {"AGW_GATEWAY_PORT": "gateway", "AGW_RETRIEVAL_PORT": "retrieval", "AGW_INFERENCE_PORT": "inference"}


def _service(port: int | None, identity: str | None) -> tuple[int, Identity]:
    """The port to probe and the identity to present.

    Inside a service's container exactly one AGW_<SERVICE>_PORT is set: its
    port, and its own certificate (the only one it holds). Elsewhere pass
    ``--port``; the operator's certificate is presented unless ``--identity`` says otherwise.
    """
    found = [(os.environ[name], service) for name, service in PORT_VARIABLES.items() if os.environ.get(name)]
    own = found[0] if len(found) == 1 else None
    if not port and own is None:
        raise SystemExit(f"healthcheck: set exactly one of {', '.join(PORT_VARIABLES)} or pass --port "
                         f"(found {[value for value, _ in found]})")
    if identity:
        chosen = Identity.parse(identity)
    elif own is not None and (not port or int(own[0]) == port):
        chosen = Identity.service(own[1])
    else:
        chosen = Identity.operator()
    return port or int(own[0]), chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentgw.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int)
    parser.add_argument("--identity", help="certificate to present, kind/name (default: the service's own)")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    port, identity = _service(args.port, args.identity)
    try:
        settings = load_settings(ServiceSettings)
        credentials = ClientTls.for_identity(settings.tls_dir, identity).credentials()
    except (SettingsError, TlsConfigError, ValueError) as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    target = f"127.0.0.1:{port}"
    with grpc.secure_channel(target, credentials) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"healthcheck: {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if status != "SERVING":
        print(f"healthcheck: {target} is {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
