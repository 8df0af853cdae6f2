"""The gateway in-process in front of real backends, and helpers to count connections."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from agent.gateway.v1 import gateway_pb2_grpc
from gateway.service import GATEWAY_SERVICE, GatewayApp
from gateway.settings import GatewaySettings
from servicekit import running_service
from servicekit.channels import wait_ready
from tests.support.grpc_client import mtls_channel


class PeerRecorder(grpc.aio.ServerInterceptor):
    """Records the peer address of every unary call: one address per client connection."""

    def __init__(self) -> None:
        self.peers: set[str] = set()
        self.calls = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        behavior = handler.unary_unary

        async def recording(request, context):
            self.peers.add(context.peer())
            self.calls += 1
            return await behavior(request, context)

        return handler._replace(unary_unary=recording)


def established_peers(port: int) -> set[str]:
    """Remote ends of the TCP connections held ESTABLISHED on the server side of ``port``.

    Each entry is the kernel's hex ``address:port`` of one client connection.
    """
    peers = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01":  # 01 = ESTABLISHED
                peers.add(fields[2])
    return peers


@asynccontextmanager
async def gateway_server(tls_dir: Path, inference_port: int | list[int] | str, retrieval_port: int, *, database_url: str,
                         **overrides):
    """The gateway in-process; ``inference_port`` a list: replicas (AGW_GATEWAY_INFERENCE_TARGETS); a string: those
    targets as written."""
    if isinstance(inference_port, str):
        inference = {"inference_targets": inference_port}
    elif isinstance(inference_port, list):
        inference = {"inference_targets": ",".join(f"127.0.0.1:{port}" for port in inference_port)}
    else:
        inference = {"inference_target": f"127.0.0.1:{inference_port}"}
    settings = GatewaySettings(
        tls_dir=tls_dir, port=0, grace_s=1.0, reuse_port=False, database_url=database_url,
        retrieval_target=f"127.0.0.1:{retrieval_port}", **inference, **overrides,
    )
    app = GatewayApp(settings)
    async with running_service(app, settings) as running:
        yield running, app


@asynccontextmanager
async def gateway_stub(port: int, tls_dir: Path, identity: str = "tenant/dev", *, ready_within_s: float | None = None,
                       **options):
    """A tenant's (or ``identity``'s) stub on the gateway; with ``ready_within_s``, its channel is connected first
    (reconnecting until READY), for a test whose first calls must reach the gateway rather than race the handshake."""
    async with mtls_channel(port, tls_dir, identity=identity, services=[GATEWAY_SERVICE], **options) as channel:
        if ready_within_s is not None:
            await wait_ready(channel, timeout_s=ready_within_s, target=f"the gateway as {identity}")
        yield gateway_pb2_grpc.AgentGatewayStub(channel)
