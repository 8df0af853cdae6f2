"""mTLS on loopback: the right certificates get in, every wrong one is refused."""

from __future__ import annotations

import grpc
import pytest

from tests.support.grpc_client import health_status, mtls_channel
from tests.support.servers import scripted_server

pytestmark = pytest.mark.integration


def _credentials(pki, files=None):
    ca_pem = pki.ca.cert.read_bytes()
    if files is None:
        return grpc.ssl_channel_credentials(root_certificates=ca_pem)
    return grpc.ssl_channel_credentials(
        root_certificates=ca_pem, private_key=files.key.read_bytes(), certificate_chain=files.cert.read_bytes()
    )


def _server_credentials(pki, files):
    return grpc.ssl_server_credentials([(files.key.read_bytes(), files.cert.read_bytes())],
                                       root_certificates=pki.ca.cert.read_bytes(), require_client_auth=True)


async def _check_refused(port: int, credentials: grpc.ChannelCredentials) -> grpc.aio.AioRpcError:
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await health_status(channel, timeout=3)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    return caught.value


async def test_valid_client_certificate_gets_serving(pki):
    async with scripted_server(pki.root) as server:
        async with mtls_channel(server.port, pki.root) as channel:
            assert await health_status(channel) == "SERVING"
            assert await health_status(channel, "agent.inference.v1.Inference") == "SERVING"


async def test_client_without_certificate_is_refused(pki):
    async with scripted_server(pki.root) as server:
        await _check_refused(server.port, _credentials(pki))


async def test_client_certificate_from_another_ca_is_refused(pki):
    async with scripted_server(pki.root) as server:
        await _check_refused(server.port, _credentials(pki, pki.bad("foreign-ca")))


async def test_expired_client_certificate_is_refused(pki):
    async with scripted_server(pki.root) as server:
        await _check_refused(server.port, _credentials(pki, pki.bad("expired")))


async def test_server_certificate_with_wrong_san_is_refused_by_client(pki):
    credentials = _server_credentials(pki, pki.bad("server-wrong-san"))
    async with scripted_server(pki.root, credentials=credentials) as server:
        good_client = _credentials(pki, pki.identity("service/gateway"))
        error = await _check_refused(server.port, good_client)
        assert "hostname verification" in error.details().lower()


async def test_expired_server_certificate_is_refused_by_client(pki):
    credentials = _server_credentials(pki, pki.bad("server-expired"))
    async with scripted_server(pki.root, credentials=credentials) as server:
        good_client = _credentials(pki, pki.identity("service/gateway"))
        await _check_refused(server.port, good_client)
