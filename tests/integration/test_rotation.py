"""Certificates rotate live: every leaf renewed while Chat turns run, no call fails, new connections carry new serials."""

from __future__ import annotations

import asyncio
import socket
import ssl

import grpc
import pytest
from cryptography import x509

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2
from retrieval.ingest import sample_corpus
from agentgw.pki import ensure_dev_pki
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.pki import make_test_pki
from tests.support.retrieval_service import passage_documents, retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.integration

RELOAD_S = 0.2


def _serial(pem_path) -> str:
    return format(x509.load_pem_x509_certificate(pem_path.read_bytes()).serial_number, "x")


def _served_serial(port: int, pki) -> str:
    """The serial of the certificate a server presents on a new connection now."""
    files = pki.identity("operator/admin")
    context = ssl.create_default_context(cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        return format(x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number, "x")


async def _until(predicate, what: str, timeout: float = 20) -> None:
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"not within {timeout}s: {what}")


async def test_every_leaf_rotates_while_turns_run(tmp_path, database_url):
    pki = make_test_pki(tmp_path / "tls")
    reload = {"tls_reload_s": RELOAD_S}
    async with retrieval_server(tmp_path / "retrieval", pki.root, **reload) as (retrieval, _), \
            scripted_app(pki.root, **reload) as (inference, _), \
            gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url,
                           retrieval_budget_s=5.0, **reload) \
            as (gateway, app):
        async with gateway_stub(gateway.port, pki.root) as stub:
            await stub.IngestDocuments(pb.IngestDocumentsRequest(
                collection="docs", documents=passage_documents(sample_corpus(max_per_topic=1)[:8])), timeout=60)
            turn = pb.ChatRequest(message="tokens=3 delay=0.02 rotate?", retrieval=pb.RetrievalOptions(collection="docs"),
                                  generation=inference_pb2.SamplingParams(max_tokens=3))
            outcomes: list[str] = []
            stop = asyncio.Event()

            async def keep_chatting():
                while not stop.is_set():
                    try:
                        async for event in stub.Chat(turn, timeout=10):
                            if event.HasField("final"):
                                outcomes.append("degraded" if event.final.degraded else "ok")
                    except grpc.aio.AioRpcError as exc:
                        outcomes.append(f"{exc.code().name}: {exc.details()}")

            old = {name: _serial(pki.identity(name).cert)
                   for name in ("service/gateway", "service/retrieval", "service/inference", "tenant/dev")}
            chatting = [asyncio.create_task(keep_chatting()) for _ in range(3)]
            try:
                await _until(lambda: len(outcomes) >= 5, "turns before the rotation")
                ensure_dev_pki(pki.root, tenants=("dev", "other"), renew=True)  # every leaf, same CA
                new = {name: _serial(pki.identity(name).cert) for name in old}
                assert all(new[name] != old[name] for name in old)
                before_rotation = len(outcomes)

                # The gateway's pools reconnect with its renewed certificate: the backends record the new serial.
                backends = app.servicer.backends
                await _until(lambda: all(p.tls_reloads for p in backends.pools),
                             "the gateway's pools reloading")
                for running in (retrieval, inference):
                    await _until(lambda r=running: r.authorizer.peers_seen.get(new["service/gateway"]) ==
                                 "service/gateway", f"{running.port} seeing the gateway's new serial")
                # Each server presents its renewed certificate on a new connection.
                for name, running in (("service/retrieval", retrieval), ("service/inference", inference),
                                      ("service/gateway", gateway)):
                    await _until(lambda r=running, n=name: _served_serial(r.port, pki) == new[n],
                                 f"{name} serving its new certificate")
                # A client with the renewed tenant certificate is recorded under its new serial.
                async with gateway_stub(gateway.port, pki.root) as renewed:
                    await renewed.CreateSession(pb.CreateSessionRequest(), timeout=10)
                assert gateway.authorizer.peers_seen[new["tenant/dev"]] == "tenant/dev"
                assert gateway.authorizer.peers_seen[old["tenant/dev"]] == "tenant/dev"  # the old connection, still open
                await _until(lambda: len(outcomes) >= before_rotation + 10, "turns after the rotation")
            finally:
                stop.set()
                await asyncio.gather(*chatting)
    # A generous retrieval budget above: a degraded turn here means a broken channel, not a busy CPU.
    failed = [outcome for outcome in outcomes if outcome != "ok"]
    assert not failed, failed
    assert len(outcomes) >= 15
