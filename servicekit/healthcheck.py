"""``python -m servicekit.healthcheck``: exit 0 when the local service's gRPC health says SERVING.

For container health checks and exec probes. It finds the port from the one
``AGW_<SERVICE>_PORT`` in the environment (or ``--port``), connects over
mTLS with the certificates in ``AGW_TLS_DIR`` and asks ``grpc.health.v1``.
Exit 1 (with the reason on stderr) for anything else, within ``--timeout``.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicekit.pki import GATEWAY_IDENTITY
from servicekit.settings import ServiceSettings, SettingsError, load_settings
from servicekit.tls import ClientTls, TlsConfigError

PORT_VARIABLES = ("AGW_GATEWAY_PORT", "AGW_RETRIEVAL_PORT", "AGW_INFERENCE_PORT")


def _port(explicit: int | None) -> int:
    if explicit:
        return explicit
    found = [os.environ[name] for name in PORT_VARIABLES if os.environ.get(name)]
    if len(found) != 1:
        raise SystemExit(f"healthcheck: set exactly one of {', '.join(PORT_VARIABLES)} or pass --port (found {found})")
    return int(found[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servicekit.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int)
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    try:
        settings = load_settings(ServiceSettings)
        credentials = ClientTls.from_dir(settings.tls_dir, GATEWAY_IDENTITY).credentials()
    except (SettingsError, TlsConfigError) as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    target = f"127.0.0.1:{_port(args.port)}"
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
