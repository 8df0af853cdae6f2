"""mTLS on loopback: the right certificates get in, every wrong one is refused."""

from __future__ import annotations

import grpc
import pytest

from tests.support.grpc_client import health_status, mtls_channel
from tests.support.servers import scripted_server

pytestmark = pytest.mark.integration


def _credentials(pki, *, cert=None, key=None, ca=None):
    ca_pem = (ca or pki.layout.ca_cert).read_bytes()
    if cert is None:
        return grpc.ssl_channel_credentials(root_certificates=ca_pem)
    return grpc.ssl_channel_credentials(
        root_certificates=ca_pem, private_key=key.read_bytes(), certificate_chain=cert.read_bytes()
    )


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
        await _check_refused(
            server.port, _credentials(pki, cert=pki.bad.root / "client-foreign.pem", key=pki.bad.root / "client-foreign-key.pem")
        )


async def test_expired_client_certificate_is_refused(pki):
    async with scripted_server(pki.root) as server:
        await _check_refused(
            server.port, _credentials(pki, cert=pki.bad.root / "client-expired.pem", key=pki.bad.root / "client-expired-key.pem")
        )


async def test_server_certificate_with_wrong_san_is_refused_by_client(pki):
    credentials = grpc.ssl_server_credentials(
        [((pki.bad.root / "server-wrong-san-key.pem").read_bytes(), (pki.bad.root / "server-wrong-san.pem").read_bytes())],
        root_certificates=pki.layout.ca_cert.read_bytes(),
        require_client_auth=True,
    )
    async with scripted_server(pki.root, credentials=credentials) as server:
        good_client = _credentials(pki, cert=pki.layout.client_cert("dev"), key=pki.layout.client_key("dev"))
        error = await _check_refused(server.port, good_client)
        assert "hostname verification" in error.details().lower()


async def test_expired_server_certificate_is_refused_by_client(pki):
    credentials = grpc.ssl_server_credentials(
        [((pki.bad.root / "server-expired-key.pem").read_bytes(), (pki.bad.root / "server-expired.pem").read_bytes())],
        root_certificates=pki.layout.ca_cert.read_bytes(),
        require_client_auth=True,
    )
    async with scripted_server(pki.root, credentials=credentials) as server:
        good_client = _credentials(pki, cert=pki.layout.client_cert("dev"), key=pki.layout.client_key("dev"))
        await _check_refused(server.port, good_client)
