"""servicekit.server.GenericHandlersOnly: generated registration code registers generic handlers only,
and the methods are still served (on a real grpc.aio server on loopback)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from servicekit.server import GenericHandlersOnly

pytestmark = pytest.mark.unit


class _CountingServer:
    """A grpc.aio server that counts how handlers were registered on it."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server
        self.generic = 0
        self.registered = 0

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.generic += 1
        self.server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict) -> None:
        self.registered += 1
        self.server.add_registered_method_handlers(service_name, method_handlers)


async def test_generated_registration_goes_through_generic_handlers_only_and_still_serves():
    server = grpc.aio.server()
    counting = _CountingServer(server)
    servicer = health.aio.HealthServicer()
    # The generated function registers both ways; behind GenericHandlersOnly only the generic form arrives
    # (one pending accept task for the server, not one per method).
    health_pb2_grpc.add_HealthServicer_to_server(servicer, GenericHandlersOnly(counting))
    assert (counting.generic, counting.registered) == (1, 0)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await servicer.set("agent.test.v1.Thing", health_pb2.HealthCheckResponse.SERVING)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = await stub.Check(health_pb2.HealthCheckRequest(service="agent.test.v1.Thing"), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await channel.unary_unary("/agent.test.v1.Thing/Nothing")(b"", timeout=5)
            assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(None)
