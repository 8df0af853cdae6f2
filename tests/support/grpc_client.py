"""Client-side helpers: channels built with the project's own factory."""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicekit import ChannelSpec, ClientTls, KeepalivePolicy, RetryPolicy, open_channel


def mtls_channel(port: int, tls_dir: Path, *, identity: str = "operator/admin", keepalive: KeepalivePolicy | None = None,
                 services=(), host: str = "127.0.0.1", retry: RetryPolicy | None = RetryPolicy()) -> grpc.aio.Channel:
    spec = ChannelSpec(
        target=f"{host}:{port}",
        tls=ClientTls.for_identity(tls_dir, identity),
        services=services,
        keepalive=keepalive or KeepalivePolicy(),
        retry=retry,
    )
    return open_channel(spec)


async def health_status(channel: grpc.aio.Channel, service: str = "", timeout: float = 5.0) -> str:
    response = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=timeout
    )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
