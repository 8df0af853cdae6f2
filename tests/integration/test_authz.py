"""Zero trust on loopback: every service checks who calls, once per call, before any handler runs.

The backends here are the real retrieval service (Qdrant Edge, MiniLM) and the
scripted inference service, both on the real bootstrap: authorization lives in
the shared edge wrapper of every method, so every method of each contract is refused to a
tenant before the handler could run. tests/e2e/test_authz_inference.py does
the same against the real inference service.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from agent.retrieval.v1 import retrieval_pb2
from gateway.backends import INFERENCE_SERVICE, RETRIEVAL_SERVICE
from gateway.service import GATEWAY_SERVICE
from servicekit import ChannelSpec, ClientTls, open_channel
from tests.support.calls import call_method, write_once
from tests.support.gateway_stack import gateway_server
from tests.support.grpc_client import mtls_channel
from tests.support.retrieval_service import retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.integration

ALLOWED_ON_BACKENDS = ("service/gateway", "operator/admin")


@pytest.fixture(scope="module")
async def retrieval(tmp_path_factory, pki):
    async with retrieval_server(tmp_path_factory.mktemp("authz-retrieval"), pki.root) as (running, _):
        yield running


@pytest.fixture(scope="module")
async def inference(pki):
    async with scripted_app(pki.root) as (running, _):
        yield running


@pytest.fixture(scope="module")
async def gateway(retrieval, inference, pki, database_url):
    async with gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url) as (running, _):
        yield running


def _bad_channel(port: int, pki, name: str):
    files = pki.bad(name)
    return open_channel(ChannelSpec(target=f"127.0.0.1:{port}", tls=ClientTls.from_dir(files.root)))


async def _status(channel, method) -> grpc.StatusCode:
    try:
        await call_method(channel, method)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("backend,service", [("retrieval", RETRIEVAL_SERVICE), ("inference", INFERENCE_SERVICE)])
async def test_a_tenant_certificate_is_refused_on_every_backend_rpc(retrieval, inference, pki, backend, service):
    running = {"retrieval": retrieval, "inference": inference}[backend]
    async with mtls_channel(running.port, pki.root, identity="tenant/dev") as channel:
        for method in service.methods:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call_method(channel, method)
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, (method.name, caught.value)
            assert "tenant/dev may not call" in caught.value.details()
            assert "allowed: service/gateway, operator/*" in caught.value.details()
        # Reflection would show a tenant the backend's whole contract: refused too.
        reflection = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                           request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            call = reflection(timeout=5)
            await write_once(call, b"")
            [m async for m in call]
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # The refusals were counted where they happened, with the identity.
    assert running.authorizer.peers_seen  # the tenant's serial was recorded before the refusal


@pytest.mark.parametrize("identity", ALLOWED_ON_BACKENDS)
async def test_the_gateway_and_operators_are_served_by_the_backends(retrieval, inference, pki, identity):
    async with mtls_channel(retrieval.port, pki.root, identity=identity) as channel:
        method = RETRIEVAL_SERVICE.methods_by_name["GetCollection"]
        missing = retrieval_pb2.GetCollectionRequest(name="t3-dev-nothing")
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # authorized: the handler answers NOT_FOUND
            await call_method(channel, method, missing)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    async with mtls_channel(inference.port, pki.root, identity=identity) as channel:
        [response] = await call_method(channel, INFERENCE_SERVICE.methods_by_name["Tokenize"],
                                       inference_pb2.TokenizeRequest(text="ok"))
        assert list(response.token_ids) == [ord("o"), ord("k")]


async def test_reflection_answers_the_callers_each_policy_allows(retrieval, inference, gateway, pki):
    # What grpcurl asks before a call (README): the services, then the file that defines one. A tenant on the
    # gateway (the README's grpcurl), an operator on the backends. Until 2026-12-07 every service answered
    # UNKNOWN: reflection's synchronous servicer had been registered on the asyncio server.
    for running, identity, service in ((gateway, "tenant/dev", GATEWAY_SERVICE.full_name),
                                       (retrieval, "operator/admin", RETRIEVAL_SERVICE.full_name),
                                       (inference, "operator/admin", INFERENCE_SERVICE.full_name)):
        async with mtls_channel(running.port, pki.root, identity=identity) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(timeout=10)
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            listed = await call.read()
            await call.write(reflection_pb2.ServerReflectionRequest(file_containing_symbol=service))
            described = await call.read()
            await call.done_writing()
            assert service in [s.name for s in listed.list_services_response.service], identity
            assert described.file_descriptor_response.file_descriptor_proto, described


@pytest.mark.parametrize("identity", ["tenant/dev", "service/gateway", "operator/admin"])
async def test_health_answers_any_verified_certificate(retrieval, inference, gateway, pki, identity):
    for running in (retrieval, inference, gateway):
        async with mtls_channel(running.port, pki.root, identity=identity) as channel:
            response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("bad,reason", [
    ("foreign-domain", "trust domain 'elsewhere.example', not 'agentgw.local'"),
    ("no-spiffe", "carries no SPIFFE ID"),
])
async def test_an_identity_outside_our_trust_domain_is_refused_everywhere(retrieval, inference, gateway, pki, bad,
                                                                          reason):
    for running, method in ((retrieval, RETRIEVAL_SERVICE.methods_by_name["GetCollection"]),
                            (inference, INFERENCE_SERVICE.methods_by_name["GetModelInfo"]),
                            (gateway, GATEWAY_SERVICE.methods_by_name["CreateSession"])):
        async with _bad_channel(running.port, pki, bad) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call_method(channel, method)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, caught.value
            assert reason in caught.value.details()


@pytest.mark.parametrize("identity", ["service/gateway", "service/inference", "operator/admin"])
async def test_the_gateway_serves_tenants_only(gateway, pki, identity):
    async with mtls_channel(gateway.port, pki.root, identity=identity) as channel:
        for name in ("CreateSession", "Chat", "Retrieve", "Generate", "IngestDocuments"):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call_method(channel, GATEWAY_SERVICE.methods_by_name[name])
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, (name, caught.value)
            assert f"{identity} may not call" in caught.value.details()


async def test_get_stats_answers_operators_not_tenants(gateway, pki):
    get_stats = GATEWAY_SERVICE.methods_by_name["GetStats"]
    async with mtls_channel(gateway.port, pki.root, identity="tenant/dev") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call_method(channel, get_stats)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "allowed: operator/*" in caught.value.details()
        [session] = await call_method(channel, GATEWAY_SERVICE.methods_by_name["CreateSession"],
                                      pb.CreateSessionRequest())
        assert session.session.id
    async with mtls_channel(gateway.port, pki.root, identity="operator/admin") as channel:
        [stats] = await call_method(channel, get_stats)
        assert {backend.name for backend in stats.backends} == {"inference", "retrieval"}


async def test_a_denylisted_serial_is_refused_without_a_restart(tmp_path, pki):
    denylist = tmp_path / "denied.txt"
    async with scripted_app(pki.root, denied_clients_file=denylist, tls_reload_s=0.05) as (running, _):
        tokenize = INFERENCE_SERVICE.methods_by_name["Tokenize"]
        operator_serial = pki.identity("operator/admin").cert
        async with mtls_channel(running.port, pki.root, identity="operator/admin") as channel:
            assert await _status(channel, tokenize) == grpc.StatusCode.OK
            serial = next(s for s, who in running.authorizer.peers_seen.items() if who == "operator/admin")
            assert serial == format(_serial(operator_serial), "x")
            denylist.write_text(f"# compromised laptop\n{serial.upper()}\n")
            await _eventually_refused(channel, tokenize)  # the same connection, refused from the next call on
        async with mtls_channel(running.port, pki.root, identity="service/gateway") as channel:
            assert await _status(channel, tokenize) == grpc.StatusCode.OK  # only that certificate
            denylist.write_text("service/gateway\n")
            await _eventually_refused(channel, tokenize)
            denylist.unlink()
            for _ in range(100):
                if await _status(channel, tokenize) == grpc.StatusCode.OK:
                    break
                await asyncio.sleep(0.02)
            else:
                pytest.fail("an emptied denylist still refuses")


async def _eventually_refused(channel, method) -> None:
    for _ in range(100):
        if await _status(channel, method) == grpc.StatusCode.PERMISSION_DENIED:
            return
        await asyncio.sleep(0.02)
    pytest.fail("the denylist entry was not applied within 2 s")


def _serial(path) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number
