"""servicekit.server.GenericHandlersOnly: generated registration code registers generic handlers only,
and the methods are still served (on a real grpc.aio server on loopback), each wrapped by the edge once."""

from __future__ import annotations

from contextlib import asynccontextmanager

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from servicekit.authz import Authorizer, Policy
from servicekit.errors import InvalidArgument
from servicekit.identity import Identity
from servicekit.interceptors import EdgeHandlers, Readiness
from servicekit.server import GenericHandlersOnly

pytestmark = pytest.mark.unit


def _plaintext_edge() -> EdgeHandlers:
    """The edge as an insecure (development) server has it: every plaintext caller is the gateway."""
    readiness = Readiness("test")
    readiness.ready = True
    authorizer = Authorizer("test", Policy(["service/gateway"]), trust_domain="agentgw.local",
                            plaintext_identity=Identity.service("gateway"))
    return EdgeHandlers(readiness, authorizer)


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
    health_pb2_grpc.add_HealthServicer_to_server(servicer, GenericHandlersOnly(counting, _plaintext_edge()))
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


class _CountingLookups(grpc.GenericRpcHandler):
    """A service with one method, ``/agent.test.v1.Thing/Check``, that counts the server's lookups of it."""

    def __init__(self) -> None:
        self.lookups = 0

    def service(self, handler_call_details):
        self.lookups += 1
        if handler_call_details.method != "/agent.test.v1.Thing/Check":
            return None
        return grpc.unary_unary_rpc_method_handler(
            self.check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString)

    async def check(self, request, context):
        if request.service == "refuse":
            raise InvalidArgument("service", "'refuse' is refused")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@asynccontextmanager
async def _serving(service: grpc.GenericRpcHandler):
    """``service`` behind the edge, on a real grpc.aio server on loopback; yields a plaintext channel to it."""
    server = grpc.aio.server()
    GenericHandlersOnly(server, _plaintext_edge()).add_generic_rpc_handlers((service,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


async def test_the_edge_wraps_each_method_once_and_every_call_still_runs_through_it():
    service = _CountingLookups()
    async with _serving(service) as channel:
        check = channel.unary_unary("/agent.test.v1.Thing/Check",
                                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)
        for _ in range(3):
            assert (await check(health_pb2.HealthCheckRequest(), timeout=5)).status == \
                health_pb2.HealthCheckResponse.SERVING
        assert service.lookups == 1  # wrapped at the first call, kept for the others
        # The wrapper kept is the edge's: a domain error still becomes its status, naming the field.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await check(health_pb2.HealthCheckRequest(service="refuse"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "service" in refused.value.details()
        # A method the service lacks is looked up on every call and never remembered.
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await channel.unary_unary("/agent.test.v1.Thing/Nothing")(b"", timeout=5)
            assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert service.lookups == 3


class _EchoMetadata(grpc.GenericRpcHandler):
    """``/agent.test.v1.Thing/Echo``: answers with the ``x-tag`` its call carried, as ``call_metadata`` reads it,
    after a pause (so that concurrent calls interleave); records whether two reads gave one tuple."""

    def __init__(self) -> None:
        self.same_tuple: list[bool] = []
        self.rebuilt_by_grpc: list[bool] = []

    def service(self, handler_call_details):
        return grpc.unary_unary_rpc_method_handler(self.echo)

    async def echo(self, request, context):
        import asyncio

        from servicekit.call_metadata import call_metadata

        first = call_metadata(context)
        await asyncio.sleep(0.05)
        self.same_tuple.append(call_metadata(context) is first)
        self.rebuilt_by_grpc.append(context.invocation_metadata() is not context.invocation_metadata())
        return dict(first)["x-tag"].encode()


async def test_a_call_reads_the_metadata_its_lookup_was_given_not_a_new_copy():
    """grpc.aio builds a new metadata tuple on every invocation_metadata() (2 to 4 µs; bench/metadata_reads.py);
    each call reads the one its handler lookup was given, its own, however calls interleave."""
    import asyncio

    service = _EchoMetadata()
    async with _serving(service) as channel:
        echo = channel.unary_unary("/agent.test.v1.Thing/Echo")
        answers = await asyncio.gather(*(echo(b"", metadata=(("x-tag", f"call-{n}"),), timeout=5) for n in range(8)))
    assert answers == [f"call-{n}".encode() for n in range(8)]
    assert service.same_tuple == [True] * 8
    assert service.rebuilt_by_grpc == [True] * 8  # what a second context.invocation_metadata() would cost
